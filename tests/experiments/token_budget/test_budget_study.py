"""The token-budget study on any inputs (``python -m experiments.token_budget --config FILE``):
each run a ``vitmm.train`` run of the study's VLM config. On the frozen-SmolLM2 config with a
converted tiny GGUF LM (tuning, the grid, blind, resume, ``--interim``), and on the LLaVA config
with a converted HF tower, a converted LM and LLaVA-format conversations."""

import json
import pathlib

import pytest

from experiments.token_budget import study
from vitmm.data import examples
from vitmm.interop import __main__ as interop

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures/interop"


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    interop.main(["--from", "gguf", "--src", str(FIXTURES / "gguf_llama" / "tiny.gguf"), "--out", str(out)])
    return out


def _rows(path: pathlib.Path) -> list[dict]:
    return list(study.outputs.csv.DictReader(path.open()))


@pytest.mark.slow  # ~28 s, 4 vitmm.train processes: study.main end to end is the LLaVA test's below, the choice
# of rates test_choose_lrs_takes_the_best_score_then_the_smaller_rate's
def test_the_frozen_smollm2_config_tunes_then_runs_the_grid_and_blind_and_resumes(tmp_path, tiny_lm, clip_smoke_run,
                                                                                  capsys):
    """The lr chosen per family on validation is the one the grid runs with, on the test split;
    each run is kept (then its checkpoints deleted), blind sees blank images, a rerun trains
    nothing, and ``--interim`` reports the runs finished so far."""
    args = ["--config", "experiments/token_budget/configs/smollm2_frozen.py:smoke", "--out", str(tmp_path / "out"),
            "--workdirs", str(tmp_path / "w"), "--set", "families=('pool',)", "--set", "budgets=(4,)",
            "--set", "seeds=(0,)", "--set", "steps=4", "--set", "tune.lrs=(1e-3, 3e-3)", "--set", "tune.budget=4",
            "--set", "test_overrides.evals.qa.num_examples=8", "--set", "overrides.checkpoint_every=2",
            "--set", f"overrides.init.vision={clip_smoke_run.workdir}", "--set", f"overrides.init.lm={tiny_lm}",
            "--set", f"overrides.input.data_dir={clip_smoke_run.data_dir}"]
    study.main(args)
    tuned = _rows(tmp_path / "out/runs.csv")[:2]
    rows = _rows(tmp_path / "out/runs.csv")[2:]
    assert [r["run"] for r in tuned] == ["tune_pool_4_lr0.001", "tune_pool_4_lr0.003"]
    chosen = study.choose_lrs(tuned, ["pool"], higher=True)["pool"]
    assert {r["run"] for r in rows} == {"pool_4_s0", "blind_4_s0"}
    assert all(r["split"] == "validation" for r in tuned) and all(r["split"] == "test" for r in rows)
    assert all(float(r["lr"]) == chosen and r["tokens"] == "4" and int(r["qa_examples"]) == 8 for r in rows)
    assert all(float(r["connector_mflops"]) > 0 and float(r["ms_per_example"]) > 0 and float(r["peak_rss_gib"]) > 0
               for r in rows)
    assert not any((tmp_path / "w" / r["run"] / "checkpoints").exists() for r in tuned + rows)
    blind = json.loads((tmp_path / "w/blind_4_s0/config.json").read_text())
    assert "|blank|" in blind["input"]["pp"] and blind["seed"] == 0 and blind["checkpoint_every"] == 2
    report = (tmp_path / "out/frozen.md").read_text()
    assert "| pool | 4 |" in report and "| blind | 4 |" in report and "Spread across connectors" in report
    assert "Cost per cell" in report  # (one seed: no paired test, so no Holm line)
    capsys.readouterr()
    study.main(args)
    assert "$ " not in capsys.readouterr().out  # nothing trained again
    # --interim trains nothing: the report of the seeds finished so far, in OUT/interim/.
    part = tmp_path / "part"
    part.mkdir()
    lines = (tmp_path / "out/cells.jsonl").read_text().splitlines()
    (part / "cells.jsonl").write_text(lines[0] + "\n")  # the first finished run only
    (part / "tuning.jsonl").write_text((tmp_path / "out/tuning.jsonl").read_text())
    study.main([*args, "--out", str(part), "--interim"])
    interim = (part / "interim/frozen.md").read_text()
    assert f"| pool | 4 | {chosen:g} | 1 |" in interim and "| blind |" not in interim and "**" in interim
    assert sorted(p.name for p in part.iterdir()) == ["cells.jsonl", "interim", "tuning.jsonl"]
    (part / "tuning.jsonl").write_text((tmp_path / "out/tuning.jsonl").read_text().splitlines()[0] + "\n")
    study.main([*args, "--out", str(part), "--interim"])  # one rate still running: none is chosen yet
    assert "**" not in (part / "interim/frozen.md").read_text()


