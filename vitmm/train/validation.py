"""What a run's config must hold before anything is built or compiled (``validate``): counts and
intervals, the learning-rate schedule, some training data, and a batch that splits over the
devices of the data axis (and its micro-batches). Each problem is one line naming the key, its
value and the fix."""

from __future__ import annotations

import jax

from vitmm.data import formats

POSITIVE = ("total_steps", "batch_size", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
            "sync_every")


def validate(config) -> None:
    """Counts and intervals are positive integers; checked before anything is built or compiled."""
    counts = [(key, config.get(key)) for key in POSITIVE] + [("input.image_size", config.input.get("image_size"))]
    counts += [(f"input.{key}", config.input.get(key)) for key in ("num_threads",)]
    for key in ("prefetch", "device_prefetch"):  # 0 allowed: nothing ahead
        value = config.input.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"config.input.{key}={value!r}: must be an integer, at least 0.")
    lr = config.optim.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or lr < 0:
        raise ValueError(f"config.optim.lr={lr!r}: must be a number, at least 0.")
    counts += [(f"evals.{name}.{key}", ev.get(key)) for name, ev in (config.get("evals") or {}).items()
               for key in ("num_examples", "batch_size", "embed_batch_size", "max_new_tokens")]
    for key, value in counts:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config.{key}={value!r}: must be a positive integer.")
    total, warmup, end = config.total_steps, config.optim.get("warmup_steps", 0), config.optim.get("end_factor", 0.0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < total:
        raise ValueError(f"config.optim.warmup_steps={warmup!r} with total_steps={total}: must be an integer from 0 "
                         f"to {total - 1} (a warmup to the last step never decays); set --config.optim.warmup_steps="
                         "below total_steps, or the config's steps= arg, which sets both.")
    if isinstance(end, bool) or not isinstance(end, int | float) or not 0 <= end <= 1:
        raise ValueError(f"config.optim.end_factor={end!r}: must be a number from 0 to 1 (the final lr / optim.lr).")
    inp = config.input
    if not formats.raw_format(inp) and "data" not in inp and not inp.get("scenes_any"):
        raise ValueError("The run names no training data: set one of --config.input.data_path (LLaVA JSON/JSONL/YAML, "
                         "with input.image_folder), input.wds, input.csv, input.parquet or input.mixture.")
    raw = formats.raw_format(inp)
    if inp.get("packing") and raw:  # (the packer does not count and skip bad examples as the raw readers do)
        raise ValueError(f"input.packing reads a TFDS dataset (input.data) or scenes (input.scenes_any), not the raw "
                         f"files of input.{raw}: point input.data at a TFDS dataset of them, or train on input.{raw} "
                         "without input.packing.")
    n, tp = jax.device_count(), config.get("tensor_parallel", 1)
    # Batches are sharded over the mesh's data axis: n / tensor_parallel devices (Parallel checks tensor_parallel).
    per = n // tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and n % tp == 0 else n
    axis = f"the {per} devices of the data axis" + (f" ({n} devices / tensor_parallel={tp})" if per != n else "")
    if config.batch_size % per:
        raise ValueError(f"batch_size={config.batch_size} does not split over {axis}; use a multiple of {per}.")
    accum = config.optim.get("accum_steps", 1)
    # each data-axis device's rows are split into the micro-batches (pmap and jit alike)
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1 or config.batch_size % (accum * per):
        raise ValueError(f"config.optim.accum_steps={accum!r}: must be a positive integer dividing "
                         f"batch_size={config.batch_size}" + (f" / {axis}." if per > 1 else "."))
