"""`python -m experiments.bench decode`: the vitmm side on a tiny GGUF (the transformers side needs torch)."""

import importlib
import pathlib

import numpy as np

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures/interop/hf_llama"  # GQA, Llama 3 RoPE


def test_the_decode_benchmarks_vitmm_side_runs_on_a_gguf():
    bench = importlib.import_module("experiments.bench.decode")
    gguf = FIXTURE.parent / "gguf_llama" / "tiny.gguf"
    out = bench.vitmm_side(dict(gguf=str(gguf), batches=[1, 2], prompt_len=5, new_tokens=3, repeats=1))
    assert out["framework"].startswith("vitmm")
    # timings only (a tiny model's per-token estimate is noise): present and finite for each batch
    assert all(out[b]["first_s"] > 0 and np.isfinite(out[b]["per_token_s"]) for b in ("1", "2"))
