"""Defaults shared by the contrastive configs; each file in ``configs/`` sets what it varies.

Every field a run reads is here, so ``--config.key=value`` overrides are checked against it
(the config is locked: a typo is an error naming the key).
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def contrastive(*, image: dict, text: dict, data: str, image_size: int, loss: str = "softmax",
                embed_dim: int = 128, batch_size: int = 128, total_steps: int = 1000,
                max_len: int = 64) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = total_steps
    c.batch_size = batch_size
    c.parallel = "jit"  # or "pmap"
    c.fsdp = False
    c.loss = loss  # softmax | sigmoid | sigmoid_chunked
    siglip = loss.startswith("sigmoid")
    c.max_temperature = config_dict.placeholder(float) if siglip else 100.0  # CLIP clamps t <= 100
    c.tokenizer = config_dict.placeholder(str)  # a local tokenizer.json; default: bytes
    c.log_every = 10
    c.eval_every = 500
    c.checkpoint_every = 500
    c.keep_checkpoints = 2
    c.sync_every = 8  # CPU with several devices only: block on the step every N steps

    c.input = ml_collections.ConfigDict()
    c.input.data = ml_collections.ConfigDict(dict(name=data, split="train"))
    c.input.data_dir = config_dict.placeholder(str)
    c.input.image_size = image_size
    c.input.keys = ("image", "caption")
    padding = "eos" if siglip and text.get("pool") == "last" else "pad"
    c.input.pp = (f"decode|resize({image_size})|flip_lr|value_range(-1, 1)|"
                  f"tokenize('caption', {max_len}, padding='{padding}')|keep('image', 'caption_tokens')")
    c.input.num_threads = 1
    c.input.prefetch = 8
    c.input.device_prefetch = 2

    c.model = ml_collections.ConfigDict()
    c.model.image = ml_collections.ConfigDict(image)
    c.model.text = ml_collections.ConfigDict(dict(vocab_size=259, max_len=max_len, **text))
    c.model.embed_dim = embed_dim
    c.model.temperature_init = 10.0 if siglip else 1 / 0.07
    c.model.bias_init = -10.0 if siglip else config_dict.placeholder(float)

    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-3, warmup_steps=max(total_steps // 20, 1), end_factor=0.0, weight_decay=0.1,
        b1=0.9, b2=0.98, eps=1e-6, clip_norm=1.0, freeze=(), accum_steps=1))

    c.init = ml_collections.ConfigDict()
    c.init.checkpoint = config_dict.placeholder(str)  # another run's workdir
    c.init.dont_load = ()  # regexes of parameters to keep from the fresh init

    val = ml_collections.ConfigDict(dict(name=data, split="validation"))
    c.evals = ml_collections.ConfigDict()
    c.evals.zeroshot = dict(type="zeroshot", data=val, num_examples=1000)
    c.evals.retrieval = dict(type="retrieval", data=val, num_examples=1000)
    c.evals.val = dict(type="val_loss", data=val, num_examples=1000, batch_size=256)

    c.multihost = ml_collections.ConfigDict()
    c.multihost.coordinator = config_dict.placeholder(str)  # e.g. 127.0.0.1:12345
    c.multihost.bind_address = config_dict.placeholder(str)
    c.multihost.num_processes = 1
    c.multihost.process_id = 0
    return c


SMOKE_DATA = "scenes/easy_32_256_64_64_s0"  # builds in about a second


def smoke(c: ml_collections.ConfigDict, steps: int = 4) -> ml_collections.ConfigDict:
    """Shrinks a config to a seconds-long run on a small scenes build (tests execute it)."""
    c.input.data.name = SMOKE_DATA
    c.input.pp = c.input.pp.replace(f"resize({c.input.image_size})", "resize(32)")
    c.input.image_size = 32
    c.total_steps = steps
    c.batch_size = 16
    c.log_every = 2
    c.eval_every = steps
    c.checkpoint_every = steps
    c.optim.warmup_steps = 1
    for name in ("zeroshot", "retrieval", "val"):
        c.evals[name].num_examples = 64
        c.evals[name].data.name = SMOKE_DATA
    c.evals.val.batch_size = 32
    return c


def smoke_full_scale(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A full-scale config's architecture with one block per tower on 32 px images, one step."""
    c.total_steps, c.batch_size, c.log_every, c.eval_every, c.checkpoint_every = 1, 8, 1, 1, 1
    c.model.image.depth = 1
    c.model.text.depth = 1
    c.input.pp = c.input.pp.replace(f"random_resized_crop({c.input.image_size}", "random_resized_crop(32")
    c.input.image_size = 32
    c.input.num_threads = 1
    c.optim.warmup_steps = 1
    for ev in c.evals.values():
        ev.num_examples = 16
        if ev.type == "val_loss":
            ev.batch_size = 8
    return c


