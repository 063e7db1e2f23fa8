"""`python -m experiments.bench connectors --tiny`."""

import importlib


def test_bench_connectors_tiny_reports_cost_and_time_per_reachable_cell(tmp_path):
    """``experiments/bench/connectors.py --tiny`` (what a GPU run does at real sizes): per reachable
    (family, tokens) the connector's parameters, FLOPs and time, the LM prefill's FLOPs and time,
    the stage-1 step's time for the step families; an unreachable budget is listed as such."""
    script = importlib.import_module("experiments.bench.connectors")
    rows = script.main(["--tiny", "--families", "pool,mlp", "--step_families", "pool", "--out",
                        str(tmp_path / "bc.json")])
    tower, cells = rows[0], {(r["family"], r["budget"]): r for r in rows[1:]}
    assert tower["grid"] == [4, 4] and tower["forward_ms"] > 0
    assert "unreachable" in cells[("mlp", 4)]["note"] and cells[("mlp", 16)]["tokens"] == 16
    pool4, pool16 = cells[("pool", 4)], cells[("pool", 16)]
    assert pool4["tokens"] == 4 and pool4["connector_params"] > 0 and pool4["connector_ms"] > 0
    assert 0 < pool4["tiny"]["lm_gflops"] < pool16["tiny"]["lm_gflops"]  # prefill grows with the visual tokens
    assert pool16["tiny"]["stage1_step_ms"] > 0 and "stage1_step_ms" not in cells[("mlp", 16)]["tiny"]
    assert "| pool | 4 |" in (tmp_path / "bc.md").read_text()


def test_the_prefill_flops_are_counted_on_the_lowered_program_not_the_compiled_one(monkeypatch):
    """An H200's cost analysis of the compiled prefill counted 15.4 GFLOP a sequence for SmolLM2-135M at
    640 tokens, where its matmuls alone are ~136: the count must not come from the compiled program. With
    the compiled count made to miss everything, the tiny LM's count still matches one by hand."""
    import jax
    import jax.numpy as jnp
    import pytest

    from vitmm.models import lm as lm_lib

    script = importlib.import_module("experiments.bench.connectors")
    monkeypatch.setattr(jax.stages.Compiled, "cost_analysis", lambda self: {"flops": 1.0})
    cfg, seq = script.lm_config("tiny", "float32"), 24
    row = script.prefill(cfg, 2, seq, 1, jax.random.key(0))
    model = lm_lib.LM(**cfg)
    shapes = jax.eval_shape(lambda k: model.init(k, embeds=jnp.zeros((1, seq, model.width))), jax.random.key(0))
    blocks = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(shapes)
                 if "block" in jax.tree_util.keystr(path) and x.ndim == 2)
    # the blocks' matmuls at every position, QKᵀ and PV in every layer, the head at the last position
    by_hand = 2 * blocks * seq + 4 * seq**2 * model.width * cfg["depth"] + 2 * model.width * cfg["vocab_size"]
    assert row["lm_gflops"] * 1e9 == pytest.approx(by_hand, rel=0.05)
    assert row["prefill_ms"] > 0
