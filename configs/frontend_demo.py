"""Front-end demo: a deterministic synthetic image through a ViT, with token counts and costs.

Run it (``make demo`` trains CLIP instead: ``configs/clip_scenes.py``):

    python -m vitmm.demo --config configs/frontend_demo.py
    python -m vitmm.demo --config configs/frontend_demo.py:variant=L/14,image_size=336
    python -m vitmm.demo --config configs/frontend_demo.py --config.model.num_registers=4

Args: ``variant`` (e.g. ``B/16``), ``image_size``, ``smoke`` (a seconds-long run on ViT-Ti/16).
"""

import ml_collections

from vitmm.config_args import given, parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, variant="B/16", image_size=224, smoke=False)
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.image_size = arg.image_size
    config.model = ml_collections.ConfigDict(
        dict(
            variant="Ti/16" if arg.smoke and "variant" not in given(arg) else arg.variant,
            posemb="learn",
            # The learned table covers the CLS position (timm/CLIP layout), so the parameter
            # count printed is the published one (ViT-B/16: 85,798,656).
            posemb_layout="with_cls",
            pool="tok",
            num_registers=0,
            dtype_mm="float32",
        )
    )
    # Rows of the token-count table: resolutions × patch sizes, costed for this variant.
    config.table_resolutions = (224, 256, 336, 384, 448, 512)
    config.table_patches = (8, 14, 16, 32)
    config.variants = ("Ti", "S", "B", "L", "H") if not arg.smoke else ("mu", "Ti")
    config.lock()
    return config
