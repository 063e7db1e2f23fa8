"""The frozen image tower a scenes-QA study reads: trained with ``configs/clip_scenes.py`` when
missing, and pinned into the results (so that a study spanning several machines runs on one
tower; ``vitmm.study.store.check_tower`` refuses another one later)."""

from __future__ import annotations

import json
import pathlib

from vitmm import checkpoint as ckpt_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
