"""SigLIP (sigmoid contrastive) on synthetic scenes: tiny towers that train on a 2-core CPU.

    python -m vitmm.train --config configs/siglip_scenes.py --workdir workdirs/siglip_scenes
    python -m vitmm.train --config configs/siglip_scenes.py:loss=sigmoid_chunked --workdir ...
    python -m vitmm.train --config configs/siglip_scenes.py:smoke --workdir /tmp/siglip_smoke

Args: ``steps``, ``data`` (scenes config), ``parallel`` (``jit``/``pmap``), ``loss``
(``sigmoid`` or ``sigmoid_chunked``, the ppermute ring), ``smoke``. As in SigLIP: a
bidirectional text tower pooled at the last position (sticky EOS padding), a MAP-pooled image
tower, temperature 10 and bias -10 at init, no temperature clamp.
"""

from vitmm.config_args import parse_arg
from vitmm.train import config_base


def get_config(arg=None):
    arg = parse_arg(arg, steps=400, data="easy_64", parallel="jit", loss="sigmoid", smoke=False)
    return config_base.scenes_contrastive(
        arg,
        image=dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8,
                   pool="map", class_token=False, posemb="sincos2d"),
        text=dict(width=128, depth=2, mlp_dim=512, num_heads=4, causal=False, pool="last"),
        loss=arg.loss,
    )
