"""The token-budget command line: ``--interim`` alone takes a sweep's own flags from its
``setup.json``, and ``--help`` names the ``--config FILE`` study."""

import json

import pytest

from experiments.token_budget import args as tb_args
from vitmm.study import outputs


def test_interim_alone_takes_the_sweeps_own_flags_from_its_setup(tmp_path, capsys):
    (tmp_path / "setup.json").write_text(json.dumps(
        {"command": "python -m experiments.token_budget --smoke --seeds 0 --out /elsewhere --workers=1"}))
    args = tb_args.parse_args(["--interim", "--out", str(tmp_path)])
    assert args.smoke and args.interim and args.seeds == [0] and args.workers == 1
    assert args.families == ["mlp", "pool", "patch_merger"] and args.out == str(tmp_path)
    assert "--smoke --seeds 0 --workers=1" in capsys.readouterr().out
    given = tb_args.parse_args(["--interim", "--out", str(tmp_path), "--seeds", "3"])  # flags given: those
    assert not given.smoke and given.seeds == [3]


def test_a_saved_command_with_an_empty_value_is_read_back_whole(tmp_path, monkeypatch):
    """The hard and medium sweeps run with ``--encoder_budgets ''``: their saved command quotes it, so
    ``--interim`` alone reads it back as an empty value, not as a flag without one."""
    spec = type("Spec", (), {"name": "experiments.token_budget"})
    monkeypatch.setattr(tb_args.sys.modules["__main__"], "__spec__", spec)
    flags = ["--smoke", "--encoder_budgets", "", "--seeds", "0"]
    command = outputs.command(flags)
    assert command == "python -m experiments.token_budget --smoke --encoder_budgets '' --seeds 0"
    (tmp_path / "setup.json").write_text(json.dumps({"command": command}))
    args = tb_args.parse_args(["--interim", "--out", str(tmp_path)])
    assert args.smoke and args.encoder_budgets == [] and args.seeds == [0]


def test_interim_without_a_setup_or_a_sweep_command_keeps_the_flags_given(tmp_path):
    assert not tb_args.parse_args(["--interim", "--out", str(tmp_path)]).smoke
    (tmp_path / "setup.json").write_text(json.dumps({"command": "python -m pytest -q --smoke"}))
    assert not tb_args.parse_args(["--interim", "--out", str(tmp_path)]).smoke


def test_help_names_the_config_study(capsys):
    with pytest.raises(SystemExit):
        tb_args.parse_args(["--help"])
    assert "--config FILE --help" in " ".join(capsys.readouterr().out.split())
