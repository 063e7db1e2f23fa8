"""Which kept rows a ``--config`` study (``study.py``) reuses and reports: this tuning's runs only
(its budget, rates and first seed), each cell at its family's rate, the design's cells and seeds;
and no tuning on the test split unless asked for."""

import json

import pytest

from experiments.token_budget import study

CONFIG = "experiments/token_budget/configs/smollm2_frozen.py:smoke"
SETS = ["--set", "families=('pool',)", "--set", "budgets=(4,)", "--set", "seeds=(0, 1)", "--set", "tune.budget=4",
        "--set", "tune.lrs=(1e-3, 3e-3)"]


@pytest.fixture
def fake_runs(monkeypatch):
    """No training: each run's score from its name, and the report handed the rows it would show."""
    ran, shown = [], {}
    score = {"tune_pool_4_lr0.001": 0.5, "tune_pool_4_lr0.003": 0.6}

    def run(s, name, args, overrides, workdirs):
        ran.append(name)
        return {"run": name, "accuracy": score.get(name, 0.7), "batch": 16}

    monkeypatch.setattr(study, "run", run)
    monkeypatch.setattr(study, "tower_grid", lambda config, need_lm=True: ((4, 4), {"width": 8}, None))
    monkeypatch.setattr(study.store, "check_tower", lambda *a: None)
    monkeypatch.setattr(study, "report", lambda s, tuned, rows, chosen, unreachable: shown.update(
        tuned=tuned, rows=rows, chosen=chosen) or "")
    return ran, shown


def _append(path, key, seed, row):
    first = json.loads(path.read_text().splitlines()[0])["signature"]
    study.store.save_cell(path, first, key, {seed: row})


def test_a_study_reuses_and_reports_only_this_tunings_runs_and_the_designs_cells_at_their_rate(tmp_path, fake_runs):
    ran, shown = fake_runs
    argv = ["--config", CONFIG, "--out", str(tmp_path / "out"), "--workdirs", str(tmp_path / "w"), *SETS]
    study.main(argv)
    assert shown["chosen"] == {"pool": 0.003} and sorted(ran) == [
        "blind_4_s0", "blind_4_s1", "pool_4_s0", "pool_4_s1", "tune_pool_4_lr0.001", "tune_pool_4_lr0.003"]
    tuning, cells = tmp_path / "out/tuning.jsonl", tmp_path / "out/cells.jsonl"
    for key, seed in (("pool", 16, 1e-3), 0), (("pool", 4, 1e-2), 0), (("pool", 4, 1e-3), 1):  # another budget,
        _append(tuning, key, seed, {"family": "pool", "lr": key[2], "accuracy": 0.99})  # rate, seed: not this tuning's
    _append(cells, ("pool", 4), 2, {"family": "pool", "lr": 0.003, "accuracy": 0.1, "seed": 2})  # not a study seed
    _append(cells, ("mlp", 4), 0, {"family": "mlp", "lr": 0.003, "accuracy": 0.1, "seed": 0})  # not a study family
    _append(cells, ("pool", 4), 1, {"family": "pool", "lr": 0.001, "accuracy": 0.1, "seed": 1})  # at another rate
    ran.clear()
    study.main(argv)
    assert shown["chosen"] == {"pool": 0.003} and ran == ["pool_4_s1_lr0.003"]  # only the run at another rate
    assert sorted((r["run"], float(r["lr"])) for r in shown["tuned"]) == [
        ("tune_pool_4_lr0.001", 1e-3), ("tune_pool_4_lr0.003", 3e-3)]
    assert sorted(r["run"] for r in shown["rows"]) == ["blind_4_s0", "blind_4_s1", "pool_4_s0", "pool_4_s1_lr0.003"]


def test_tuning_on_the_test_split_is_refused_unless_asked_for(tmp_path, fake_runs, monkeypatch):
    """The LLaVA config names no split by default, so tuning and the test would read the same one."""
    argv = ["--config", "experiments/token_budget/configs/llava.py:smoke", "--out", str(tmp_path / "out"),
            "--set", "tune.lrs=(1e-3, 3e-3)"]
    with pytest.raises(SystemExit, match=r"tune.overrides and test_overrides name the same split "
                                         r"\(evals.val.data.data_path=None\).*--tune_on_test"):
        study.main(argv)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr("vitmm.checkpoint.load_params", lambda path: None)  # (the config's tower: not read here)
    study.main([*argv, "--set", "families=('pool',)", "--set", "budgets=(4,)", "--set", "tune.budget=4",
                "--workdirs", str(tmp_path / "w"), "--tune_on_test"])
    assert fake_runs[1]["chosen"] == {"pool": 0.003}  # knowingly: tuned, then run
    with pytest.raises(SystemExit, match="same split"):
        study.main([*argv[:4], "--set", "tune.overrides.evals.val.data.data_path=val.json",
                    "--set", "test_overrides.evals.val.data.data_path=val.json"])


def test_a_runs_checkpoints_are_deleted_only_after_its_row_is_saved(tmp_path, fake_runs, monkeypatch):
    """A study killed between a run's end and its saved row finds the run's checkpoints (the
    trainer refuses a workdir without them), so the rerun resumes and saves the row."""
    ran, _ = fake_runs

    def stop(*a):
        raise KeyboardInterrupt  # (killed before the row is on disk)

    for name in ("tune_pool_4_lr0.001", "pool_4_s0"):
        (tmp_path / "w" / name / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(study.store, "save_cell", stop)
    argv = ["--config", CONFIG, "--out", str(tmp_path / "out"), "--workdirs", str(tmp_path / "w"), *SETS]
    with pytest.raises(KeyboardInterrupt):
        study.main(argv)
    assert ran == ["tune_pool_4_lr0.001"] and (tmp_path / "w/tune_pool_4_lr0.001/checkpoints").is_dir()
    monkeypatch.undo()
    monkeypatch.setattr(study, "run", lambda s, name, *a: ran.append(name) or {"run": name, "accuracy": 0.5,
                                                                              "batch": 16})
    monkeypatch.setattr(study, "tower_grid", lambda config, need_lm=True: ((4, 4), {"width": 8}, None))
    monkeypatch.setattr(study.store, "check_tower", lambda *a: None)
    monkeypatch.setattr(study, "report", lambda *a: "")
    study.main(argv)
    assert not any((tmp_path / "w" / name / "checkpoints").exists() for name in ("tune_pool_4_lr0.001", "pool_4_s0"))


def test_a_run_returns_its_row_with_its_checkpoints_kept(tmp_path, monkeypatch):
    s = study.load(CONFIG, {})
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(study.train_run, "train", lambda *a: ({"steps": 4}, [{s.metric: 0.5}]))
    assert study.run(s, "r", "", {}, tmp_path)["accuracy"] == 0.5 and (tmp_path / "r/checkpoints").is_dir()
    study.drop_checkpoints(s, "r", tmp_path)
    assert not (tmp_path / "r/checkpoints").exists()
