"""Checkpoints with orbax: the train state, the data-iterator state and run metadata, together.

``workdir/checkpoints/<step>/{state,data,meta}``. Orbax writes each checkpoint to a temporary
folder and renames it when complete, so a crash never leaves a half-written checkpoint that a
resume would pick up. Restoring checks every array's shape against the model first and lists
what does not fit.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from collections.abc import Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from vitmm import console, tree


class CheckpointMismatch(ValueError):
    """A checkpoint that reads but does not fit the model."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written."""


class NoReadableCheckpoint(RuntimeError):
    """Every checkpoint in a workdir failed to read."""


class UnreadableCheckpoint(ValueError):
    """Another run's checkpoint that cannot be read (a damaged folder, or a copy that stopped half way)."""


class Checkpointer:
    def __init__(self, workdir: str | pathlib.Path, keep: int = 2, async_save: bool = True):
        self.directory = pathlib.Path(workdir).expanduser().absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )

    def step_folders(self) -> list[int]:
        """Every step-numbered folder in the checkpoints folder, readable or not."""
        return step_folders(self.directory.parent)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, abstract_state, step: int | None = None):
        """``(state, data_state, meta)`` of ``step`` (default: latest); the state takes the
        shardings of ``abstract_state``'s ``ShapeDtypeStruct`` leaves."""
        step = self.latest_step() if step is None else step
        self._check_fits(abstract_state, step)
        self._check_state_fits(abstract_state, step)
        restored = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return restored.state, restored.data, restored.meta

    def _check_fits(self, abstract_state, step: int) -> None:
        """``CheckpointMismatch`` if the parameters saved at ``step`` are not the model's (read from
        the checkpoint's metadata: nothing is loaded)."""
        stored = self._mngr.item_metadata(step)["state"]
        problems = tree.mismatches(abstract_state["params"], stored["params"])
        if problems:
            raise CheckpointMismatch(
                f"The checkpoint at step {step} in {self.directory} does not fit the model:\n"
                + tree.summarise(problems)
                + "\nUse a fresh --workdir for a different model"
                + (", or initialise from that run with config.init.checkpoint and config.init.dont_load."
                   if tree.fitting(abstract_state["params"], stored["params"]) else
                   " (nothing in this checkpoint fits it: a different model trained here).")
            )

    def _check_state_fits(self, abstract_state, step: int) -> None:
        """``CheckpointMismatch`` if the rest of the state saved at ``step`` (the optimizer's) has another
        structure than this run's: a changed ``optim.freeze`` or set of transforms, not damaged files."""
        stored = _leaf_shapes({k: v for k, v in self._mngr.item_metadata(step)["state"].items() if k != "params"})
        wanted = _leaf_shapes({k: v for k, v in abstract_state.items() if k != "params"})
        differ = sorted(k for k in set(stored) | set(wanted) if stored.get(k, "absent") != wanted.get(k, "absent"))
        if differ:
            shown = "; ".join(f"{'/'.join(k)}: saved {stored.get(k, 'absent')}, now {wanted.get(k, 'absent')}"
                              for k in differ[:3])
            raise CheckpointMismatch(
                f"The optimizer state saved at step {step} in {self.directory} does not fit this run's optimizer "
                f"({len(differ)} entries differ, e.g. {shown}): optim.freeze, LoRA or the optimizer's transforms "
                "changed. Resume with the settings it was saved with, or start a fresh --workdir from its weights "
                f"with --config.init.checkpoint={self.directory.parent}.")

    def restore_newest_readable(self, abstract_state, check=None, restart: bool = False):
        """``(state, data_state, meta, step)`` of the newest checkpoint that reads. ``check(meta)``
        runs on each one's saved metadata before its state is read (the trainer's config check: a
        changed optimizer is refused in one line, not met as a read error); its errors propagate, as
        does a checkpoint that does not fit the model. Newer checkpoints that fail to read (a
        truncated or missing file, an empty step folder) are set aside as ``<step>.unreadable``, each
        with one warning, once an older one has read. If none reads, nothing is renamed (the failure
        may be this run's, not the files') and ``NoReadableCheckpoint`` names each cause; with
        ``restart`` they are set aside and None is returned: a fresh start."""
        listed = set(self.all_steps())
        failed = [(step, "an incomplete or emptied step folder")  # orbax does not even list it
                  for step in sorted(set(self.step_folders()) - listed, reverse=True)]
        for step in sorted(listed, reverse=True):
            try:
                meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
                self._check_fits(abstract_state, step)  # another model's checkpoint: said as such, first
            except CheckpointMismatch:
                raise
            except Exception as err:  # noqa: BLE001 - any failure to read makes the checkpoint unusable
                failed.append((step, self._read_failure(step, err)))
                continue
            if check is not None:
                check(meta)
            try:
                found = (*self.restore(abstract_state, step), step)
            except CheckpointMismatch:
                raise
            except Exception as err:  # noqa: BLE001 - as above
                failed.append((step, self._read_failure(step, err)))
                continue
            for s, reason in failed:  # one has read, so theirs were the files' faults
                self._set_aside(s, reason)
            if failed or jax.process_count() > 1:  # (every process: another may have listed no failure)
                self._reload_after_renames()
            return found
        if restart:
            for s, reason in failed:
                self._set_aside(s, reason)
            self._reload_after_renames()
            return None
        causes = "; ".join(f"step {s}: {reason}" for s, reason in failed)
        raise NoReadableCheckpoint(f"No readable checkpoint in {self.directory} ({causes}). Nothing was restored or "
                                   "renamed; if the files are damaged, rerun with --restart to set them aside (as "
                                   "<step>.unreadable) and train again from step 0.")

    def _read_failure(self, step: int, err: Exception) -> str:
        console.log_error(self.errors_log, f"reading the checkpoint at step {step} failed", err)
        return f"{console.cause(err)}; the full error is in {self.errors_log}"

    def _set_aside(self, step: int, reason: str) -> str:
        """Warns, and renames the unreadable step folder to ``<step>.unreadable`` (kept for a look,
        out of the way of the step's next save); returns the reason for the summary."""
        print(f"Warning: skipping the unreadable checkpoint at step {step} in {self.directory} ({reason})", flush=True)
        if jax.process_index() == 0:
            target = self.directory / f"{step}.unreadable"
            n = 1
            while target.exists():
                target, n = self.directory / f"{step}.unreadable.{n}", n + 1
            (self.directory / str(step)).rename(target)
        return f"step {step}: {reason}"

    def _reload_after_renames(self) -> None:
        """Every process lists the steps again once process 0's renames are done (another process's
        stale list would save a set-aside step a second time)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("vitmm: unreadable checkpoints set aside")
        self._mngr.reload()

    @property
    def errors_log(self) -> pathlib.Path:
        """Where the libraries' full errors of a failed save or read go (``console``)."""
        return self.directory.parent / console.ERRORS_LOG

    def check_saves(self, step: int) -> None:
        """Raises ``SaveFailed`` (path and cause) if a background save has failed."""
        try:
            self._mngr.check_for_errors()
            # orbax's finalize thread keeps a failed commit's error to itself until waited on: a thread
            # that has ended with one is waited on (at once) to raise it, not at the next save.
            thread = getattr(self._mngr, "_finalize_thread", None)
            if thread is not None and thread.map(lambda t: t is not None and not t.is_alive() and t.exception):
                self._mngr.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - re-raised with what the user needs
            raise self.save_failed(err) from err

    def save_failed(self, err: Exception) -> SaveFailed:
        """The one-line error for a failed save: the folder, the cause, the newest intact step."""
        console.log_error(self.errors_log, f"saving a checkpoint to {self.directory} failed", err)
        good = self.step_folders()  # on disk: orbax's own list already drops the steps a save would delete
        return SaveFailed(f"Saving a checkpoint to {self.directory} failed: {console.cause(err)} (the full error is in "
                          f"{self.errors_log}). "
                          + (f"The checkpoint at step {max(good)} is intact; free space or fix the path, then "
                             "resume." if good else "No earlier checkpoint exists."))

    def wait(self) -> None:
        """Blocks until background saves are done; a failed one is a ``SaveFailed``."""
        try:
            self._mngr.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - re-raised with what the user needs
            raise self.save_failed(err) from err

    def close(self) -> None:
        """Waits for background saves and closes. Called while another error propagates (a NaN, a failed
        evaluation, a preemption), a failed save is logged and said, and that error stays the one raised.
        Once closed, a second call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        failing, error = sys.exc_info()[1] is not None, None
        for finish in (self._mngr.wait_until_finished, self._mngr.close):  # (close waits again)
            try:
                finish()
            except Exception as err:  # noqa: BLE001 - re-raised with what the user needs, or said beside another
                error = error or err
        if error is not None:
            failed = self.save_failed(error)
            if not failing:
                raise failed from error
            print(f"Warning: {failed}", flush=True)


def _leaf_shapes(state) -> dict[tuple[str, ...], tuple]:
    """``{path: shape}`` of a state's leaves, the path's parts as names whichever container held
    them (orbax's metadata keeps an optimizer's named tuples as dicts and its tuples as lists)."""
    def name(k):
        return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))

    return {tuple(name(k) for k in path): tuple(getattr(leaf, "shape", ()))
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def step_folders(workdir: str | pathlib.Path) -> list[int]:
    """Every step-numbered folder in ``workdir/checkpoints``, readable or not (orbax's temporary
    folders of a save that never finished are not step-numbered)."""
    folder = pathlib.Path(workdir).expanduser().absolute() / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def _read_only(path: str | pathlib.Path, **handlers):
    """``(checkpoints folder, manager)`` for another run's ``WORKDIR`` or ``WORKDIR/checkpoints``."""
    path = pathlib.Path(path).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return path, ocp.CheckpointManager(path, item_handlers=handlers or None, options=options)


