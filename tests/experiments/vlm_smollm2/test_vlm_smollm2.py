"""``python -m experiments.vlm_smollm2``: a row per finished run, skipped on a rerun."""

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


