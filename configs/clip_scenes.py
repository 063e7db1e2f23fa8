"""CLIP (softmax contrastive) on synthetic scenes: tiny towers that train on a 2-core CPU.

    python -m vitmm.train --config configs/clip_scenes.py --workdir workdirs/clip_scenes
    python -m vitmm.train --config configs/clip_scenes.py:parallel=pmap,steps=2000 --workdir ...
    python -m vitmm.train --config configs/clip_scenes.py:smoke --workdir /tmp/clip_smoke

Args: ``steps`` (updates), ``data`` (a scenes config, e.g. ``easy_64``, ``medium_64``),
``text_len`` (caption bytes the text tower reads, default 64: most ``easy`` captions; ``hard``
captions run to ~220), ``parallel`` (``jit`` or ``pmap``), ``smoke`` (a seconds-long run on a small build), ``scale``:
``demo`` (the towers above) or ``b16``, the GPU run of the same job: OpenAI CLIP-B/16-sized
towers (ViT-B/16 at 224 px, the scenes upsampled; a 12-layer width-512 text tower) in bfloat16
matmuls with ``attn`` attention (default ``cudnn``; ``xla`` on a CPU), ``batch`` pairs a step
(default 256; 128 at ``demo`` scale) and 16 reader threads (``scale=b16,smoke``: one block per tower, on a CPU).
"""

import ml_collections
from ml_collections import config_dict

from configs import common
from vitmm.config_args import given, parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_ARGS,
                    steps=400, data="easy_64", text_len=64, parallel="jit", smoke=False, scale="demo", attn="cudnn",
                    batch=256)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.deterministic = False  # True: a GPU run repeats bit for bit (vitmm/train/determinism.py)
    c.total_steps = arg.steps
    c.batch_size = arg.batch if "batch" in given(arg) else 128  # pairs a step: each pair's negatives are the others
    c.parallel = arg.parallel  # jit (a mesh) or pmap; the same numbers either way
    c.fsdp = False
    c.tensor_parallel = 1  # devices a layer's projections are split over (a `model` mesh axis)
    c.loss = "softmax"
    c.max_temperature = 100.0  # CLIP clamps the learned temperature at 100
    c.tokenizer = config_dict.placeholder(str)  # a local tokenizer.json; default: bytes (EOS its last id)
    c.log_every = 10
    c.eval_every = c.checkpoint_every = max(arg.steps // 2, 1)
    c.keep_checkpoints = 2
    c.allow_config_change = False  # resume even where the config changes what the run computes
    c.sync_every = 8  # CPU with several devices only: block on the step every N steps

    pp = ("decode|resize({image_size})|flip_lr|{normalize}|"
          "tokenize('caption', {max_len}, padding='pad')|keep('image', 'caption_tokens')")
    c.input = common.train_input(f"scenes/{arg.data}", image_size=64, keys=("image", "caption"), pp=pp)

    c.model = ml_collections.ConfigDict()
    c.model.image = dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="gap",
                         class_token=False, posemb="sincos2d", **common.kernels())
    c.model.text = dict(vocab_size=259, max_len=arg.text_len, width=128, depth=2, mlp_dim=512, num_heads=4, causal=True,
                        pool="eot", eos_id=config_dict.placeholder(int))
    c.model.embed_dim = 128
    c.model.temperature_init = 1 / 0.07
    c.model.bias_init = config_dict.placeholder(float)  # softmax: no bias

    c.optim = common.optim(lr=1e-3, warmup_steps=min(max(arg.steps // 20, 1), arg.steps - 1), weight_decay=0.1)
    c.init = common.init()

    val = common.data_spec(f"scenes/{arg.data}", "validation")
    c.evals = ml_collections.ConfigDict()
    c.evals.zeroshot = dict(type="zeroshot", data=val, num_examples=1000)
    c.evals.retrieval = dict(type="retrieval", data=val, num_examples=1000)
    c.evals.val = dict(type="val_loss", data=val, num_examples=1000, batch_size=256)

    if arg.scale == "b16":  # OpenAI CLIP-B/16's towers
        common.b16_scale(c, batch=arg.batch, attn=arg.attn, image=dict(pool="gap"),
                         text=dict(width=512, mlp_dim=2048, num_heads=8), embed_dim=512, lr=5e-4, smoke=arg.smoke)
    elif arg.scale != "demo":
        raise ValueError(f"scale={arg.scale!r}: choose demo or b16.")

    c.multihost = common.multihost()
    if arg.smoke:
        common.smoke(c, steps=arg.steps, given=given(arg))
    c.lock()
    return c
