"""The training input a config names, as device batches: ``make(config, tokenizer, par, task)``.

One of: packed rows of images at their own sizes (``input.packing``), VLM sequences with any
number of images (``input.sequences``), the user's raw files (LLaVA JSON, tar shards, CSV,
parquet, a mixture: ``data.formats``) or a TFDS dataset / scenes (``input.data``,
``input.scenes_any``); each through the run's preprocessing, batched on the host and put on the
devices ahead of the step (``input.device_prefetch``).
"""

from __future__ import annotations

import jax

from vitmm.data import device_feed, formats, pipeline, preprocess, skips
from vitmm.train import pp_template
from vitmm.train.parallel import Parallel


def make(config, tokenizer, par: Parallel, task) -> device_feed.DeviceIterator:
    """The run's training batches on the devices; ``get_state``/``set_state`` resume them exactly."""
    inp = config.input
    spec = pp_template.host_pp_and_device_affine(config)[0]
    pp = preprocess.parse(spec, tokenizer)
    if inp.get("packing"):
        host = _packed(config, pp)
    elif inp.get("sequences") and inp.sequences.get("length"):
        host = _sequences(config, spec, tokenizer, task)
    elif formats.raw_format(inp):  # the user's files (LLaVA JSON, tar shards, CSV, parquet, a mixture)
        host = pipeline.train_iterator(formats.source_from(inp, config.seed), pp, config.batch_size, seed=config.seed,
                                       num_threads=inp.get("num_threads", 1), prefetch=inp.get("prefetch", 8),
                                       skip_bad=skips.local_limit(inp.get("max_skipped_share", 0.01),
                                                                  jax.process_count()),
                                       workers=inp.get("workers", 0))
    else:
        source = pipeline.source_for(data_spec(inp), keys=tuple(inp.get("keys") or ()) or None)
        host = pipeline.train_iterator(source, pp, config.batch_size, seed=config.seed,
                                       num_threads=inp.get("num_threads", 1), prefetch=inp.get("prefetch", 8),
                                       workers=inp.get("workers", 0))
    return device_feed.DeviceIterator(host, size=inp.get("device_prefetch", 2), put=par.put_batch)


def data_spec(inp) -> dict:
    """The training input's data spec: ``input.data`` in ``input.data_dir``, or scenes at random
    sizes (``input.scenes_any``, with their own split)."""
    if inp.get("scenes_any"):
        return {"scenes_any": inp.scenes_any.to_dict(), "split": inp.scenes_any.get("split", "train")}
    return {"name": inp.data.name, "split": inp.data.split, "data_dir": inp.get("data_dir")}


def _sequences(config, spec, tokenizer, task):
    """VLM examples as flat sequences with any number of images (``input.sequences``;
    ``batch_size`` counts rows), packed several to a row unless ``pack=False``."""
    from vitmm.train.sequence_layout import SequenceLayout

    inp, sq = config.input, config.input.sequences
    if not hasattr(task, "num_visual"):
        raise ValueError("input.sequences is for VLM runs (task 'vlm'); a contrastive run packs images with "
                         "input.packing.")
    layout = SequenceLayout.of(task)
    if layout.anyres is not None and "anyres" in preprocess.op_names(pp_template.pp_string(config)):
        raise ValueError("With input.sequences each image's AnyRes views are made by data.sequences: drop the anyres "
                         "op from input.pp (keep the images at their own sizes).")
    if layout.anyres is not None and preprocess.decode_draft(spec):  # (parse refuses it before an anyres op)
        raise ValueError(f"decode(draft={preprocess.decode_draft(spec)}) decodes a JPEG at a reduced size, from which "
                         "model.anyres would choose each image's resolution and tokens: drop draft from input.pp.")
    spec, layout = layout.split_affine(spec)  # AnyRes views are cut before normalisation: black padding
    pp = preprocess.parse(spec, tokenizer)
    raw = formats.raw_format(inp)
    source = formats.source_from(inp, config.seed) if raw else \
        pipeline.source_for(data_spec(inp), keys=tuple(inp.get("keys") or ()) or None)
    count = jax.process_count()
    if config.batch_size % count:
        raise ValueError(f"batch_size={config.batch_size} rows do not split over {count} processes.")
    return layout.batches(source, pp, rows=config.batch_size // count, pack=sq.get("pack", True),
                          bins=sq.get("bins", 8), seed=config.seed, process_index=jax.process_index(),
                          process_count=count,
                          skip_bad=skips.local_limit(inp.get("max_skipped_share", 0.01), count) if raw else None,
                          workers=inp.get("workers", 0))


def _packed(config, pp):
    """Packed rows of images at their own sizes (``input.packing``; ``batch_size`` counts rows):
    scenes drawn at random sizes (``input.scenes_any``) or a TFDS dataset, through ``pp`` (e.g.
    NaFlex), packed by ``data.packing.packed_iterator`` with each image's caption tokens."""
    from vitmm.data import packing as data_packing
    from vitmm.models.patch_embed import to_pair
    from vitmm.models.vit import ViT

    inp, pk = config.input, config.input.packing
    source = pipeline.source_for(data_spec(inp), keys=tuple(inp.get("keys") or ()) or None)
    tower = ViT(**config.model.image)
    count, index = jax.process_count(), jax.process_index()
    if config.batch_size % count:
        raise ValueError(f"batch_size={config.batch_size} packed rows do not split over {count} processes.")
    return data_packing.packed_iterator(
        source, pp, patch_size=to_pair(tower.arch().patch_size)[0], seq_len=pk.seq_len, max_images=pk.max_images,
        rows=config.batch_size // count, num_bins=pk.bins, class_token=tower.class_token,
        num_registers=tower.num_registers, meta_keys=("caption_tokens",), seed=config.seed,
        process_index=index, process_count=count, patch_keep=tower.patch_keep,
        max_num_patches=pk.get("max_num_patches"))
