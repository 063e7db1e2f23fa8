"""`python -m experiments.bench cpu_vs_torch` (the vitmm side; its PyTorch side needs torch) and `token_counts`."""

import csv
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_token_count_experiment_writes_tables(tmp_path):
    module = importlib.import_module("experiments.bench.token_counts")
    out = module.main(["--out", str(tmp_path)])
    csv_text = (out / "token_counts.csv").read_text().splitlines()
    assert csv_text[0].startswith("variant,resolution,patch")
    assert len(csv_text) == 1 + len(module.VARIANTS) * len(module.RESOLUTIONS) * len(module.PATCHES)
    assert "| B/16 | 224 | 197 | 38,809 | 35.1 |" in (out / "token_counts.md").read_text()


def test_a_worker_pins_itself_to_the_first_threads_cores():
    """XLA sizes its pool from the CPU affinity, not OMP_NUM_THREADS: --threads pins both frameworks' workers."""
    code = "from experiments.bench import workers; import os; workers.pin(1); print(len(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "1"


@pytest.mark.slow  # 4 timed worker processes, ~20 s; the tables' bookkeeping is checked below with a fake clock
def test_benchmark_script_runs_and_writes_its_tables(tmp_path):
    """The vitmm side of experiments/bench/cpu_vs_torch.py on a tiny ViT and a tiny CLIP pair (the PyTorch side
    needs torch)."""

    out = tmp_path / "bench"
    args = ["--variants", "mu/16", "--batch", "2", "--res", "64", "--warmup", "0", "--repeats", "1", "--no_torch",
            "--pair", "mu/16", "--pair_text_width", "64", "--pair_text_depth", "1", "--pair_text_len", "16",
            "--pair_vocab", "100", "--pair_embed_dim", "32"]
    bench = importlib.import_module("experiments.bench.cpu_vs_torch")
    bench.main([*args, "--out", str(out)])  # each side times in a worker process of its own
    rows = list(csv.DictReader(open(out / "benchmark.csv")))
    assert [(r["task"], r["variant"], r["mode"]) for r in rows] == [
        ("vit", "mu/16", "train"), ("vit", "mu/16", "infer"), ("pair", "mu/16", "train"), ("pair", "mu/16", "infer")]
    for r in rows:
        assert float(r["images_s"]) > 0 and float(r["matmul_gflops"]) > 0 and float(r["compile_s"]) > 0
        # XLA's own count agrees with the analytic formula, which leaves out norms, softmax, the
        # 1000-class head and the optimizer (up to ~15% of these tiny models, ~1% of ViT-S/16).
        assert abs(float(r["xla_vs_analytic"]) - 1) < 0.2, r
        assert "glibc.malloc.hugetlb=1" in r["glibc_tunables"] and float(r["minor_faults_per_step"]) >= 0
    # The pair's analytic count is the image tower's plus the text tower's (1 layer, 16 tokens, width 64).
    assert float(rows[2]["analytic_gflop_per_image"]) == pytest.approx(
        float(rows[0]["analytic_gflop_per_image"]) + (24 * 16 * 64**2 + 4 * 16**2 * 64) / 1e9, rel=1e-9)
    markdown = (out / "benchmark.md").read_text()
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in markdown
    assert "| ViT-mu/16 | train | vitmm |" in markdown and "| CLIP mu/16 + text (pairs) | infer | vitmm |" in markdown


def test_benchmark_scaling_table_sets_measured_next_to_predicted_ratios(tmp_path, monkeypatch):
    """The scaling mode's bookkeeping, with the timed worker replaced by a clock that is exactly
    proportional to the analytic FLOPs: every measured ratio must then equal its prediction."""
    bench = importlib.import_module("experiments.bench.cpu_vs_torch")
    fake = lambda python, kind, spec, threads, tunables: {"step_s": bench.analytic_gflop(spec["variant"], spec["res"])}  # noqa: E731
    monkeypatch.setattr(bench, "_run_worker", fake)
    out = bench.main(["--scaling", "Ti", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(out / "scaling.csv")))
    assert [(r["variant"], int(r["res"]), int(r["tokens"])) for r in rows[::2]] == [
        ("Ti/32", 224, 49), ("Ti/16", 224, 196), ("Ti/8", 224, 784), ("Ti/16", 448, 784)]
    for r in rows:
        assert float(r["measured_ratio"]) == pytest.approx(float(r["predicted_ratio"]), rel=1e-9)
    by = {(r["variant"], r["res"], r["mode"]): float(r["predicted_ratio"]) for r in rows}
    assert by[("Ti/16", "224", "infer")] == 1.0
    # Same tokens: the same encoder FLOPs; only the patch projection (4x the pixels at 448) differs.
    assert by[("Ti/8", "224", "infer")] == pytest.approx(by[("Ti/16", "448", "infer")], rel=0.03)
    assert by[("Ti/8", "224", "infer")] > 4  # 4x tokens: linear terms 4x, attention 16x
    assert "| Ti/8 | 224 | 784 |" in (out / "scaling.md").read_text()


def test_benchmark_rounds_take_turns_and_report_the_median_paired_ratio(tmp_path, monkeypatch):
    """``--rounds 3``: each round runs vitmm and the reference, the first to go alternating (drift over
    the run then favours neither); a row's time is the median over rounds and its ratio the median of
    the rounds' paired ratios, with their range."""
    bench = importlib.import_module("experiments.bench.cpu_vs_torch")
    calls = []
    times = {"jax": [1.0, 2.0, 1.0], "torch": [1.5, 2.0, 3.0]}  # paired ratios 1.5, 1.0, 3.0 per mode

    def fake(python, kind, spec, threads, tunables):
        calls.append(kind)
        assert tunables == bench.HUGE_PAGES  # the same allocator setting for both frameworks
        n = sum(c == kind for c in calls) - 1
        return {"framework": kind, "task": spec["task"], "variant": spec["variant"], "mode": spec["mode"],
                "step_s": times[kind][n % 3], "matmul_gflops": 100.0, "peak_rss_mb": 10.0 + n}

    monkeypatch.setattr(bench, "_run_worker", fake)
    out = bench.main(["--variants", "Ti/16", "--pair", "", "--rounds", "3", "--out", str(tmp_path)])
    assert calls == ["jax", "torch", "torch", "jax", "jax", "torch"] * 2  # turns, for train then infer
    rows = list(csv.DictReader(open(out / "benchmark.csv")))
    ref = rows[1]
    assert float(rows[0]["step_s"]) == 1.0 and float(ref["step_s"]) == 2.0
    assert float(ref["ratio"]) == 1.5 and float(ref["ratio_min"]) == 1.0 and float(ref["ratio_max"]) == 3.0
    assert float(ref["peak_rss_mb"]) == 12.0
    assert "1.50× (1.00–3.00)" in (out / "benchmark.md").read_text()
