"""The input pipeline: any TFDS dataset (array_record) → grain → batches → devices.

    source = get_source("scenes/easy_64", "train", data_dir)
    pp = preprocess.parse("decode|flip_lr|value_range(-1, 1)|tokenize('caption', 48)|keep(...)")
    it = train_iterator(source, pp, global_batch_size=256, seed=0)
    batch = next(it); state = it.get_state(); ...; it.set_state(state)   # exact resume

Training batches: each process reads its own slice of the records (``process_index`` of
``process_count``), shuffles with a seed, repeats forever, augments with per-example random
streams, and batches with drop-remainder. Evaluation batches: every record exactly once, spread
over processes, the last batch padded and marked by ``batch["_mask"]`` (0 for padding) so that no
example is lost or counted twice.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Iterator

import grain
import jax
import numpy as np
import tensorflow_datasets as tfds

from vitmm.data import scenes_builder, skips
from vitmm.data import workers as workers_lib

DEFAULT_DATA_DIR = scenes_builder.DEFAULT_DATA_DIR
SCENES = "scenes"


class SafeSource:
    """A random-access source whose read errors name the dataset, split and record index."""

    def __init__(self, source, name: str, split: str):
        self._source, self.name, self.split = source, name, split

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int):
        try:
            return self._source[index]
        except Exception as err:  # noqa: BLE001 - re-raised with the record's address
            raise ValueError(
                f"Cannot read record {index} of split {self.split!r} of dataset {self.name!r}: "
                f"{type(err).__name__}: {err}. The file may be corrupt; rebuild the dataset."
            ) from err

    def __repr__(self) -> str:
        return f"SafeSource({self.name!r}, split={self.split!r}, {len(self)} records)"


def _data_dir(data_dir: str | None) -> str:
    return str(pathlib.Path(data_dir or DEFAULT_DATA_DIR).expanduser())


def get_source(name: str, split: str, data_dir: str | None = None,
               keys: tuple[str, ...] | None = None) -> SafeSource:
    """A random-access source for ``split`` of TFDS dataset ``name`` in ``data_dir``.

    ``scenes[/CONFIG]`` is built on first use (offline, seconds). Any other dataset must already
    be prepared in ``data_dir`` as array_record; nothing is downloaded. With ``keys``, records hold
    only those top-level features; for scenes only those are even parsed and decoded (records
    also carry facts and questions that a contrastive run never looks at).
    """
    data_dir = _data_dir(data_dir)
    raw = tfds.decode.DeserializeMethod.RAW_BYTES if keys else None
    if name == SCENES or name.startswith(SCENES + "/"):
        config = name.split("/", 1)[1] if "/" in name else scenes_builder.Scenes.DEFAULT_CONFIG_NAME
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if jax.process_index() == 0:
                scenes_builder.prepare(config, data_dir)
            multihost_utils.sync_global_devices("vitmm_scenes_prepared")
        builder = scenes_builder.prepare(config, data_dir)
        source = _split_source(builder, name, split, raw)
        features = builder.info.features
    else:
        # Decoded records, filtered below: the raw-bytes path would also bypass
        # tfds.testing.mock_data, and for photo datasets the image decode dominates anyway.
        source = _prepared_source(name, split, data_dir)
        features = source.dataset_info.features if keys else None
    if keys:
        source = KeySource(source, features, tuple(keys), name)
    return SafeSource(source, name, split)


def source_for(data: dict, keys: tuple[str, ...] | None = None):
    """The source a data spec names (``name``, ``split``, ``data_dir``): a TFDS dataset
    (``get_source``), raw files (``data_path``, ``wds``, ``csv``, ``parquet``: ``data.formats``;
    ``keys`` does not apply), or with ``scenes_any`` (``data.packing.SceneSource``'s settings) scenes at
    random sizes made on the fly, of ``split``."""
    from vitmm.data import formats

    if formats.raw_format(data):  # the user's files: LLaVA JSON, tar shards, CSV, parquet
        return formats.source_from(data)
    if data.get("scenes_any"):
        from vitmm.data.packing import SceneSource

        return SceneSource(**{**dict(data["scenes_any"]), "split": data["split"]})
    return get_source(data["name"], data["split"], data.get("data_dir"), keys=keys)


class KeySource:
    """Parses and decodes only ``keys`` of each record, with TFDS's own feature decoders.

    Records arrive as serialized bytes; a ``FeaturesDict`` of just the wanted features skips
    everything else at parse time. (A source that already yields dicts, e.g. under
    ``tfds.testing.mock_data``, is simply filtered.)
    """

    def __init__(self, raw_source, features, keys: tuple[str, ...], name: str):
        missing = [k for k in keys if k not in features]
        if missing:
            raise ValueError(f"Dataset {name!r} has no feature(s) {missing}; it has {sorted(features)}.")
        self._raw, self.keys = raw_source, keys
        self._features = tfds.features.FeaturesDict({k: features[k] for k in keys})

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, index: int) -> dict:
        record = self._raw[index]
        if isinstance(record, dict):
            return {k: record[k] for k in self.keys}
        return self._features.deserialize_example_np(record)


def _split_source(builder, name: str, split: str, deserialize_method=None):
    available = list(builder.info.splits)
    if split.split("[")[0] not in available:
        raise ValueError(f"Dataset {name!r} has no split {split!r}; it has {available}.")
    kwargs = {"deserialize_method": deserialize_method} if deserialize_method else {}
    return builder.as_data_source(split=split, **kwargs)


def _prepared_source(name: str, split: str, data_dir: str, deserialize_method=None):
    """The data source of a prepared dataset, or an error that says what to do.

    First TFDS's own ``tfds.data_source`` (the registered builder's code; also what
    ``tfds.testing.mock_data`` mocks); then a read-only builder from the files alone, for
    datasets such as ``coco_captions`` whose builder code imports TensorFlow.
    """
    from tensorflow_datasets.core import read_only_builder

    kwargs = {"deserialize_method": deserialize_method} if deserialize_method else {}
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - diagnosed below
        first_error = err
    try:
        builder = read_only_builder.builder_from_files(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        builder = None
    if builder is not None:
        return _split_source(_check_format(builder, name), name, split, deserialize_method)
    if isinstance(first_error, tfds.core.registered.DatasetNotFoundError):
        raise ValueError(
            f"Unknown dataset {name!r}: TFDS has no builder of that name and there is no prepared "
            f"copy in {data_dir}/{name.split('/')[0]}. Check the name (e.g. 'cifar10', "
            "'coco_captions', 'imagenet2012'), or use 'scenes/easy_64' for the built-in synthetic data."
        ) from None
    raise FileNotFoundError(
        f"Dataset {name!r} is not prepared in {data_dir}: looked for "
        f"{data_dir}/{name}/<version>/dataset_info.json. vitmm never downloads data. Prepare it "
        f"once on a machine that can: `tfds build {name.split('/')[0]} --data_dir {data_dir} "
        "--file_format array_record` (TFDS needs TensorFlow for that step only), then copy the "
        "folder here or point data_dir at it."
    ) from first_error


def _check_format(builder, name: str):
    info = builder.info
    formats = {info.file_format, *info.alternative_file_formats}
    if info.file_format is not None and tfds.core.file_adapters.FileFormat.ARRAY_RECORD not in formats:
        raise ValueError(
            f"Dataset {name!r} in {builder.data_dir} is stored as {info.file_format.value}; grain "
            "needs random access: rebuild it with --file_format array_record, or convert it with "
            f"`tfds convert_format --dataset_dir {builder.data_dir} --out_file_format array_record`."
        )
    return builder


def collate(examples: list[dict]) -> dict:
    """Stacks numeric fields into arrays; anything else (strings, ragged lists) stays a list. Every
    example must hold the same fields (several images in some only: a one-line error)."""
    batch = {}
    fields = set().union(*examples)
    partial = sorted(k for k in fields if any(k not in ex for ex in examples))
    if partial:
        several = {"image_positions", "more_images"} & set(partial)
        raise ValueError(f"The examples of one batch differ in their fields ({', '.join(partial)} in some only)"
                         + ("; some have several images or <image> tags, which train as flat sequences: set "
                            "input.sequences (e.g. --config.input.sequences.length=1024 "
                            "--config.input.sequences.max_images=4)." if several else "."))
    for key in examples[0]:
        values = [ex[key] for ex in examples]
        if all(isinstance(v, (np.ndarray, np.generic, int, float, bool)) for v in values):
            arrays = [np.asarray(v) for v in values]
            if len({a.shape for a in arrays}) == 1 and arrays[0].dtype.kind in "biuf":
                batch[key] = np.stack(arrays)
                continue
        batch[key] = values
    return batch


def process_slot(process_index, process_count) -> tuple[int, int]:
    """``(index, count)`` of this process among the readers (JAX's unless given)."""
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if not 0 <= index < count:
        raise ValueError(f"process_index={index} is not in [0, {count}).")
    return index, count


def process_seed(seed: int, process_index: int) -> int:
    """The shuffle and augmentation seed of process ``process_index``: its own, so hosts neither draw
    the same augmentations nor pair the same neighbouring records in every batch (process 0 keeps
    ``seed``: a one-process run is unchanged)."""
    if process_index == 0:
        return seed
    return int(np.random.SeedSequence([seed, process_index]).generate_state(1)[0])


def train_iterator(
    source, pp_fn: Callable, global_batch_size: int, seed: int = 0, *,
    process_index: int | None = None, process_count: int | None = None,
    num_epochs: int | None = None, num_threads: int = 8, prefetch: int = 32, skip_bad: float | None = None,
    workers: int = 0,
):
    """An endless (or ``num_epochs``) iterator of this process's training batches.

    The iterator's ``get_state()``/``set_state()`` restore the exact position: a resumed run sees
    the batches it would have seen. Batch size per process is ``global_batch_size / count``.

    ``skip_bad`` (raw data, ``data.formats``): examples the source or ``pp_fn`` marks bad
    (``skips.BadExample``) are skipped and counted, each batch filled with good ones, and the run
    stops once the skipped share passes ``skip_bad`` (``skips.SkippingBatches``; the counts are part
    of the state). ``prefetch`` then counts examples, not batches.

    ``workers > 0``: reading and preprocessing run in that many worker processes (grain's
    ``mp_prefetch``; ``-1``: ``workers.auto_workers(num_threads)``), each with ``num_threads`` threads, out of reach of
    the trainer's GIL. Worker ``w`` prepares batches ``w, w + workers, …`` of the same stream, so the
    batches are the same as without workers. With ``skip_bad`` each worker batches the good examples
    of every ``workers``-th record itself (its own counts and limit), so the batches depend on the
    number of workers. A resumed run must use the same number. ``close()`` stops the workers; they
    also exit when the trainer dies (even by SIGKILL).
    """
    index, count = process_slot(process_index, process_count)
    if global_batch_size % count:
        raise ValueError(f"Global batch {global_batch_size} does not split over {count} processes.")
    auto, workers = workers == -1, workers_lib.resolve(workers, num_threads)
    per_process = global_batch_size // count
    ds = grain.MapDataset.source(source)[index::count]
    if len(ds) < per_process:
        raise ValueError(f"This process holds {len(ds)} records, fewer than its batch of {per_process}.")
    epoch = len(ds)
    seed = process_seed(seed, index)
    ds = ds.shuffle(seed=seed).repeat(num_epochs)
    if skip_bad is not None:
        ds = ds.random_map(skips.guard(pp_fn), seed=seed)
        options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=max(prefetch, per_process))
        if workers:  # each worker batches the good examples of its share itself: batches, not examples, travel
            batched = workers_lib.SkippingBatchesDataset(ds.to_iter_dataset(options), per_process, collate, skip_bad,
                                                         min(1000, max(1, epoch // workers)))
            return workers_lib.in_workers(batched, workers, 2, auto)
        return skips.SkippingBatches(workers_lib.NoWorkers(iter(ds.to_iter_dataset(options)), auto), per_process,
                                     collate, max_share=skip_bad, min_read=min(1000, epoch))
    ds = ds.random_map(pp_fn, seed=seed)
    ds = ds.batch(per_process, drop_remainder=True, batch_fn=collate)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return workers_lib.in_workers(ds.to_iter_dataset(options), workers, 2, auto)


class _PaddedIndex:
    """Source view over ``indices`` with -1 meaning a padding slot (reads record ``fill``)."""

    def __init__(self, source, indices: np.ndarray, fill: int):
        self._source, self._indices, self._fill = source, indices, fill

    def __len__(self):
        return len(self._indices)

    def __getitem__(self, i):
        index = int(self._indices[i])
        record = self._source[index if index >= 0 else self._fill]
        example = {"_skipped": record} if isinstance(record, skips.Skipped) else dict(record)
        example["_mask"] = np.int32(index >= 0)
        example["_index"] = np.int64(index)
        return example


def eval_batches(
    source, pp_fn: Callable, batch_size: int, *, process_index: int | None = None,
    process_count: int | None = None, seed: int = 0, num_threads: int = 8,
) -> Iterator[dict]:
    """Every record exactly once, as padded batches of ``batch_size`` per process.

    Records are split into contiguous shards, one per process; all processes yield the same
    number of batches (collectives need that), padding with ``_mask = 0``. A bad record of raw
    data (``skips.BadExample``) is masked out the same way. ``_index`` is the
    record's index in the split (-1 for padding).
    """
    index, count = process_slot(process_index, process_count)
    shards = np.array_split(np.arange(len(source)), count)
    num_batches = max(1, math.ceil(max(len(s) for s in shards) / batch_size))
    mine = np.full(num_batches * batch_size, -1, np.int64)
    mine[: len(shards[index])] = shards[index]
    ds = grain.MapDataset.source(_PaddedIndex(source, mine, fill=0))

    guarded, stand_in = skips.guard(pp_fn), {}

    def pp_keep_mask(example, rng):  # the mask and index survive any keep(...) in the pp
        out = example["_skipped"] if "_skipped" in example else guarded(example, rng)
        mask = example["_mask"]
        if isinstance(out, skips.Skipped):  # a bad record (raw data): a good one's arrays, masked out
            if "out" not in stand_in:
                stand_in["out"] = _first_good(source, pp_fn)
            out, mask = dict(stand_in["out"]), np.int32(0)
        out["_mask"], out["_index"] = mask, example["_index"]
        out.pop("_id", None)
        out.pop("_truncated", None)
        return out

    ds = ds.random_map(pp_keep_mask, seed=seed).batch(batch_size, batch_fn=collate)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=16)))


def _first_good(source, pp_fn) -> dict:
    """The preprocessed first record that is not bad (the stand-in for bad ones in evaluation)."""
    guarded = skips.guard(pp_fn)
    for index in range(len(source)):
        record = source[index]
        out = record if isinstance(record, skips.Skipped) else guarded(dict(record), np.random.default_rng(0))
        if not isinstance(out, skips.Skipped):
            return out
    raise ValueError(f"Every one of the {len(source)} evaluation records is bad; check them with "
                     "`python -m vitmm.data check`.")
