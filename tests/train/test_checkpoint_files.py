"""Checkpoints read by another run or tool (``load_params``, ``load_config``: an init folder,
``vitmm.chat``, ``vitmm.export``) and the workdir's own files, each on a small state, no training."""

import pathlib
import shutil

import jax.numpy as jnp
import pytest

from vitmm import checkpoint as ckpt_lib


def _two_steps(tmp_path: pathlib.Path) -> pathlib.Path:
    """A workdir with checkpoints at steps 1 and 2 of a one-array model."""
    checkpointer = ckpt_lib.Checkpointer(tmp_path, keep=3, async_save=False)
    for step in (1, 2):
        state = {"params": {"w": jnp.full(8, float(step))}, "step": jnp.asarray(step, jnp.int32)}
        checkpointer.save(step, state, {}, {"step": step, "config": '{"total_steps": 2}'})
    checkpointer.close()
    return tmp_path / "checkpoints"


def _damage(step_dir: pathlib.Path, how: str) -> None:
    if how == "missing_metadata":
        (step_dir / "state" / "_METADATA").unlink()
    elif how == "truncated":  # e.g. a copy (rsync, scp) that stopped half way
        for p in (step_dir / "state").rglob("*"):
            if p.is_file() and p.stat().st_size > 0:
                p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    else:
        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.mark.parametrize("how", ["missing_metadata", "truncated", "empty_folder"])
def test_another_runs_damaged_checkpoint_is_named_in_one_line_with_the_fix(tmp_path, how):
    """Reading another run's newest checkpoint that is damaged was a raw TypeError, JSONDecodeError or
    KeyError (a traceback at the command line, naming no file); and an empty step folder's config was
    said to be missing, as if the run had saved none."""
    folder = _two_steps(tmp_path)
    _damage(folder / "2", how)
    expected = (rf"The checkpoint at step 2 in {folder} cannot be read \(.+\): a damaged or incomplete copy; point at "
                rf"an intact one, or rename {folder / '2'} to 2\.unreadable to read step 1\.$")
    with pytest.raises(ckpt_lib.UnreadableCheckpoint, match=expected):
        ckpt_lib.load_params(tmp_path)
    if how == "empty_folder":  # the config is in its own item: only an emptied folder loses it too
        with pytest.raises(ckpt_lib.UnreadableCheckpoint, match=expected):
            ckpt_lib.load_config(tmp_path)
    (folder / "2").rename(folder / "2.unreadable")  # the fix the message names
    assert float(ckpt_lib.load_params(tmp_path)["w"][0]) == 1.0
    assert ckpt_lib.load_config(tmp_path) == {"total_steps": 2}


def test_a_step_that_is_not_there_is_named_with_the_steps_that_are(tmp_path):
    _two_steps(tmp_path)
    for read in (ckpt_lib.load_params, ckpt_lib.load_config):
        with pytest.raises(FileNotFoundError, match=r"No checkpoint at step 7 in .*; it holds steps 1, 2\.$"):
            read(tmp_path, 7)
    assert float(ckpt_lib.load_params(tmp_path, 1)["w"][0]) == 1.0


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/2"])
def test_a_runs_checkpoints_folder_given_as_the_workdir_is_refused_not_trained_over(tmp_path, clip_smoke_run, inside):
    """``load_params`` and ``init.checkpoint`` take ``W`` or ``W/checkpoints`` alike; ``--workdir
    W/checkpoints`` found no checkpoint *in* it and silently trained a new run from step 0 inside the
    old run's checkpoints (its config.json, metrics.jsonl, tensorboard/ and checkpoints/ among them)."""
    from test_trainer import smoke_config

    from vitmm.train import trainer
    from vitmm.train import workdir as workdir_lib

    run = tmp_path / "run"
    _two_steps(run)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    config = smoke_config(clip_smoke_run.data_dir, evals=False)
    with pytest.raises(workdir_lib.NotAWorkdir, match=rf"^--workdir {run / inside} is inside the checkpoints of the "
                                                      rf"run in {run}: .* pass --workdir {run} to resume it\.$"):
        trainer.train(config, run / inside)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    assert workdir_lib.check_is_workdir(tmp_path / "checkpoints") is None  # a workdir may be named so


def test_a_restarted_run_that_fails_to_close_its_checkpoints_says_so(tmp_path, clip_smoke_run, monkeypatch):
    """``--restart`` over checkpoints none of which read trains again from step 0; that second start ran
    inside the ``except`` that caught the first one's ``FreshStart``, so the checkpointer (and the metric
    writer) took that caught exception for one stopping the run: a failure to finish its saves was a
    warning under a run that ended as if it had succeeded."""
    import orbax.checkpoint as ocp
    from test_trainer import smoke_config

    from vitmm.train import trainer

    run = tmp_path / "run"
    for step_dir in _two_steps(run).iterdir():
        _damage(step_dir, "empty_folder")

    def full_disk(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "close", full_disk)
    with pytest.raises(ckpt_lib.SaveFailed, match=r"No space left on device"):
        trainer.train(smoke_config(clip_smoke_run.data_dir, evals=False), run, restart=True)


def test_a_folder_without_checkpoints_says_why_and_what_to_point_at(tmp_path):
    """``vitmm.chat``/``serve``/``export``, lmms tasks and ``init.checkpoint`` said only 'No checkpoint in X.'"""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    fix = "point at a `python -m vitmm.train` workdir or a `python -m vitmm.interop` folder."
    for name, why in [("gone", "no such folder"), ("file", "a file, not a folder"),
                      ("empty", "no step folder in it")]:
        for read in (ckpt_lib.load_params, ckpt_lib.load_config):
            with pytest.raises(FileNotFoundError) as err:
                read(tmp_path / name)
            assert str(err.value) == f"No checkpoint in {tmp_path / name} ({why}); {fix}"
    assert not (tmp_path / "gone").exists() and list((tmp_path / "empty").iterdir()) == []
