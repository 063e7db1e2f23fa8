"""The ``--config`` study's command line: ``--interim`` reads the study's settings from
``OUT/setup.json`` (or says in one line to repeat the flags), never refuses it for tuning on the
test split; a bad ``--set`` key is one line and exit 2; new keys may go under the pass-through
``overrides`` (checked against the train config)."""

import pytest

from experiments.token_budget import study

CONFIG = "experiments/token_budget/configs/smollm2_frozen.py:smoke"
SETS = ["--set", "families=('pool',)", "--set", "budgets=(4,)", "--set", "seeds=(0, 1)", "--set", "tune.budget=4",
        "--set", "tune.lrs=(1e-3, 3e-3)"]


@pytest.fixture
def fake_runs(monkeypatch):
    """No training: each run's score from its name, and the report handed the rows it would show."""
    shown = {}
    monkeypatch.setattr(study, "run", lambda s, name, *a: {"run": name, "accuracy": 0.5, "batch": 16})
    monkeypatch.setattr(study, "tower_grid", lambda config, need_lm=True: ((4, 4), {"width": 8}, None))
    monkeypatch.setattr(study.store, "check_tower", lambda *a: None)
    monkeypatch.setattr(study, "report", lambda s, tuned, rows, chosen, unreachable: shown.update(
        tuned=tuned, rows=rows, chosen=chosen, unreachable=unreachable, budgets=tuple(s.budgets)) or "")
    return shown


def test_interim_reads_the_studys_settings_from_its_setup(tmp_path, fake_runs, capsys):
    out = str(tmp_path / "out")
    study.main(["--config", CONFIG, "--out", out, "--workdirs", str(tmp_path / "w"), *SETS])
    finished = sorted(r["run"] for r in fake_runs["rows"])
    fake_runs.clear()
    study.main(["--config", CONFIG, "--out", out, "--interim"])  # without the study's --set flags
    assert sorted(r["run"] for r in fake_runs["rows"]) == finished and len(finished) == 4
    assert (tmp_path / "out/interim/frozen.md").is_file()


def test_interim_without_a_setup_or_runs_says_to_repeat_the_flags(tmp_path, fake_runs, capsys):
    with pytest.raises(SystemExit) as stop:
        study.main(["--config", CONFIG, "--out", str(tmp_path / "out"), "--interim"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "repeat the study's --set flags" in err


def test_interim_of_the_llava_config_is_not_refused_for_tuning_on_test(tmp_path, fake_runs, capsys):
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as stop:  # (no runs yet: the one-line answer, not the tuning refusal)
        study.main(["--config", "experiments/token_budget/configs/llava.py:smoke", "--out", str(tmp_path / "out"),
                    "--interim"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "same split" not in err and "repeat the study's --set flags" in err


@pytest.mark.parametrize("key, hint", [("overrides.init.visoin=x", "overrides.init.vision"),
                                       ("famlies=('pool',)", "families"),
                                       ("overrides.model.max_lne=96", "overrides.model.max_len")])
def test_a_mistyped_set_key_is_one_line_and_exit_2(tmp_path, fake_runs, capsys, key, hint):
    with pytest.raises(SystemExit) as stop:
        study.main(["--config", "experiments/token_budget/configs/llava.py:smoke", "--out", str(tmp_path / "out"),
                    "--set", key])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "did you mean" in err and hint in err


def test_new_keys_under_the_pass_through_overrides_are_allowed(tmp_path, fake_runs):
    s = study.load(CONFIG, {"overrides.model.max_len": 96, "test_overrides.model.loss_positions": 48,
                            "tune.overrides.batch_size": 8})
    assert s.overrides.model.max_len == 96 and s.test_overrides.model.loss_positions == 48
    assert s.tune.overrides.batch_size == 8
    study.main(["--config", CONFIG, "--out", str(tmp_path / "out"), "--workdirs", str(tmp_path / "w"), *SETS,
                "--set", "overrides.model.max_len=96"])
    assert fake_runs["rows"]


def test_report_lists_the_unreachable_budgets_of_the_study_as_it_ran(tmp_path, fake_runs):
    out = str(tmp_path / "out")
    study.main(["--config", CONFIG, "--out", out, "--workdirs", str(tmp_path / "w"), *SETS])
    study.main(["--config", CONFIG, "--out", out, "--report"])  # without --set budgets=(4,): not the file's budgets
    assert fake_runs["budgets"] == (4,) and fake_runs["unreachable"] == []
