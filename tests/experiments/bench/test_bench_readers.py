"""`python -m experiments.bench readers` on files it writes."""

import importlib

from vitmm.data import examples


def test_reader_benchmark_times_every_format_and_writes_its_tables(tmp_path):
    script = importlib.import_module("experiments.bench.readers")
    rows = script.main(["--num", "8", "--resolution", "32", "--batch", "4", "--batches", "1", "--repeats", "2",
                        "--threads", "1", "--workers", "0", "--out", str(tmp_path)])
    assert [(r["format"], r["decode"]) for r in rows] == [("scenes", "full")] + [
        (f, d) for f in examples.FORMATS for d in ("full", "draft")]
    assert all(r["low"] <= r["median"] <= r["high"] and r["cores_per_gpu"] > 0 for r in rows)
    assert (tmp_path / "bench_readers.csv").is_file()
    assert "| wds | full | float32 | 1 | 0 |" in (tmp_path / "bench_readers.md").read_text()