def _step(mngr, path, step: int | None) -> int:
    steps = sorted(mngr.all_steps())
    if not steps:
        path = pathlib.Path(path)
        why = ("no such folder" if not path.exists() else "a file, not a folder" if not path.is_dir() else
               "no step folder in it")
        raise FileNotFoundError(f"No checkpoint in {path} ({why}); point at a `python -m vitmm.train` workdir or a "
                                "`python -m vitmm.interop` folder.")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"No checkpoint at step {step} in {path}; it holds steps {', '.join(map(str, steps))}.")
    return steps[-1] if step is None else step


def _unreadable(mngr, path: pathlib.Path, step: int, err: Exception) -> UnreadableCheckpoint:
    """The one-line error for a step that is listed but does not read, with the step a reader gets
    once it is set aside as the trainer sets such steps aside (``<step>.unreadable``)."""
    earlier = [s for s in mngr.all_steps() if s < step]
    fix = f", or rename {path / str(step)} to {step}.unreadable to read step {max(earlier)}" if earlier else ""
    return UnreadableCheckpoint(f"The checkpoint at step {step} in {path} cannot be read ({console.cause(err)}): a "
                                f"damaged or incomplete copy; point at an intact one{fix}.")


def load_params(path: str | pathlib.Path, step: int | None = None) -> dict:
    """The ``params`` of another run's checkpoint (``WORKDIR`` or ``WORKDIR/checkpoints``) as
    numpy arrays, on the host."""
    # One manager to read shapes (needs the handler bound), a plain one to restore only params.
    path, meta_mngr = _read_only(path, state=ocp.StandardCheckpointHandler())
    with meta_mngr:
        step = _step(meta_mngr, path, step)
        try:  # (a damaged step fails here or in the restore below, with any of orbax's errors)
            meta = meta_mngr.item_metadata(step)["state"]
            abstract = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), meta["params"])
            with _read_only(path)[1] as mngr:
                restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                    item={"params": abstract},
                    restore_args=ocp.checkpoint_utils.construct_restore_args({"params": abstract}),
                    partial_restore=True)))
        except Exception as err:  # noqa: BLE001 - re-raised as one line naming the step and the fix
            raise _unreadable(meta_mngr, path, step, err) from err
    return jax.tree.map(np.asarray, restored.state["params"])


