"""CLIP ViT-B/16 on COCO captions: the full-scale config a GPU/TPU user launches.

    python -m vitmm.train --config configs/clip_b16_coco.py --workdir workdirs/clip_b16_coco \
        --config.input.data_dir=/data/tfds
    python -m vitmm.train --config configs/clip_b16_coco.py:batch=1024,steps=20000 --workdir ...
    python -m vitmm.train --config configs/clip_b16_coco.py:smoke --workdir /tmp/b16_smoke

``coco_captions`` must be prepared in ``data_dir`` as array_record (``tfds build coco_captions
--file_format array_record``; vitmm reads it without TensorFlow). Towers as OpenAI CLIP
ViT-B/16: 224 px, patch 16, CLS pooling, positions covering CLS, LayerNorm before the encoder,
eps 1e-5; a 12-layer causal text transformer of width 512 pooled at EOT; 512-d embeddings. The
MLPs use GELU, as open_clip's ViT-B-16 (OpenAI's weights use QuickGELU: ``act="quick_gelu"`` in
both towers' dicts below to match them). Byte
tokens by default (set ``--config.tokenizer`` and ``--config.model.text.vocab_size`` for a
tokenizer.json, and ``--config.model.text.eos_id`` unless its EOS is its last id). bfloat16
matmuls, scanned and rematerialised blocks, FSDP over the mesh.
``smoke``: the same configuration with one block per tower on tiny images, for one step.
"""

import ml_collections
from ml_collections import config_dict

from configs import common
from vitmm.config_args import parse_arg

CHOOSE_CAPTION = "decode|choose(keys=('captions/text',), out_keys=('caption',))"  # one of an image's captions


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_FULL_SCALE_ARGS, data="coco_captions", steps=10_000, batch=4096,
                    smoke=False)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.deterministic = False  # True: a GPU run repeats bit for bit (vitmm/train/determinism.py)
    c.total_steps = arg.steps
    c.batch_size = arg.batch
    c.parallel = "jit"
    c.fsdp = True  # large parameters and their optimizer moments sharded over the mesh
    c.tensor_parallel = 1  # devices a layer's projections are split over (a `model` mesh axis)
    c.loss = "softmax"
    c.max_temperature = 100.0
    c.tokenizer = config_dict.placeholder(str)
    c.log_every = 50
    c.eval_every = c.checkpoint_every = 1000
    c.keep_checkpoints = 2
    c.allow_config_change = False  # resume even where the config changes what the run computes
    c.sync_every = 8

    pp = (f"{CHOOSE_CAPTION}|random_resized_crop({{image_size}}, scale=(0.9, 1.0))|{{normalize}}|"
          "tokenize('caption', {max_len}, padding='pad')|keep('image', 'caption_tokens')")
    c.input = common.train_input(arg.data, image_size=224, keys=("image", "captions"), pp=pp, num_threads=2,
                                 workers=-1)  # reader processes of 2 threads each for the spare cores
    c.input.device_normalize = True  # uint8 to the GPU: a quarter of the bytes, the cast fused into the stem

    fast = dict(dtype_mm="bfloat16", scan=True, remat_policy="nothing_saveable", norm_eps=1e-5)
    c.model = ml_collections.ConfigDict()
    c.model.image = dict(variant="B/16", pool="tok", posemb_layout="with_cls", pre_norm=True, embed_bias=False,
                         **fast, **common.kernels())
    c.model.text = dict(vocab_size=259, max_len=77, width=512, depth=12, num_heads=8, causal=True, pool="eot",
                        eos_id=config_dict.placeholder(int), **fast)
    c.model.embed_dim = 512
    c.model.temperature_init = 1 / 0.07
    c.model.bias_init = config_dict.placeholder(float)

    c.optim = common.optim(lr=5e-4, warmup_steps=min(2000, arg.steps // 10), weight_decay=0.2)
    c.init = common.init()

    # No labels: no zero-shot. Retrieval scores all of an image's captions (~5), as published COCO
    # R@k does (image→text: a hit when any of them ranks in the top k), on the first 5000 images of
    # TFDS's val split (not Karpathy's 5k test images); val_loss pairs each image with one caption.
    every_caption = common.data_spec(arg.data, "val", keys=("image", "captions"), captions="captions/text")
    one_caption = common.data_spec(arg.data, "val", keys=("image", "captions"), pp=CHOOSE_CAPTION)
    c.evals = ml_collections.ConfigDict()
    c.evals.retrieval = dict(type="retrieval", data=every_caption, num_examples=5000)
    c.evals.val = dict(type="val_loss", data=one_caption, num_examples=5000, batch_size=1024)

    c.multihost = common.multihost()
    if arg.smoke:
        common.smoke_full_scale(c, steps=arg.steps, batch_size=arg.batch)
    c.lock()
    return c
