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




def test_the_committed_report_is_written_again_from_its_runs_with_its_verdicts(tmp_path, capsys):
    """``--report`` rewrites vlm_smollm2.md from runs.csv and counts.json (no workdir needed): the
    committed report, Verdicts table included, byte for byte, and says where, as the other
    ``--report``s do; without them it refuses."""
    import pathlib
    import shutil

    from experiments.vlm_smollm2 import study

    committed = pathlib.Path(__file__).resolve().parents[3] / "results/vlm_smollm2"
    with pytest.raises(SystemExit, match="has no runs.csv or counts.json"):
        study.main(["--report", "--out", str(tmp_path)])
    for name in ("runs.csv", "counts.json"):
        shutil.copy(committed / name, tmp_path / name)
    written = study.main(["--report", "--out", str(tmp_path)])
    assert capsys.readouterr().out == f"wrote {written}\n"
    assert written.read_text() == (committed / "vlm_smollm2.md").read_text()
    assert "All 36 tests of this report corrected together (Holm)" in written.read_text()


def test_each_run_s_intervals_use_the_questions_it_answered(tmp_path):
    """``--smoke`` asks SmolLM2 8 questions and the scratch LM 16: each row's interval and each
    test use the run's own counts, not the first run's; counts that do not match a row are refused."""
    import json

    from vitmm.study import stats

    rows = {"smollm2_stage2_lora": 8, "scratch_lm_same_examples": 16}
    counts = {"smollm2_stage2_lora": dict(exists=3, count=2, color_at=1, shape_at=1, relative=1, all=8),
              "scratch_lm_same_examples": dict(exists=5, count=4, color_at=3, shape_at=2, relative=2, all=16)}
    with (tmp_path / "runs.csv").open("w", newline="") as f:
        writer = study.csv.DictWriter(f, study.FIELDS)
        writer.writeheader()
        for run, n in rows.items():
            writer.writerow(dict.fromkeys(study.FIELDS, 1) | dict(run=run, qa_examples=n, accuracy=0.5,
                                                                   **{f"acc_{k}": 0.5 for k in study.KINDS}))
    (tmp_path / "counts.json").write_text(json.dumps(counts))
    text = study.main(["--report", "--out", str(tmp_path)]).read_text()
    for run, n in rows.items():
        lo, hi = stats.wilson(0.5, n)
        assert f"| {run} | 1 | 1 | 1 | 50.0 [{100 * lo:.0f}, {100 * hi:.0f}] |" in text
    assert "| smollm2_stage2_lora − scratch_lm_same_examples, accuracy | +0.0 |  | 8 and 16 questions |" in text
    (tmp_path / "counts.json").write_text(json.dumps(counts["smollm2_stage2_lora"]))  # the first run's for all
    with pytest.raises(SystemExit, match="scratch_lm_same_examples answered 16 questions, but counts.json has 8"):
        study.main(["--report", "--out", str(tmp_path)])



def test_each_smollm2_run_keeps_mid_run_checkpoints_so_a_killed_run_resumes_part_way(tmp_path, monkeypatch):
    """The configs checkpoint only at their last step (``checkpoint_every = steps``): a SmolLM2 stage
    (15-19 minutes) killed without a signal (``kill -9``, out of memory, a reboot) trained again from
    step 0. The study asks for a checkpoint every 50 steps, as the frozen subset's config does."""
    from vitmm.config_args import load

    seen = {}

    def fake_train(config, workdir, args, name):
        seen[name] = (config, list(args))
        return {}, [{"qa/accuracy": 0.5, "qa/examples": 8}]

    monkeypatch.setattr(study.train_run, "train", fake_train)
    for spec in study.plan(300, 150, smoke=False):
        study.run_one(spec, tmp_path, [])
    for name in ("smollm2_stage1", "smollm2_stage2_lora", "smollm2_stage2_lora_blind"):
        config, args = seen[name]
        every = [int(a.split("=")[1]) for a in args if a.startswith("--config.checkpoint_every=")]
        assert every and every[-1] < 300, (name, args)
        file, _, arg = config.partition(":")
        assert load(study.ROOT / file, arg).checkpoint_every == 300  # what the run had without the override


def test_a_row_cut_short_by_a_kill_is_run_again_and_its_new_row_replaces_it(tmp_path, monkeypatch):
    """A kill (or a full disk) while ``runs.csv`` is written leaves part of a row: that run is not
    finished, so a rerun trains it again and its row replaces the torn one (which was taken for a
    finished run, and the next row was appended onto it)."""
    import pathlib
    import shutil

    committed = pathlib.Path(__file__).resolve().parents[3] / "results/vlm_smollm2"
    out = tmp_path / "out"
    out.mkdir()
    lines = (committed / "runs.csv").read_text().splitlines(keepends=True)
    torn = lines[3][:40]  # smollm2_stage2_lora_blind's row, cut mid-way
    (out / "runs.csv").write_text("".join(lines[:3]) + torn)
    shutil.copy(committed / "counts.json", out / "counts.json")
    full = {r["run"]: r for r in study.csv.DictReader(lines)}
    trained = []

    def fake_run(spec, workdirs, overrides):
        trained.append(spec["run"])
        return {k: full[spec["run"]][k] for k in study.FIELDS}

    monkeypatch.setattr(study, "run_one", fake_run)
    monkeypatch.setattr(study, "kind_counts", lambda workdir: study.json.loads((committed / "counts.json").read_text()))
    study.main(["--out", str(out), "--workdirs", str(tmp_path / "w")])
    assert trained == ["smollm2_stage2_lora_blind", "scratch_lm_same_examples", "scratch_lm_500_steps"]
    assert (out / "runs.csv").read_text() == "".join(lines)
    assert (out / "vlm_smollm2.md").read_text() == (committed / "vlm_smollm2.md").read_text()
