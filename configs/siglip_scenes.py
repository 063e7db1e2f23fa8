"""SigLIP (sigmoid contrastive) on synthetic scenes: tiny towers that train on a 2-core CPU.

    python -m vitmm.train --config configs/siglip_scenes.py --workdir workdirs/siglip_scenes
    python -m vitmm.train --config configs/siglip_scenes.py:loss=sigmoid_chunked --workdir ...
    python -m vitmm.train --config configs/siglip_scenes.py:smoke --workdir /tmp/siglip_smoke

Args: ``steps``, ``data`` (scenes config), ``parallel`` (``jit``/``pmap``), ``loss``
(``sigmoid`` or ``sigmoid_chunked``, the ppermute ring), ``smoke``, ``scale``: ``demo`` (tiny towers)
or ``b16``, the GPU run of the same job with SigLIP-B/16-sized towers (MAP-pooled ViT-B/16 at 224 px, the
scenes upsampled, with sin-cos positions where SigLIP learns them; a 12-layer width-768 text tower;
tanh-GELU) in bfloat16 matmuls with ``attn``
attention (default ``cudnn``; ``xla`` on a CPU) and ``batch`` pairs a step (default 256, 128 at ``demo`` scale; as
``clip_scenes.py:scale=b16``). As in SigLIP: a bidirectional text tower pooled at the last position
(sticky EOS padding), a MAP-pooled image tower, temperature 10 and bias -10 at init, no temperature clamp.
"""

import ml_collections
from ml_collections import config_dict

from configs import common
from vitmm.config_args import given, parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_ARGS,
                    steps=400, data="easy_64", parallel="jit", loss="sigmoid", smoke=False, scale="demo", attn="cudnn",
                    batch=256)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.deterministic = False  # True: a GPU run repeats bit for bit (vitmm/train/determinism.py)
    c.total_steps = arg.steps
    c.batch_size = arg.batch if "batch" in given(arg) else 128  # (scale=b16: batch, default 256)
    c.parallel = arg.parallel
    c.fsdp = False
    c.tensor_parallel = 1  # devices a layer's projections are split over (a `model` mesh axis)
    c.loss = arg.loss  # sigmoid: all-gathered; sigmoid_chunked: text chunks passed around the devices
    c.max_temperature = config_dict.placeholder(float)  # SigLIP does not clamp
    c.tokenizer = config_dict.placeholder(str)
    c.log_every = 10
    c.eval_every = c.checkpoint_every = max(arg.steps // 2, 1)
    c.keep_checkpoints = 2
    c.allow_config_change = False  # resume even where the config changes what the run computes
    c.sync_every = 8

    pp = ("decode|resize({image_size})|flip_lr|{normalize}|"
          "tokenize('caption', {max_len}, padding='eos')|keep('image', 'caption_tokens')")
    c.input = common.train_input(f"scenes/{arg.data}", image_size=64, keys=("image", "caption"), pp=pp)

    c.model = ml_collections.ConfigDict()
    c.model.image = dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="map",
                         class_token=False, posemb="sincos2d", **common.kernels())
    c.model.text = dict(vocab_size=259, max_len=64, width=128, depth=2, mlp_dim=512, num_heads=4, causal=False,
                        pool="last")
    c.model.embed_dim = 128
    c.model.temperature_init = 10.0
    c.model.bias_init = -10.0

    c.optim = common.optim(lr=1e-3, warmup_steps=min(max(arg.steps // 20, 1), arg.steps - 1), weight_decay=0.1)
    c.init = common.init()

    val = common.data_spec(f"scenes/{arg.data}", "validation")
    c.evals = ml_collections.ConfigDict()
    c.evals.zeroshot = dict(type="zeroshot", data=val, num_examples=1000)
    c.evals.retrieval = dict(type="retrieval", data=val, num_examples=1000)
    c.evals.val = dict(type="val_loss", data=val, num_examples=1000, batch_size=256)

    if arg.scale == "b16":  # SigLIP-B/16's towers
        common.b16_scale(c, batch=arg.batch, attn=arg.attn, image=dict(pool="map", act="gelu_tanh"),
                         text=dict(width=768, mlp_dim=3072, num_heads=12, act="gelu_tanh"), embed_dim=768, lr=5e-4,
                         smoke=arg.smoke)
    elif arg.scale != "demo":
        raise ValueError(f"scale={arg.scale!r}: choose demo or b16.")

    c.multihost = common.multihost()
    if arg.smoke:
        common.smoke(c, steps=arg.steps, given=given(arg))
    c.lock()
    return c
