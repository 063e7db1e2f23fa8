"""A run that starts from an imported VLM (``python -m vitmm.interop --from hf`` on a whole VLM, named
by ``init.checkpoint``) takes that VLM's model, tokenizer and image settings: ``from_imported_vlm``."""

from __future__ import annotations

import jax

from vitmm import checkpoint as ckpt_lib

# What an imported VLM (``python -m vitmm.interop --from hf`` on a whole VLM) fixes for a run that
# starts from it: the model, its tokenizer and chat template, and its image size and statistics.
IMPORTED_MODEL = ("vision", "connector", "lm", "vision_layer", "use_cls", "prefix_lm", "mrope", "anyres")
IMPORTED_INPUT = ("image_size", "image_mean", "image_std")


def from_imported_vlm(config):
    """``config`` with the settings of the imported VLM that ``init.checkpoint`` names, when it names
    one (its config records ``source.architecture``) and the run sets no ``init.vision``/``init.lm``
    of its own: ``IMPORTED_MODEL`` of ``model``, ``IMPORTED_INPUT`` of ``input``, ``tokenizer``,
    ``chat_template`` and ``tokens``. Otherwise ``config`` as it is."""
    start = (config.get("init") or {}).get("checkpoint")
    if config.get("task") != "vlm" or not start or config.init.get("vision") or config.init.get("lm"):
        return config
    saved = ckpt_lib.load_config(start)
    if saved.get("task") != "vlm" or not (saved.get("source") or {}).get("architecture"):
        return config
    config = config.copy_and_resolve_references()
    with config.unlocked():
        for key in IMPORTED_MODEL:
            config.model[key] = saved["model"].get(key)
        for key in IMPORTED_INPUT:
            config.input[key] = saved["input"].get(key)
        for key in ("tokenizer", "chat_template", "tokens"):
            config[key] = saved.get(key)
    if jax.process_index() == 0:
        print(f"model, tokenizer and image settings from the imported {saved['source']['architecture']} in {start}",
              flush=True)
    return config
