"""CLIP or SigLIP on your own image–text pairs: webdataset tar shards (img2dataset's layout), a
CSV/TSV of image paths and captions, or Hugging Face parquet files.

    python -m vitmm.data examples --format wds --out /tmp/pairs --num 2048     # or your own shards
    python -m vitmm.data check --wds '/tmp/pairs/{00000..00020}.tar'
    python -m vitmm.train --config configs/clip_wds.py --workdir workdirs/clip_wds \\
        --config.input.wds='/tmp/pairs/{00000..00020}.tar'
    python -m vitmm.train --config configs/clip_wds.py:loss=sigmoid --workdir workdirs/siglip_csv \\
        --config.input.csv=train.csv --config.input.csv_img_key=filepath --config.input.csv_caption_key=title
    python -m vitmm.train --config configs/clip_wds.py:smoke --workdir /tmp/clip_wds_smoke --config.input.wds=...

Args: ``loss`` (``softmax``: CLIP; ``sigmoid``: SigLIP), ``steps``, ``scale`` (``demo``: the
scenes-sized towers at 64 px, trains on a CPU; ``b16``: OpenAI CLIP-B/16-sized towers at 224 px in
bfloat16, the GPU run), ``smoke``. Set exactly one of ``input.wds``, ``input.csv`` or
``input.parquet`` (or ``input.mixture``); ``evals.retrieval.data`` takes the same keys for held-out
pairs (no evaluation when unset).
"""

import ml_collections
from ml_collections import config_dict

from configs import common
from vitmm.config_args import parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, presets=common.SMOKE_ARGS, loss="softmax", steps=1000, scale="demo", smoke=False)
    if arg.loss not in ("softmax", "sigmoid"):
        raise ValueError(f"loss={arg.loss!r}: choose softmax (CLIP) or sigmoid (SigLIP).")
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.deterministic = False  # True: a GPU run repeats bit for bit (vitmm/train/determinism.py)
    c.total_steps = arg.steps
    c.batch_size = 128  # image-caption pairs per step: each pair's negatives are the rest of the batch
    c.parallel = "jit"
    c.fsdp = False
    c.tensor_parallel = 1  # devices a layer's projections are split over (a `model` mesh axis)
    c.loss = arg.loss
    c.max_temperature = 100.0 if arg.loss == "softmax" else config_dict.placeholder(float)  # SigLIP does not clamp
    c.tokenizer = config_dict.placeholder(str)  # a local tokenizer.json; default: bytes
    c.log_every = 10
    c.eval_every = c.checkpoint_every = max(arg.steps // 4, 1)
    c.keep_checkpoints = 2
    c.allow_config_change = False
    c.sync_every = 8

    # A random crop of 90-100% of the image (torchvision's rule, as open_clip's training transform; it
    # resizes bicubic, add method='bicubic' to match), then resize. {normalize}:
    # value_range(-1, 1), or normalize(mean, std) with what init.checkpoint records (a converted CLIP).
    pp = ("decode|random_resized_crop({image_size}, scale=(0.9, 1.0))|{normalize}|"
          "tokenize('caption', {max_len}, padding=" + ("'eos'" if arg.loss == "sigmoid" else "'pad'")
          + ")|keep('image', 'caption_tokens')")
    c.input = ml_collections.ConfigDict(dict(
        common.raw_input(), image_size=64, pp=pp, num_threads=2, prefetch=64, device_prefetch=2))

    c.model = ml_collections.ConfigDict()
    c.model.image = dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="gap",
                         class_token=False, posemb="sincos2d", **common.kernels())
    # softmax: CLIP's causal text tower pooled at EOT; sigmoid: SigLIP's bidirectional one pooled at the
    # last position (the pp pads with EOS, "sticky")
    c.model.text = dict(vocab_size=259, max_len=64, width=128, depth=2, mlp_dim=512, num_heads=4,
                        causal=arg.loss == "softmax", pool="eot" if arg.loss == "softmax" else "last",
                        eos_id=config_dict.placeholder(int))
    c.model.embed_dim = 128
    c.model.temperature_init = 1 / 0.07 if arg.loss == "softmax" else 10.0
    c.model.bias_init = config_dict.placeholder(float) if arg.loss == "softmax" else -10.0

    c.optim = common.optim(lr=1e-3, warmup_steps=min(max(arg.steps // 20, 1), arg.steps - 1), weight_decay=0.1)
    c.init = common.init()

    # Held-out pairs in any raw format (e.g. retrieval.data.wds='val/{00000..00001}.tar').
    c.evals = ml_collections.ConfigDict()
    c.evals.retrieval = dict(type="retrieval", data=common.raw_data(split="validation"), num_examples=1000)

    if arg.scale == "b16":
        c.batch_size, c.input.image_size = 256, 224
        c.input.workers, c.input.num_threads = -1, 2  # reader processes of 2 threads each for the spare cores
        c.input.device_normalize = True  # uint8 to the GPU: a quarter of the bytes, the cast fused
        c.model.image = dict(variant="B/16", pool="gap", class_token=False, posemb="sincos2d", dtype_mm="bfloat16",
                             attn_impl="cudnn")
        c.model.text = dict(c.model.text.to_dict(preserve_field_references=True), width=512, depth=12, mlp_dim=2048,
                            num_heads=8, dtype_mm="bfloat16")
        c.model.embed_dim = 512
        c.optim.lr = 5e-4
    elif arg.scale != "demo":
        raise ValueError(f"scale={arg.scale!r}: choose demo or b16.")

    c.multihost = common.multihost()
    if arg.smoke:
        c.total_steps, c.batch_size = arg.steps, 8
        c.log_every, c.eval_every, c.checkpoint_every = 2, arg.steps, arg.steps
        c.input.image_size, c.input.num_threads, c.input.workers = 32, 1, 0
        c.optim.warmup_steps = min(1, arg.steps - 1)  # none in a one-step run
        c.evals.retrieval.num_examples = 16
        c.model.image.depth = c.model.text.depth = 1  # one block a tower, as common.smoke
        if arg.scale == "b16":
            c.model.image.attn_impl = "xla"
    c.lock()
    return c
