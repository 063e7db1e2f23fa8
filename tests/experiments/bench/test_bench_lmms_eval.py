"""`python -m experiments.bench lmms_eval`'s arithmetic (the run itself needs lmms-eval: tests/test_lmms_eval.py)."""

import importlib


def test_the_lmms_eval_benchmarks_median_of_an_even_count_is_the_mean_of_the_middle_two():
    bench = importlib.import_module("experiments.bench.lmms_eval")
    assert bench._median([1.0, 2.0, 3.0, 4.0]) == [2.5, 1.0, 4.0]
