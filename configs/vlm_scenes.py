"""A small VLM on scenes questions: the CLIP tower of `configs/clip_scenes.py`, a connector under
a token budget, and a 4-layer Llama-style LM on bytes.

    python -m vitmm.train --config configs/clip_scenes.py --workdir workdirs/clip_scenes   # the tower
    python -m vitmm.train --config configs/vlm_scenes.py:connector=pool,budget=16,stage=1 \
        --workdir workdirs/vlm_pool16_s1 --config.init.vision=workdirs/clip_scenes
    python -m vitmm.train --config configs/vlm_scenes.py:connector=pool,budget=16,stage=2 \
        --workdir workdirs/vlm_pool16_s2 --config.init.vision=workdirs/clip_scenes \
        --config.init.checkpoint=workdirs/vlm_pool16_s1
    python -m vitmm.train --config configs/vlm_scenes.py:smoke --workdir /tmp/vlm_smoke

Args: ``connector`` (a name in ``vitmm.models.connectors.REGISTRY``), ``budget`` (visual tokens,
or ``all``), ``stage`` (1: connector only; 2: connector and LM; the tower stays frozen), ``steps``,
``data`` (a scenes config), ``smoke``.
"""

from vitmm.config_args import parse_arg
from vitmm.train import config_base

TOWER = dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="gap", class_token=False,
             posemb="sincos2d")  # must match configs/clip_scenes.py's image tower


def get_config(arg=None):
    arg = parse_arg(arg, connector="mlp", budget="all", stage=1, steps=500, data="easy_64", smoke=False)
    budget = arg.budget if arg.budget == "all" else int(arg.budget)
    c = config_base.vlm(
        vision=TOWER, lm=dict(width=128, depth=4, num_heads=4), connector=dict(name=arg.connector, budget=budget),
        data=f"scenes/{arg.data}", image_size=int(arg.data.split("_")[1]), stage=arg.stage,
        total_steps=arg.steps,
    )
    if arg.smoke:
        c.input.data.name = config_base.SMOKE_DATA
        c.evals.qa.data.name = config_base.SMOKE_DATA
        c.input.pp = c.input.pp.replace(f"resize({c.input.image_size})", "resize(32)")
        c.input.image_size = 32
        c.total_steps, c.batch_size, c.log_every, c.eval_every, c.checkpoint_every = 4, 8, 2, 4, 4
        c.model.lm.update(dict(width=32, depth=1))
        c.evals.qa.num_examples, c.evals.qa.batch_size = 16, 8
        c.init.allow_random_tower = True
    c.lock()
    return c
