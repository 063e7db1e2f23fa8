"""Another codebase's checkpoint → a vitmm checkpoint folder, through one table of loaders.

Every source module has ``load(src, *, tower, image_size, **options) -> (TwoTowers kwargs,
params)``; ``LOADERS`` maps the source names to them. The folder written is laid out like a
``vitmm.train`` workdir (``checkpoints/0`` with ``params`` and a ``meta`` config), so
``--config.init.vision=DIR`` (a VLM's tower), ``--config.init.checkpoint=DIR`` and
``checkpoint.load_params(DIR)`` read it. Parameters sit under ``img``/``txt``/``img_proj``/
``txt_proj``/``t``/``b`` as in ``TwoTowers``; the model's keyword arguments are in the config at
``model`` (``TwoTowers(**config["model"])``; ``model.image`` alone for a ViT), and the image
size its position table is for at ``input.image_size``.
"""

from __future__ import annotations

import inspect
import json
import pathlib

from vitmm.checkpoint import Checkpointer
from vitmm.interop import big_vision, hf, openclip, timm_vit
from vitmm.interop.common import TOWERS

LOADERS = {"hf": hf.load, "timm": timm_vit.load, "open_clip": openclip.load, "big_vision": big_vision.load}


def load(source: str, src, *, tower: str = "both", image_size=None, **options) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of ``src`` read by the ``source`` loader; ``options`` are
    that loader's own (timm: ``num_heads``, ``global_pool``; open_clip: ``quick_gelu``)."""
    if source not in LOADERS:
        raise ValueError(f"source {source!r} is not supported; choose one of {tuple(LOADERS)}.")
    if tower not in TOWERS:
        raise ValueError(f"tower must be one of {TOWERS}, got {tower!r}.")
    loader = LOADERS[source]
    known = set(inspect.signature(loader).parameters) - {"src", "tower", "image_size"}
    given = {k: v for k, v in options.items() if v is not None}
    if set(given) - known:
        raise ValueError(f"{sorted(set(given) - known)} do not apply to {source!r} checkpoints "
                         f"(its options: {sorted(known) or 'none'}).")
    return loader(src, tower=tower, image_size=image_size, **given)


def convert(source: str, src, out, *, tower: str = "both", image_size=None, **options) -> pathlib.Path:
    """Writes ``load(source, src, ...)`` to the new checkpoint folder ``out`` and returns it."""
    from vitmm.models.patch_embed import to_pair

    out = pathlib.Path(out).expanduser().absolute()
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
        raise FileExistsError(f"{out} already holds a checkpoint; choose a new --out.")
    model, params = load(source, src, tower=tower, image_size=image_size, **options)
    config = {"model": model, "source": {"from": source, "src": str(src), "tower": tower}}
    size = None
    if model["image"] is not None and "pos_embedding" in params["img"]:  # the resolution the table is for
        grid, patch = params["img"]["pos_embedding"].shape[1:3], to_pair(model["image"]["patch_size"])
        size = (int(grid[0] * patch[0]), int(grid[1] * patch[1]))
    elif model["image"] is not None and image_size is not None:  # fixed sin-cos positions fit any size
        size = to_pair(image_size)
    if size is not None:  # an int for a square image, else [height, width]
        config["input"] = {"image_size": size[0] if size[0] == size[1] else list(size)}
    checkpointer = Checkpointer(out, keep=1, async_save=False)
    checkpointer.save(0, {"params": params}, {}, {"step": 0, "config": json.dumps(config)})
    checkpointer.close()
    return out
