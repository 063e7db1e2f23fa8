"""The token-budget study on your own tower, LM and LLaVA-format data: LLaVA's stage 1 (the
connector alone, the tower and the LM frozen; ``configs/llava_pretrain.py``) for each family ×
budget × seed, compared by the held-out answer-token accuracy (``val/token_acc``: teacher-forced,
on the assistant turns of held-out conversations). Set the paths to yours: a tower and an LM
converted with ``python -m vitmm.interop`` (or ``vitmm.train`` workdirs), the training
conversations, and two held-out files, one to tune each family's rate on and one to compare on.

    python -m experiments.token_budget --config experiments/token_budget/configs/llava.py \\
        --set overrides.init.vision=workdirs/siglip_so400m --set overrides.init.lm=workdirs/qwen2_0_5b \\
        --set overrides.input.data_path=llava/blip_laion_cc_sbu_558k.json \\
        --set overrides.input.image_folder=llava/images \\
        --set tune.overrides.evals.val.data.data_path=llava/val.json \\
        --set test_overrides.evals.val.data.data_path=llava/test.json

Scenes conversations for a try: ``python -m vitmm.data examples --format llava --out /tmp/llava``.
There is no blind row (the LLaVA configs have no blank-image baseline); the families are compared
with one another, paired by seed.
"""

from experiments.token_budget.configs import common
from vitmm.config_args import parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    c = common.study()
    c.description = ("Each run trains its connector alone (LLaVA's stage 1, the tower and the LM frozen) for {steps} "
                     "steps of {batch} conversations; compared by the held-out answer-token accuracy.")
    c.train_config = "configs/llava_pretrain.py"
    c.train_args = "" if arg.smoke else "batch=32"  # an explicit batch would win over the smoke's 4
    c.overrides.init = dict(vision="workdirs/clip_scenes", lm="workdirs/smollm2")
    c.overrides.input = dict(data_path=None, image_folder=None, data_dir=None)
    c.overrides.evals = dict(val=dict(data=dict(image_folder=None), num_examples=500))
    c.families = ("pool", "pixel_shuffle", "c_abstractor", "qwen_resampler", "perceiver")
    c.budgets = (4, 16, 64)
    c.steps = 1000
    c.tune.budget = 16
    c.tune.overrides = dict(evals=dict(val=dict(data=dict(data_path=None))))
    c.test_overrides = dict(evals=dict(val=dict(data=dict(data_path=None))))
    c.split_key = "evals.val.data.data_path"
    c.metric, c.metric_label, c.higher_is_better = "val/token_acc", "held-out answer-token accuracy", True
    c.lm_label = "the converted LM (frozen)"
    c.out, c.workdirs, c.report = "results/token_budget/llava", "workdirs/token_budget_llava", "study.md"
    c.smoke = arg.smoke
    return c
