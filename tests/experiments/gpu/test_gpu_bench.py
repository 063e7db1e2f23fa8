"""`python -m experiments.gpu bench` at --tiny size on the CPU."""

import importlib
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def bench_gpu():
    return importlib.import_module("experiments.gpu.bench")


@pytest.mark.slow  # the device script at tiny size (~12 s); `session.sh --tiny` runs it before every device call
def test_bench_gpu_tiny_runs_every_case_and_profiles_it(tmp_path, bench_gpu):
    """experiments/gpu/bench.py end to end at --tiny size on the CPU: every case times, its
    profile attributes the step's ops, and the tables are written."""
    out = tmp_path / "bench_gpu.json"
    results = bench_gpu.main(["--tiny", "--profile", "--steps", "2", "--repeats", "1", "--out", str(out)])
    assert set(results) == {"agreement", *(c[0] for c in bench_gpu.CASES)}
    # bf16 against float32 on the same tokens: close, not equal (cuDNN is absent on a CPU)
    assert 1e-4 < results["agreement"]["xla_bf16"]["rel"] < 0.02
    assert 1e-4 < results["agreement"]["xla_bf16_residual_bf16"]["rel"] < 0.03
    assert "error" in results["agreement"]["cudnn_bf16"] or results["agreement"]["cudnn_bf16"]["rel"] < 0.02
    for name, r in results.items():
        if name == "agreement":
            continue
        assert "error" not in r, (name, r)
        assert r["step_s"] > 0 and r["flops"] > 0 and r["batch"] == 2
        assert r["profile"]["unknown_ops"] == 0 and r["profile"]["by_kind"]["matmul"] > 0
    assert json.loads(out.read_text()).keys() == results.keys()
    profile = (tmp_path / "profile.md").read_text()
    assert profile.count("## ") == len(results) - 1 and "| forward | encoder/block_*/mlp/fc1 |" in profile


def test_bench_gpu_sweep_runs_each_setting_in_its_own_process(tmp_path, monkeypatch, bench_gpu):
    """The sweep hands each setting's XLA flags and arguments to a fresh process: a flag XLA does
    not know fails that setting alone, and speed-ups are against the baseline runs."""
    bench = bench_gpu
    monkeypatch.setattr(bench, "SWEEP", [("baseline", "", []), ("bogus flag", "--xla_no_such_flag_anywhere=1", []),
                                         ("tanh GELU", "", ["--act", "gelu_tanh", "--dtype_residual", "bfloat16",
                                                            "--attn", "xla"])])
    out = tmp_path / "sweep.json"
    rows = bench.main(["--tiny", "--sweep", "--steps", "1", "--repeats", "1", "--out", str(out)])["sweep"]
    assert [r["setting"] for r in rows] == ["baseline", "bogus flag", "tanh GELU"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[2]["step_ms"] > 0 and "speedup" in rows[2]
    assert "error" in rows[1] and "step_ms" not in rows[1]
    markdown = out.with_suffix(".md").read_text()
    assert "| tanh GELU | `` | `--act gelu_tanh --dtype_residual bfloat16 --attn xla` |" in markdown
    assert "| bogus flag |" in markdown
