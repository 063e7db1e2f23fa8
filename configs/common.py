"""Small builders the config files share (big_vision's ``configs/common.py`` pattern).

They hold only what no experiment varies: the optimizer's constants, initialisation and
multi-host placeholders, and the smoke shrink. Everything an experiment decides (model, data,
preprocessing, learning rate and schedule, batch size, steps, evaluators) is written out in
its own file.

Preprocessing strings are templates: ``{image_size}`` and ``{max_len}`` are filled from
``input.image_size`` and the model's ``max_len`` when the run starts, so one override
(``--config.input.image_size=96``) changes training and evaluation together.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from vitmm.train import optim as optim_lib

SMOKE_DATA = "scenes/easy_32_256_64_64_s0"  # a scenes build made in about a second


def optim(*, lr: float, warmup_steps: int, weight_decay: float, freeze=(), **more) -> ml_collections.ConfigDict:
    """AdamW, linear warmup then cosine decay to ``end_factor``·lr, b1/b2/eps as CLIP (0.9, 0.98,
    1e-6), gradients clipped at global norm 1: ``vitmm.train.optim.config``'s defaults."""
    return optim_lib.config(lr=lr, warmup_steps=warmup_steps, weight_decay=weight_decay, freeze=freeze,
                            accum_steps=1, **more)


def init(**more) -> ml_collections.ConfigDict:
    """``checkpoint``: another run's workdir to start from; ``dont_load``: regexes of the
    parameters that keep their fresh initialisation."""
    more.setdefault("dont_load", ())
    return ml_collections.ConfigDict(dict(checkpoint=config_dict.placeholder(str), **more))


def kernels(**more) -> dict:
    """How a tower or LM computes, not what it holds (``vitmm.train.tasks.KERNEL_KEYS``), in every model
    dict so that ``--config.model.vision.attn_impl=cudnn`` works: ``attn_impl`` None is XLA's attention
    (``cudnn``: cuDNN's fused one, a GPU's); None of any of them keeps what a loaded checkpoint says."""
    return dict(attn_impl=config_dict.placeholder(str), **more)


def b16_scale(c: ml_collections.ConfigDict, *, batch: int, attn: str, image: dict, text: dict, embed_dim: int,
              lr: float, smoke: bool) -> ml_collections.ConfigDict:
    """A scenes config's ``scale=b16``: the same job at a GPU's size. A ViT-B/16 image tower at 224 px (the
    scenes upsampled; ``image``: its pooling and other fields) and a 12-layer text tower (``text``: width,
    heads, ...) in bfloat16 matmuls, ``attn`` attention (``cudnn``; ``xla`` on a CPU), ``batch`` pairs a step,
    reader processes on the spare cores with uint8 images normalised on the device. With ``smoke``: one block
    a tower, read in the trainer's process, on a CPU."""
    c.batch_size = batch
    c.input.image_size = 224
    c.input.workers, c.input.num_threads = -1, 2  # reader processes of 2 threads each for the spare cores
    c.input.device_normalize = True  # uint8 to the GPU: a quarter of the bytes, the cast fused
    c.input.prefetch = 16  # grain runs no more reader threads than batches it may hold ahead
    c.model.image = dict(variant="B/16", class_token=False, posemb="sincos2d", dtype_mm="bfloat16", attn_impl=attn,
                         **image)
    c.model.text = dict(c.model.text.to_dict(preserve_field_references=True), depth=12, dtype_mm="bfloat16", **text)
    c.model.embed_dim = embed_dim
    c.optim.lr = lr
    if smoke:
        c.model.image.depth = c.model.text.depth = 1
        c.input.workers, c.input.num_threads = 0, 1
    return c


def multihost() -> ml_collections.ConfigDict:
    """Set ``coordinator`` (e.g. 127.0.0.1:12345), ``num_processes`` and ``process_id`` to
    run one process per host."""
    return ml_collections.ConfigDict(dict(coordinator=config_dict.placeholder(str),
                                          bind_address=config_dict.placeholder(str), num_processes=1, process_id=0))


def data_spec(name: str, split: str, **more) -> ml_collections.ConfigDict:
    """A TFDS dataset and split; its ``data_dir`` defaults to ``input.data_dir``."""
    return ml_collections.ConfigDict(dict(name=name, split=split, **more))


