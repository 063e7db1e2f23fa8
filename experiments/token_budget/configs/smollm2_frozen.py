"""The token-budget question on a real LM, frozen: SmolLM2-135M-Instruct (``workdirs/smollm2``,
converted from its GGUF) with the token-budget sweep's pinned tower (``results/token_budget/tower``);
each run trains its connector alone (stage 1, ``configs/vlm_smollm2_scenes.py``) for 300 steps of
16 scenes questions. Pool, C-Abstractor and the Qwen resampler at 4 and 16 tokens, 3 seeds, and
blind; each family's rate tuned on 512 validation questions at 16 tokens; scored by greedy exact
match on 1,024 test questions. About 25 minutes a run on a 2-core CPU, 30 runs.

    python -m experiments.token_budget --config experiments/token_budget/configs/smollm2_frozen.py
"""

from experiments.token_budget.configs import common
from vitmm.config_args import parse_arg
from vitmm.data import scenes


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    c = common.study()
    c.description = ("SmolLM2-135M-Instruct frozen; each run trains its connector alone for {steps} steps of {batch} "
                     "examples (stage 1), exact match of greedy answers.")
    c.train_config = "configs/vlm_smollm2_scenes.py"
    c.train_args = "stage=1"
    c.overrides.init = dict(vision="results/token_budget/tower", lm="workdirs/smollm2")
    c.overrides.input = dict(data_dir=None)  # None: the trainer's default TFDS folder
    c.overrides.checkpoint_every = 50  # a run killed mid-way resumes there (checkpoints change no number)
    c.blind_args = "blind=True"
    c.tune.overrides = dict(evals=dict(qa=dict(data=dict(split="validation"))))
    c.test_overrides = dict(evals=dict(qa=dict(data=dict(split="test"), num_examples=1024)))
    c.split_key = "evals.qa.data.split"
    c.kinds, c.kinds_prefix, c.examples_key = scenes.QUESTION_KINDS, "qa/acc_", "qa/examples"
    c.lm_label = "SmolLM2-135M (frozen)"
    c.out, c.workdirs, c.report = "results/vlm_smollm2/frozen", "workdirs/smol_frozen", "frozen.md"
    c.smoke = arg.smoke
    return c
