"""``python -m vitmm.train``'s flags: a combination that would do something else than asked is
refused in one line, exit 2, before anything is written (``parse_flags``, in-process)."""

import pathlib

import pytest
from absl import flags

from vitmm.train import __main__ as cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = f"--config={ROOT / 'configs/clip_scenes.py'}:smoke"


@pytest.fixture(autouse=True)
def _fresh_flags():
    yield
    flags.FLAGS.unparse_flags()  # absl's flags are global: the next test parses its own


def _refused(capsys, *args) -> str:
    flags.FLAGS.unparse_flags()  # what an earlier parse set stays set otherwise
    with pytest.raises(SystemExit) as stop:
        cli.parse_flags(["vitmm.train", CONFIG, *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1:] == ["(--debug shows the traceback)"], err
    return err[0]


def test_an_empty_workdir_is_refused_not_the_current_folder(tmp_path, capsys, monkeypatch):
    """``--workdir=$W`` with W unset trained in the current folder, writing checkpoints there."""
    monkeypatch.chdir(tmp_path)
    for empty in ("", " "):
        assert _refused(capsys, f"--workdir={empty}") == (
            "python -m vitmm.train: --workdir is empty (an unset shell variable?); name the folder the run writes "
            "checkpoints to.")
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_flag_without_dry_run_is_refused_not_a_training_run(tmp_path, capsys):
    """``--dry_run_target=h100`` alone trained the config and wrote its workdir."""
    workdir = f"--workdir={tmp_path / 'w'}"
    assert _refused(capsys, workdir, "--dry_run_target=h100") == (
        "python -m vitmm.train: --dry_run_target=h100 applies to --dry_run only; add --dry_run to compile the step "
        "without training, or leave it out to train.")
    assert _refused(capsys, workdir, "--dry_run_devices=8") == (
        "python -m vitmm.train: --dry_run_devices=8 applies to --dry_run only; add --dry_run to compile the step "
        "without training, or leave it out to train.")
    # with --dry_run but no target, the devices would be ignored: this machine's are compiled for
    assert _refused(capsys, workdir, "--dry_run", "--dry_run_devices=8") == (
        "python -m vitmm.train: --dry_run_devices=8 counts GPUs of --dry_run_target; add --dry_run_target=h100 "
        "(a100, h100, h200), or leave it out to compile for this machine's devices.")
    assert not (tmp_path / "w").exists()
    flags.FLAGS.unparse_flags()
    cli.parse_flags(["vitmm.train", CONFIG, workdir, "--dry_run", "--dry_run_target=h100", "--dry_run_devices=8"])
