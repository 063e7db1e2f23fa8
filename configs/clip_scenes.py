"""CLIP (softmax contrastive) on synthetic scenes: tiny towers that train on a 2-core CPU.

    python -m vitmm.train --config configs/clip_scenes.py --workdir workdirs/clip_scenes
    python -m vitmm.train --config configs/clip_scenes.py:parallel=pmap,steps=2000 --workdir ...
    python -m vitmm.train --config configs/clip_scenes.py:smoke --workdir /tmp/clip_smoke

Args: ``steps`` (updates), ``data`` (a scenes config, e.g. ``easy_64``, ``medium_64``),
``parallel`` (``jit`` or ``pmap``), ``smoke`` (a seconds-long run on a small build).
"""

from vitmm.config_args import parse_arg
from vitmm.train import config_base


def get_config(arg=None):
    arg = parse_arg(arg, steps=400, data="easy_64", parallel="jit", smoke=False)
    return config_base.scenes_contrastive(
        arg,
        image=dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8,
                   pool="gap", class_token=False, posemb="sincos2d"),
        text=dict(width=128, depth=2, mlp_dim=512, num_heads=4, causal=True, pool="eot"),
        loss="softmax",
    )
