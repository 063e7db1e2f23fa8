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
