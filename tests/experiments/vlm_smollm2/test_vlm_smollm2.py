"""``python -m experiments.vlm_smollm2``: a row per finished run, skipped on a rerun."""

import pytest

from experiments.vlm_smollm2 import study


def test_the_smollm2_experiment_writes_a_row_per_finished_run_and_skips_it_on_a_rerun(
        tmp_path, clip_smoke_run, capsys):
    script = study
    args = ["--smoke", "--only", "scratch_lm_same_examples", "--out", str(tmp_path / "out"), "--workdirs",
            str(tmp_path / "w"), "--data_dir", clip_smoke_run.data_dir]
    script.main(args)
    rows = list(script.csv.DictReader((tmp_path / "out/runs.csv").open()))
    assert [r["run"] for r in rows] == ["scratch_lm_same_examples"]
    assert rows[0]["connector"] == "pool@16" and int(rows[0]["qa_examples"]) == 16
    assert 0 <= float(rows[0]["accuracy"]) <= 1 and float(rows[0]["peak_rss_gib"]) > 0
    script.main(args)
    assert "scratch_lm_same_examples: done, skipped" in capsys.readouterr().out
    assert len(list(script.csv.DictReader((tmp_path / "out/runs.csv").open()))) == 1
    assert "| scratch_lm_same_examples |" in (tmp_path / "out/vlm_smollm2.md").read_text()




def test_the_committed_report_is_written_again_from_its_runs_with_its_verdicts(tmp_path):
    """``--report`` rewrites vlm_smollm2.md from runs.csv and counts.json (no workdir needed): the
    committed report, Verdicts table included, byte for byte; without them it refuses."""
    import pathlib
    import shutil

    from experiments.vlm_smollm2 import study

    committed = pathlib.Path(__file__).resolve().parents[3] / "results/vlm_smollm2"
    with pytest.raises(SystemExit, match="has no runs.csv or counts.json"):
        study.main(["--report", "--out", str(tmp_path)])
    for name in ("runs.csv", "counts.json"):
        shutil.copy(committed / name, tmp_path / name)
    written = study.main(["--report", "--out", str(tmp_path)])
    assert written.read_text() == (committed / "vlm_smollm2.md").read_text()
    assert "All 30 tests of this report corrected together (Holm)" in written.read_text()
