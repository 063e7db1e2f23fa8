"""`python -m experiments.native.eval` on the session's smoke CLIP."""

import csv
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_native_eval_scores_a_tower_on_squares_and_at_native_sizes(tmp_path, clip_smoke_run):
    module = importlib.import_module("experiments.native.eval")
    out = module.main(["--workdirs", str(clip_smoke_run.workdir), "--out", str(tmp_path), "--num_examples", "32",
                       "--smoke", "--data_dir", clip_smoke_run.data_dir])
    table = (out / "native_eval.md").read_text()
    assert "| zero-shot squares | zero-shot native |" in table and "| 64-px squares |" in table
    row = next(csv.DictReader(open(out / "native_eval.csv")))
    assert 0 <= float(row["zeroshot_native/accuracy"]) <= 1 and float(row["val_native/loss"]) > 0