PINNED_SETTINGS = "settings.json"  # a folder a run pinned its init folder's settings in (vitmm.train.sources)


def load_config(path: str | pathlib.Path, step: int | None = None) -> dict:
    """The config (a plain dict) that another ``vitmm.train`` run saved with its checkpoint, or the
    one a run pinned in ``W/sources/<key>/``."""
    pinned = pathlib.Path(path).expanduser() / PINNED_SETTINGS
    if step is None and pinned.is_file():
        return json.loads(pinned.read_text())
    path, mngr = _read_only(path, meta=ocp.JsonCheckpointHandler())
    with mngr:
        step = _step(mngr, path, step)
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except KeyError as err:  # weights saved without vitmm's meta item; an emptied folder has no weights either
            if not (path / str(step) / "state").is_dir():
                raise _unreadable(mngr, path, step, err) from err
            meta = {}
        except Exception as err:  # noqa: BLE001 - re-raised as one line naming the step and the fix
            raise _unreadable(mngr, path, step, err) from err
    config = meta.get("config")
    if config is None:
        raise ValueError(f"The checkpoint at step {step} in {path} carries no config.")
    return json.loads(config) if isinstance(config, str) else config


def merge_params(init: dict, loaded: dict, dont_load: Sequence[str] = (), source: str = "",
                 prefix: str = "") -> dict:
    """``init`` with every entry replaced by ``loaded``'s, except paths matching ``dont_load``
    (regexes matched against ``prefix`` + the path, e.g. ``tower/`` for a VLM's tower).

    Fails loudly: anything in the model not found in ``loaded`` (and not in ``dont_load``),
    anything in ``loaded`` the model has no place for, and any shape mismatch is listed.
    """
    patterns = [re.compile(p) for p in dont_load]
    skip = lambda k: any(p.fullmatch(prefix + k) for p in patterns)  # noqa: E731
    lines = tree.mismatches(init, loaded, skip)
    if lines:
        # A shape mismatch mostly means the model is built with other settings than the checkpoint's:
        # dont_load would silently start those parts afresh, so it is offered only for parts meant to be new.
        reshaped = any(line.lstrip().startswith("shape mismatch") for line in lines)
        if not tree.fitting(init, loaded):
            fix = (f"Nothing in it fits the model (its top level: {', '.join(sorted(loaded))}; the model's: "
                   f"{', '.join(sorted(init))}): check that it is the checkpoint you meant.")
        elif reshaped:
            fix = ("The model is not built as the checkpoint's was: set model.* and input.image_size as its "
                   "config.json has them; only for parts meant to start afresh (e.g. a new head), add regexes of "
                   "what not to load to config.init.dont_load.")
        else:
            fix = "Add regexes of what not to load to config.init.dont_load."
        raise ValueError(f"Cannot initialise from {source or 'the checkpoint'}:\n" + tree.summarise(lines)
                         + f"\n{fix}")
    have = tree.flatten(loaded)
    return tree.unflatten({k: (v if skip(k) else have[k]) for k, v in tree.flatten(init).items()})


def init_tower_from_clip(vlm_params: dict, clip_workdir: str | pathlib.Path, tower_key: str = "tower",
                         image_key: str = "img", dont_load: Sequence[str] = ()) -> dict:
    """``vlm_params`` with its vision tower replaced by a CLIP run's image tower.

    ``clip_workdir`` is a ``vitmm.train`` workdir; its ``params[image_key]`` must match the VLM's
    tower exactly: anything missing, left over or mis-shaped is listed in the error.
    """
    loaded = load_params(clip_workdir)
    if image_key not in loaded:
        raise ValueError(f"The checkpoint in {clip_workdir} has no {image_key!r} tower; it has {sorted(loaded)}.")
    tower = merge_params(vlm_params[tower_key], loaded[image_key], dont_load, source=f"{clip_workdir} ({image_key})",
                         prefix=f"{tower_key}/")
    return {**vlm_params, tower_key: tower}
