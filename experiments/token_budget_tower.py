"""The token-budget sweep's frozen image tower: trained when missing, pinned into the results
(so that a sweep spanning several machines runs on one tower), and the encoder-side views of it
(fewer patches by a smaller image or larger patches) that the encoder-budget comparison reads."""

from __future__ import annotations

import json
import math
import pathlib

from vitmm import checkpoint as ckpt_lib
from vitmm.models.vit import ViT

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ensure_tower(workdir: pathlib.Path, smoke: bool, data_dir=None) -> None:
    """Trains the CLIP tower with ``configs/clip_scenes.py`` unless ``workdir`` holds the final
    checkpoint of its training: one stopped part-way (a sweep killed while it trained the tower)
    resumes from its last checkpoint instead of being taken for the finished tower."""
    folder = workdir / "checkpoints"
    steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    if steps and steps[-1] >= ckpt_lib.load_config(workdir)["total_steps"]:
        return
    from vitmm.config_args import load
    from vitmm.train import trainer

    arg = "smoke" if smoke else None
    print(f"No final CLIP checkpoint in {workdir}: training configs/clip_scenes.py{':' + arg if arg else ''} "
          f"first{f' (resuming from step {steps[-1]})' if steps else ''}.")
    trainer.train(load(ROOT / "configs/clip_scenes.py", arg, **({"input.data_dir": data_dir} if data_dir else {})),
                  workdir)


def pin_tower(workdir: pathlib.Path, out: pathlib.Path) -> None:
    """Writes the image tower of ``workdir``'s final checkpoint to ``out`` (its parameters under
    ``img`` and the run's config, at the same step): a small folder the results can carry, which
    ``--tower`` and ``ensure_tower`` read as a finished training."""
    step = ckpt_lib.Checkpointer(workdir).latest_step()
    writer = ckpt_lib.Checkpointer(out, keep=1, async_save=False)
    writer.save(step, {"params": {"img": ckpt_lib.load_params(workdir, step)["img"]}}, {},
                {"step": step, "config": json.dumps(ckpt_lib.load_config(workdir, step))})
    writer.close()


def tower_dir(tower: str | None, out: pathlib.Path, smoke: bool, data_dir=None) -> pathlib.Path:
    """The tower's folder: ``tower`` (a ``vitmm.train`` workdir, trained first when unfinished),
    else ``out/tower``, pinned from ``workdirs/clip_scenes`` (trained first when missing) the
    first time and read from there by every later sitting."""
    folder = pathlib.Path(tower or out / "tower")
    if tower or smoke:
        ensure_tower(folder, smoke, data_dir)
    elif not (folder / "checkpoints").is_dir():
        ensure_tower(ROOT / "workdirs/clip_scenes", False, data_dir)
        pin_tower(ROOT / "workdirs/clip_scenes", folder)
    return folder


def encoder_views(tower_cfg: dict, tower_params: dict, image_size: int, grid, budgets) -> dict:
    """``{tokens: {variant: (view name, tower, params, image size)}}``: the tower itself reaching
    ``tokens`` patches by a smaller image (sin-cos positions recomputed for the smaller grid; a
    learned table resampled) or by larger patches at the same image (the patch kernel PI-resized,
    FlexiViT's rule). A budget neither reaches exactly is left out."""
    from vitmm.models.patch_embed import resize_kernel
    from vitmm.models.vit_tools import resize_posemb

    n, patch = grid[0] * grid[1], tower_cfg["patch_size"]
    out = {}
    for tokens in budgets:
        scale = math.isqrt(n // tokens)
        if grid[0] != grid[1] or scale * scale * tokens != n or scale < 2:
            continue
        views = out.setdefault(tokens, {})
        small = image_size // scale
        side = grid[0] // scale
        params = (resize_posemb(tower_params, (side, side)) if "pos_embedding" in tower_params else tower_params)
        views[f"image {small} px"] = (f"res{small}", ViT(**tower_cfg), params, small)
        kernel = resize_kernel(tower_params["embedding"]["kernel"], patch * scale)
        big = {**tower_params, "embedding": {**tower_params["embedding"], "kernel": kernel}}
        views[f"patch {patch * scale}"] = (f"patch{patch * scale}", ViT(**{**tower_cfg, "patch_size": patch * scale}),
                                           resize_posemb(big, (side, side)) if "pos_embedding" in big else big,
                                           image_size)
    return out