def vlm(*, vision: dict, lm: dict, connector: dict, data: str, image_size: int, stage: int = 1,
        batch_size: int = 64, total_steps: int = 500, max_len: int = 64) -> ml_collections.ConfigDict:
    """A VLM run on scenes questions: stage 1 trains the connector (tower and LM frozen), stage 2
    also the LM (tower frozen), as in LLaVA."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 (connector only) or 2 (connector and LM), got {stage}.")
    c = ml_collections.ConfigDict()
    c.task = "vlm"
    c.seed = 0
    c.total_steps = total_steps
    c.batch_size = batch_size
    c.parallel = "jit"
    c.fsdp = False
    c.tokenizer = config_dict.placeholder(str)
    c.log_every = 10
    c.eval_every = total_steps
    c.checkpoint_every = total_steps
    c.keep_checkpoints = 2
    c.sync_every = 8

    c.input = ml_collections.ConfigDict()
    c.input.data = ml_collections.ConfigDict(dict(name=data, split="train"))
    c.input.data_dir = config_dict.placeholder(str)
    c.input.image_size = image_size
    c.input.keys = ("image", "questions", "answers", "question_kinds")
    c.input.pp = (f"decode|resize({image_size})|value_range(-1, 1)|choose|qa_tokens({max_len})|"
                  "keep('image', 'ids', 'answer_mask', 'prompt_len')")
    c.input.num_threads = 1
    c.input.prefetch = 8
    c.input.device_prefetch = 2

    c.model = ml_collections.ConfigDict()
    c.model.vision = ml_collections.ConfigDict(vision)
    c.model.connector = ml_collections.ConfigDict(connector)
    c.model.lm = ml_collections.ConfigDict(dict(vocab_size=259, **lm))
    c.model.vision_layer = -1
    c.model.use_cls = False
    c.model.prefix_lm = False
    c.model.max_len = max_len

    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-3 if stage == 1 else 3e-4, warmup_steps=max(total_steps // 20, 1), end_factor=0.0,
        weight_decay=0.0, b1=0.9, b2=0.98, eps=1e-6, clip_norm=1.0, accum_steps=1,
        freeze=(r"tower/.*", r"language/.*") if stage == 1 else (r"tower/.*",)))

    c.init = ml_collections.ConfigDict()
    c.init.vision = config_dict.placeholder(str)  # a CLIP run's workdir (python -m vitmm.train)
    c.init.allow_random_tower = False
    c.init.checkpoint = config_dict.placeholder(str)  # stage 2: the stage-1 workdir
    c.init.dont_load = ()

    c.evals = ml_collections.ConfigDict()
    c.evals.qa = dict(type="qa", data=dict(name=data, split="validation"), num_examples=512, batch_size=128,
                      max_new_tokens=8)

    c.multihost = ml_collections.ConfigDict()
    c.multihost.coordinator = config_dict.placeholder(str)
    c.multihost.bind_address = config_dict.placeholder(str)
    c.multihost.num_processes = 1
    c.multihost.process_id = 0
    return c


def with_data_dir(c: ml_collections.ConfigDict, data_dir: str) -> ml_collections.ConfigDict:
    """Points the run's input and every evaluator at ``data_dir``."""
    with c.unlocked():
        c.input.data_dir = data_dir
        for ev in c.evals.values():
            ev.data.data_dir = data_dir
    return c


COCO_PP = "decode|choose(keys=('captions/text',), out_keys=('caption',))"


def image_caption_data(c: ml_collections.ConfigDict, data: str, max_len: int, padding: str = "pad",
                       val_split: str = "val") -> ml_collections.ConfigDict:
    """Input and evaluation for a COCO-captions-style dataset (several captions per image: one
    is drawn per example): 224 px crops, retrieval and validation loss on ``val_split`` (no
    class labels, so no zero-shot), and the cadence of a long accelerator run."""
    c.input.keys = ("image", "captions")
    c.input.pp = (f"{COCO_PP}|random_resized_crop(224, scale=(0.9, 1.0))|value_range(-1, 1)|"
                  f"tokenize('caption', {max_len}, padding='{padding}')|keep('image', 'caption_tokens')")
    c.input.num_threads = 16
    val = dict(name=data, split=val_split, keys=("image", "captions"), pp=COCO_PP)
    del c.evals["zeroshot"]
    c.evals.retrieval = dict(type="retrieval", data=val, num_examples=5000)
    c.evals.val = dict(type="val_loss", data=val, num_examples=5000, batch_size=1024)
    c.eval_every, c.checkpoint_every, c.log_every = 1000, 1000, 50
    return c


def scenes_contrastive(arg, *, image: dict, text: dict, loss: str) -> ml_collections.ConfigDict:
    """A CPU-sized contrastive run on ``scenes/{arg.data}`` from the typed args the scenes
    configs share (``steps``, ``data``, ``parallel``, ``smoke``): 128 pairs per step, 128-d
    embeddings, byte captions of at most 64 tokens, evaluation and a checkpoint half-way and at
    the end. Returns the config locked."""
    c = contrastive(image=image, text=text, data=f"scenes/{arg.data}", image_size=int(arg.data.split("_")[1]),
                    loss=loss, embed_dim=128, batch_size=128, total_steps=arg.steps, max_len=64)
    c.parallel = arg.parallel
    c.eval_every = c.checkpoint_every = max(arg.steps // 2, 1)
    if arg.smoke:
        smoke(c)
    c.lock()
    return c
