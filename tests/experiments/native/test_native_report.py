"""The native study's report (``experiments/native/tokens_report.py``) says what its runs were: the
protocol they ran, the seeds each cell holds and where each rate sits in its tuning grid."""

import numpy as np

from experiments.native import tokens_report

PLANNED = list(range(10))


def _setup(**changes) -> dict:
    setup = dict(command="python -m experiments.native", date="2026-12-07", backend="cpu", difficulty="easy-heldout",
                 min_side=32, max_side=160, max_aspect=3.0, train_images=10_000, test_questions=6_000, tower="t",
                 lm={}, seeds=PLANNED, steps=6000, schedule="cosine", patience=0, min_delta=0.005, eval_every=250,
                 curve_questions=2000, budgets=[16, 64], chosen={"square": 0.001, "naflex": 0.001, "blind": 0.001},
                 tuning={}, wide=2.0, wide_share=0.38)
    return {**setup, **changes}


def _rows(seeds_of: dict) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for (path, budget), seeds in seeds_of.items():
        for seed in seeds:
            acc = {k: float(rng.uniform(0.4, 0.8)) for k in ("accuracy", "spatial", "acc_wide", "acc_squarish",
                                                            *(f"acc_{k}" for k in tokens_report.KINDS))}
            rows.append({"path": path, "budget": budget, "seed": seed, "tokens_mean": float(budget),
                         "tokens_max": budget, **acc})
    return rows


FULL = {("square", 16): PLANNED, ("naflex", 16): PLANNED, ("square", 64): PLANNED, ("naflex", 64): PLANNED,
        ("blind", 64): PLANNED}


def test_a_cell_short_of_seeds_is_named_and_its_tests_say_how_many_they_pair():
    """A report of a partial sweep (a cell holding 3 of the 10 seeds) must not claim 10 seeds for
    every cell, and the tests that read that cell say on how many seeds they pair."""
    text = tokens_report.to_markdown(_rows({**FULL, ("naflex", 16): [0, 1, 2]}), _setup())
    assert "; 10 seeds;" not in text
    assert "naflex at 16: 3" in text
    verdicts = [line for line in text.splitlines() if line.startswith("| naflex − square at 16")]
    assert verdicts and all("3 of 10 seeds" in line for line in verdicts)
    assert all("of 10 seeds" not in line for line in text.splitlines() if line.startswith("| naflex − square at 64"))
    full = tokens_report.to_markdown(_rows(FULL), _setup())
    assert "; 10 seeds;" in full and "of 10 seeds" not in full


def test_the_cosine_protocol_says_which_checkpoint_is_tested_and_whether_runs_stop_early():
    """Under the cosine protocol the tested parameters are those of the last validation check that
    beat the best before it (not the end of the decay); with a patience runs may stop before it."""
    text = tokens_report.to_markdown(_rows(FULL), _setup())
    assert "6,000 joint steps, the rate decayed to zero (cosine)" in text
    assert "the last validation check" in text and "0.5 points" in text
    stopped = tokens_report.to_markdown(_rows(FULL), _setup(patience=4))
    assert "6,000 joint steps, the rate" not in stopped
    assert "stopped at its validation plateau (no gain of 0.005 in 4 checks 250 steps apart)" in stopped
    constant = tokens_report.to_markdown(_rows(FULL), _setup(schedule="constant", patience=0))
    assert "6,000 joint steps at a constant rate; the parameters of the last validation check" in constant


def test_a_rate_chosen_at_an_edge_of_its_grid_is_flagged():
    """Each path's validation accuracy per rate is printed, and a chosen rate at an edge of the grid
    it was chosen from (the rate past it never tried) is named: that path may be under-tuned."""
    tuning = {"square@64|0.0003": 0.60, "square@64|0.001": 0.65, "square@64|0.003": 0.62,
              "naflex@64|0.0003": 0.70, "naflex@64|0.001": 0.66, "naflex@64|0.003": 0.61,
              "naflex@64|0.0001": 0.69, "blind@64|0.0003": 0.42, "blind@64|0.001": 0.43, "blind@64|0.003": 0.43}
    chosen = {"square": 0.001, "naflex": 0.0003, "blind": 0.001}
    text = tokens_report.to_markdown(_rows(FULL), _setup(tuning=tuning, chosen=chosen))
    assert "naflex 0.0001: 69.0, **0.0003: 70.0**, 0.001: 66.0, 0.003: 61.0" in text
    assert "at an edge of its grid" not in text  # naflex's low edge was extended, and lost
    edge = {**tuning, "naflex@64|0.0001": None}
    del edge["naflex@64|0.0001"]
    text = tokens_report.to_markdown(_rows(FULL), _setup(tuning=edge, chosen=chosen))
    assert "at an edge of its grid (the rate past it not tried): naflex (0.0003)" in text
