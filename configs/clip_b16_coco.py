"""CLIP ViT-B/16 on COCO captions: the full-scale config a GPU/TPU user launches.

    python -m vitmm.train --config configs/clip_b16_coco.py --workdir workdirs/clip_b16_coco \
        --config.input.data_dir=/data/tfds
    python -m vitmm.train --config configs/clip_b16_coco.py:batch=1024,steps=20000 --workdir ...
    python -m vitmm.train --config configs/clip_b16_coco.py:smoke --workdir /tmp/b16_smoke

``coco_captions`` must be prepared in ``data_dir`` as array_record (``tfds build coco_captions
--file_format array_record``; vitmm reads it without TensorFlow). Towers as OpenAI CLIP
ViT-B/16: 224 px, patch 16, CLS pooling, positions covering CLS, LayerNorm before the encoder,
eps 1e-5; a 12-layer causal text transformer of width 512 pooled at EOT; 512-d embeddings. Byte
tokens by default (set ``--config.tokenizer`` and ``--config.model.text.vocab_size`` for a
tokenizer.json). bfloat16 matmuls, scanned and rematerialised blocks, FSDP over the mesh.
``smoke``: the same configuration with one block per tower on tiny images, for one step.
"""

from vitmm.config_args import parse_arg
from vitmm.train import config_base


def get_config(arg=None):
    arg = parse_arg(arg, data="coco_captions", steps=10_000, batch=4096, smoke=False)
    fast = dict(dtype_mm="bfloat16", scan=True, remat_policy="nothing_saveable", norm_eps=1e-5)
    c = config_base.contrastive(
        image=dict(variant="B/16", pool="tok", posemb_layout="with_cls", pre_norm=True, embed_bias=False, **fast),
        text=dict(width=512, depth=12, num_heads=8, causal=True, pool="eot", **fast),
        data=arg.data, image_size=224, loss="softmax", embed_dim=512, batch_size=arg.batch,
        total_steps=arg.steps, max_len=77,
    )
    c.fsdp = True
    config_base.image_caption_data(c, arg.data, max_len=77, padding="pad")
    c.optim.update(dict(lr=5e-4, weight_decay=0.2, warmup_steps=min(2000, arg.steps // 10)))
    if arg.smoke:
        config_base.smoke_full_scale(c)
    c.lock()
    return c