def test_the_llava_config_runs_on_a_converted_tower_lm_and_llava_data(tmp_path, tiny_lm):
    """A converted HF CLIP tower, a converted GGUF LM and LLaVA-format conversations: each
    reachable cell trains, is scored by the held-out answer-token accuracy and costed; a family
    that cannot reach the budget on the tower's grid is listed as unreachable."""
    tower = tmp_path / "tower"
    interop.main(["--from", "hf", "--src", str(FIXTURES / "hf_clip_vision"), "--out", str(tower), "--tower", "vision"])
    data = examples.write_llava(tmp_path / "llava", 16, resolution=32)
    folder = str(data.parent)
    study.main(["--config", "experiments/token_budget/configs/llava.py:smoke", "--out", str(tmp_path / "out"),
                "--workdirs", str(tmp_path / "w"), "--set", "families=('pool', 'mlp')", "--set", "budgets=(4,)",
                "--set", "seeds=(0,)", "--set", "steps=2", "--set", "tune.lrs=(1e-3,)", "--set", "tune.budget=4",
                "--set", f"overrides.init.vision={tower}", "--set", f"overrides.init.lm={tiny_lm}",
                "--set", f"overrides.input.data_path={data}", "--set", f"overrides.input.image_folder={folder}",
                "--set", f"overrides.evals.val.data.image_folder={folder}",
                "--set", "overrides.evals.val.num_examples=8",
                "--set", f"test_overrides.evals.val.data.data_path={data}"])
    (row,) = _rows(tmp_path / "out/runs.csv")
    assert row["family"] == "pool" and row["tokens"] == "4" and row["split"] == str(data)
    assert 0 <= float(row["accuracy"]) <= 1 and float(row["connector_params"]) > 0 and float(row["lm_mflops"]) > 0
    config = json.loads((tmp_path / "w/pool_4_s0/config.json").read_text())
    assert config["init"]["vision"] == str(tower) and config["init"]["lm"] == str(tiny_lm)
    assert config["model"]["connector"] == {"name": "pool", "budget": 4}
    report = (tmp_path / "out/study.md").read_text()
    assert "| pool | 4 | 0.001 | 1 |" in report and "Unreachable budgets: mlp at 4" in report
    assert json.loads((tmp_path / "out/tower.json").read_text())["workdir"] == str(tower)


def test_choose_lrs_takes_the_best_score_then_the_smaller_rate():
    tuned = [{"family": f, "lr": lr, "accuracy": acc} for f, lr, acc in [
        ("pool", "0.001", "0.5"), ("pool", "0.003", "0.7"), ("qformer", "0.003", "0.6"), ("qformer", "0.001", "0.6"),
        ("mlp", "0.01", "0.9")]]
    assert study.choose_lrs(tuned, ["pool", "qformer"], higher=True) == {"pool": 0.003, "qformer": 0.001}
    # A loss is lower-is-better: the other rate wins.
    assert study.choose_lrs(tuned, ["pool"], higher=False) == {"pool": 0.001}
