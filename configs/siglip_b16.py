"""SigLIP ViT-B/16 (sigmoid loss, chunked across devices): the full-scale config.

    python -m vitmm.train --config configs/siglip_b16.py --workdir workdirs/siglip_b16 \
        --config.input.data_dir=/data/tfds
    python -m vitmm.train --config configs/siglip_b16.py:smoke --workdir /tmp/siglip_b16_smoke

As SigLIP-B/16 (Zhai et al. 2023): a MAP-pooled ViT-B/16 without CLS and tanh-GELU, a
bidirectional 12-layer text transformer of width 768 pooled at the last token (sticky EOS
padding), 768-d embeddings, temperature 10 and bias -10 at init, the sigmoid loss passed around
the devices in chunks (memory O(local batch²)); AdamW with b2 0.95, lr 1e-3 and big_vision's decoupled
wd 1e-4 (``weight_decay`` 0.1 here: optax multiplies it by lr). Defaults to COCO captions (``data=`` names any
prepared image-text dataset whose pp yields a ``caption``). ``smoke``: one block per tower on
tiny images, for one step.
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
    c.fsdp = True
    c.tensor_parallel = 1  # devices a layer's projections are split over (a `model` mesh axis)
    c.loss = "sigmoid_chunked"
    c.max_temperature = config_dict.placeholder(float)  # SigLIP does not clamp
    c.tokenizer = config_dict.placeholder(str)
    c.log_every = 50
    c.eval_every = c.checkpoint_every = 1000
    c.keep_checkpoints = 2
    c.allow_config_change = False  # resume even where the config changes what the run computes
    c.sync_every = 8

    pp = (f"{CHOOSE_CAPTION}|random_resized_crop({{image_size}}, scale=(0.9, 1.0))|{{normalize}}|"
          "tokenize('caption', {max_len}, padding='eos')|keep('image', 'caption_tokens')")
    c.input = common.train_input(arg.data, image_size=224, keys=("image", "captions"), pp=pp, num_threads=2,
                                 workers=-1)  # reader processes of 2 threads each for the spare cores
    c.input.device_normalize = True  # uint8 to the GPU: a quarter of the bytes, the cast fused into the stem

    fast = dict(dtype_mm="bfloat16", scan=True, remat_policy="nothing_saveable")
    c.model = ml_collections.ConfigDict()
    c.model.image = dict(variant="B/16", pool="map", class_token=False, act="gelu_tanh", **fast, **common.kernels())
    c.model.text = dict(vocab_size=259, max_len=64, width=768, depth=12, num_heads=12, causal=False, pool="last",
                        act="gelu_tanh", **fast)
    c.model.embed_dim = 768
    c.model.temperature_init = 10.0
    c.model.bias_init = -10.0

    # big_vision's SigLIP: lr 1e-3, wd 1e-4 decoupled from the rate (p -= wd * schedule * p); optax's AdamW
    # multiplies the decay by the rate, so the same decay is 1e-4 / lr = 0.1 here (1e-4 here gave 1e-7 a step).
    # Adam's b2 0.95 (SigLIP's fix for large-batch instability; big_vision's b2=0.95) and optax's eps 1e-8,
    # not the CLIP defaults (0.98, 1e-6) of common.optim.
    c.optim = common.optim(lr=1e-3, warmup_steps=min(2000, arg.steps // 10), weight_decay=0.1, b2=0.95, eps=1e-8)
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