def train_input(data: str, *, image_size: int, keys: tuple, pp: str, num_threads: int = 1,
          split: str = "train", workers: int = 0) -> ml_collections.ConfigDict:
    """The training input: dataset and split, ``data_dir`` (default ``~/tensorflow_datasets``; the
    evaluators' default too), the image size that fills ``{image_size}`` in the ``pp`` template,
    the features read, reader threads (per worker process; ``workers``: 0 reads in the trainer's
    process, -1 in as many processes as the spare cores hold at num_threads each), batches prefetched
    on the host (8) and devices (2),
    and ``device_normalize`` (uint8 images to the device, the pp's final ``value_range`` or
    ``normalize`` applied there)."""
    return ml_collections.ConfigDict(dict(data=data_spec(data, split), data_dir=config_dict.placeholder(str),
                                          image_size=image_size, keys=tuple(keys), pp=pp, num_threads=num_threads,
                                          workers=workers, prefetch=8, device_prefetch=2,
                                          device_normalize=False))


def raw_data(**more) -> dict:
    """The raw-data keys of an evaluator's ``data`` (``vitmm.data.formats``), named as open_clip's and
    LLaVA's flags: a run reads the one of ``wds``, ``csv``, ``parquet``, ``data_path`` and ``mixture``
    that is set."""
    return dict(
        wds=config_dict.placeholder(str),  # tar shards: 'shards/{00000..00099}.tar' (several joined by ::)
        csv=config_dict.placeholder(str),  # a CSV/TSV of image paths and captions
        csv_img_key="filepath", csv_caption_key="title",
        csv_separator=config_dict.placeholder(str),  # default: tab for .tsv, else comma
        parquet=config_dict.placeholder(str),  # Hugging Face parquet files (glob or brace pattern)
        parquet_image_key=config_dict.placeholder(str), parquet_text_key=config_dict.placeholder(str),
        data_path=config_dict.placeholder(str),  # LLaVA JSON / JSONL
        image_folder=config_dict.placeholder(str),  # where the JSON's (or CSV's) image paths start
        mixture=config_dict.placeholder(list),  # [dict(data_path=..., sampling='first:1000', weight=...), ...]
        sampling="all",  # LLaVA-NeXT's subsampling: all, first:N, end:N, random:N, random:P%
        **more,
    )


def raw_input(**more) -> dict:
    """``config.input`` for raw data: ``raw_data``'s keys and the training reader's own (what stops the
    run on bad data, reader processes, uint8 images to the device), which evaluators do not read."""
    return raw_data(
        max_skipped_share=0.01,  # stop when more of the examples read are bad than this
        workers=0,  # input worker processes (0: threads in the trainer's process; -1: the spare cores / num_threads)
        device_normalize=False,  # uint8 images to the device, the pp's final value_range/normalize done there
        **more,
    )


SMOKE_ARGS = {"smoke": {"steps": 4}}  # parse_arg presets: smoke shortens the run unless steps are given
SMOKE_FULL_SCALE_ARGS = {"smoke": {"steps": 1, "batch": 8}}  # smoke_full_scale's one step of 8
SMOKE_LLAVA_ARGS = {"smoke": {"steps": 4, "batch": 4}}  # the LLaVA stages' smoke


def smoke(c: ml_collections.ConfigDict, steps: int = 4, batch_size: int = 16,
          given: frozenset = frozenset()) -> ml_collections.ConfigDict:
    """The same run shrunk to seconds on a small scenes build at 32 px (tests execute it). Config
    args ``given`` explicitly (``config_args.given``: ``data``, ``batch``) keep their values."""
    if "data" not in given:
        c.input.data.name = SMOKE_DATA
    c.input.image_size = 32
    c.input.workers = 0
    c.total_steps = steps
    if "batch" not in given:
        c.batch_size = batch_size
    c.log_every, c.eval_every, c.checkpoint_every = 2, steps, steps
    c.optim.warmup_steps = min(1, steps - 1)  # none in a one-step run
    for tower in ("image", "text", "vision"):  # one block a tower: a smoke process traces and lowers ~30%
        if "depth" in c.model.get(tower, {}):  # less (8.3 s against 11.5 s for clip_scenes:smoke, cache warm)
            c.model[tower].depth = 1
    for ev in c.evals.values():
        if "data" not in given:
            ev.data.name = SMOKE_DATA
        ev.num_examples = 64
        if "batch_size" in ev:
            ev.batch_size = 32
    return c


def smoke_full_scale(c: ml_collections.ConfigDict, steps: int = 1, batch_size: int = 8) -> ml_collections.ConfigDict:
    """A full-scale config's architecture with one block per tower on 32 px images, one step."""
    c.total_steps, c.batch_size, c.log_every, c.eval_every, c.checkpoint_every = steps, batch_size, 1, steps, steps
    c.model.image.depth = 1
    c.model.text.depth = 1
    c.input.image_size = 32
    c.input.num_threads, c.input.workers = 1, 0
    c.optim.warmup_steps = min(1, steps - 1)  # none in a one-step run
    for ev in c.evals.values():
        ev.num_examples = 16
        if ev.type == "val_loss":
            ev.batch_size = 8
    return c
