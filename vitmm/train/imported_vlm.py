"""A run that starts from an imported VLM (``python -m vitmm.interop --from hf`` on a whole VLM, named
by ``init.checkpoint``) takes that VLM's model, tokenizer and image settings: ``from_imported_vlm``."""

from __future__ import annotations

import jax

from vitmm import checkpoint as ckpt_lib
from vitmm.train import sources

# What an imported VLM (``python -m vitmm.interop --from hf`` on a whole VLM) fixes for a run that
# starts from it: the model, its tokenizer and chat template, and its image size and statistics.
IMPORTED_MODEL = ("vision", "connector", "lm", "vision_layer", "use_cls", "prefix_lm", "mrope", "anyres")
IMPORTED_INPUT = ("image_size", "image_mean", "image_std")
# Image steps whose model cannot see square images instead (AnyRes views and their layout, images at
# their own sizes in two-frame temporal patches, Idefics3's tiles and their text): a run takes the
# imported pp (and flat sequences).
MODEL_PP_OPS = ("anyres", "smart_resize", "temporal_patch", "idefics3_tiles")


def from_imported_vlm(config):
    """``config`` with the settings of the imported VLM that ``init.checkpoint`` names, when it names
    one (its config records ``source.architecture``) and the run sets no ``init.vision``/``init.lm``
    of its own: ``IMPORTED_MODEL`` of ``model``, ``IMPORTED_INPUT`` of ``input``, ``tokenizer``,
    ``chat_template`` and ``tokens``; and when its pp holds ``MODEL_PP_OPS``, that pp and (unless
    the run sets ``input.sequences.length``) its ``input.sequences``. Otherwise ``config`` as it is
    (a LLaVA's run keeps its own image steps, e.g. LLaVA-1.5's pad-to-square; a checkpoint of weights
    without a saved config is weights for the run's own model, as ``sources.pin`` takes it).

    The returned config records the import as ``source.imported_from`` (the imported folder's
    ``source``), so that a run started from this run's workdir (stage 2 after stage 1) takes the same
    settings through it; not as ``source.architecture``, which makes ``vitmm.chat`` prompt a run as
    transformers prompts the imported model, not as it was trained here."""
    from vitmm.data import preprocess

    start = (config.get("init") or {}).get("checkpoint")
    if config.get("task") != "vlm" or not start or config.init.get("vision") or config.init.get("lm"):
        return config
    try:
        saved = ckpt_lib.load_config(sources.folder(config, "checkpoint"))  # as pinned, for a resumed run
    except (FileNotFoundError, ValueError):  # weights only (no saved config), as sources.pin takes them:
        return config  # nothing imported; the run's own model.* says what they are
    imported = imported_from(saved)
    if saved.get("task") != "vlm" or not imported:
        return config
    config = config.copy_and_resolve_references()
    replaced = _replaced(config, saved)
    with config.unlocked():
        for key in IMPORTED_MODEL:
            config.model[key] = saved["model"].get(key)
        for key in IMPORTED_INPUT:
            config.input[key] = saved["input"].get(key)
        if set(MODEL_PP_OPS) & set(preprocess.op_names(saved["input"]["pp"])):
            config.input.pp = saved["input"]["pp"]
            own = config.input.get("sequences")
            if saved["input"].get("sequences") and not (own and own.get("length")):
                config.input.sequences = saved["input"]["sequences"]
        for key in ("tokenizer", "chat_template", "tokens"):
            config[key] = saved.get(key)
        config.source = {"imported_from": imported}
    if jax.process_index() == 0:
        through = "" if imported is saved["source"] else " (a run that started from it)"
        print(f"model, tokenizer and image settings from the imported {imported['architecture']} in {start}{through}"
              + (f"; in place of the run's {', '.join(replaced)}" if replaced else ""), flush=True)
    return config


def _plain(value):
    """``value`` as JSON has it (a ConfigDict a dict, a tuple a list), to compare with a saved config's."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, dict) else value


def _replaced(config, saved: dict) -> list[str]:
    """What the run set that the imported settings replace, key by key: the image settings with both
    values (``input.image_size 48 -> 16``: a run asking for another resolution trains at the imported
    one), a model part by its key (its value is a whole tower or LM). The imported settings win by
    design (the weights are that model's), so a config's own defaults for them are not refused."""
    lines = []
    for key in IMPORTED_INPUT:
        own, new = _plain(config.input.get(key)), saved["input"].get(key)
        if own is not None and own != new:
            lines.append(f"input.{key} {own} -> {new}")
    lines += [f"model.{key}" for key in IMPORTED_MODEL
              if config.model.get(key) is not None and _plain(config.model.get(key)) != saved["model"].get(key)]
    return lines


def imported_from(saved: dict) -> dict | None:
    """The ``source`` of the imported VLM a saved config comes from: its own (a ``vitmm.interop``
    folder) or the one it recorded as started from (a run's workdir); None for neither."""
    source = saved.get("source") or {}
    if source.get("architecture"):
        return source
    return source.get("imported_from") if (source.get("imported_from") or {}).get("architecture") else None
