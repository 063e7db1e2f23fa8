"""SigLIP ViT-B/16 (sigmoid loss, chunked across devices): the full-scale config.

    python -m vitmm.train --config configs/siglip_b16.py --workdir workdirs/siglip_b16 \
        --config.input.data_dir=/data/tfds
    python -m vitmm.train --config configs/siglip_b16.py:smoke --workdir /tmp/siglip_b16_smoke

As SigLIP-B/16 (Zhai et al. 2023): a MAP-pooled ViT-B/16 without CLS and tanh-GELU, a
bidirectional 12-layer text transformer of width 768 pooled at the last token (sticky EOS
padding), 768-d embeddings, temperature 10 and bias -10 at init, the sigmoid loss passed around
the devices in chunks (memory O(local batch²)). Defaults to COCO captions (``data=`` names any
prepared image-text dataset whose pp yields a ``caption``). ``smoke``: one block per tower on
tiny images, for one step.
"""

from vitmm.config_args import parse_arg
from vitmm.train import config_base


def get_config(arg=None):
    arg = parse_arg(arg, data="coco_captions", steps=10_000, batch=4096, smoke=False)
    fast = dict(dtype_mm="bfloat16", scan=True, remat_policy="nothing_saveable")
    c = config_base.contrastive(
        image=dict(variant="B/16", pool="map", class_token=False, act="gelu_tanh", **fast),
        text=dict(width=768, depth=12, num_heads=12, causal=False, pool="last", act="gelu_tanh", **fast),
        data=arg.data, image_size=224, loss="sigmoid_chunked", embed_dim=768, batch_size=arg.batch,
        total_steps=arg.steps, max_len=64,
    )
    c.fsdp = True
    config_base.image_caption_data(c, arg.data, max_len=64, padding="eos")
    c.optim.update(dict(lr=1e-3, weight_decay=1e-4, warmup_steps=min(2000, arg.steps // 10)))
    if arg.smoke:
        config_base.smoke_full_scale(c)
    c.lock()
    return c
