"""What every budget-study config starts from; each study file overrides what it studies.

Keys: ``description`` (the report's first line; ``{steps}`` and ``{batch}`` are filled in),
``train_config`` (a ``vitmm.train`` VLM config taking ``connector=``, ``budget=`` and ``steps=``
args), ``train_args`` (its other args), ``overrides`` (nested: the train config's values every
run sets, e.g. ``init.vision``, ``init.lm``, ``input.data_path``), ``blind_args`` (the args of the
no-image baseline; empty: no blind row), ``smoke``/``smoke_args``, ``families``, ``budgets``
(visual tokens), ``max_ratio`` (how far from a budget a family may land), ``seeds``, ``steps``,
``tune`` (``lrs``: the grid, one rate: no tuning; ``budget``; ``overrides``: the tuning split),
``test_overrides`` (the final split), ``split_key`` (the dotted key naming the split in the rows),
``metric`` (the evaluator's metric the study compares, e.g. ``qa/accuracy``, ``val/token_acc``),
``metric_label``, ``higher_is_better``, ``kinds`` and ``kinds_prefix`` (per-kind metrics, e.g.
``qa/acc_<kind>``; empty: none), ``examples_key`` (the evaluator's example count, if any),
``lm_label`` (the LM column of ``runs.csv``), ``out``, ``workdirs``, ``report`` (the Markdown's
name), ``keep_checkpoints``; ``lmms_eval`` (``tasks`` set: every trained run is also scored by
lmms-eval through ``vitmm.serve``, ``vitmm.lmms_task.evaluate``, and ``metric`` may name its scores as
``<task>/<metric>``, e.g. ``vitmm_qa/accuracy``; ``include_path`` empty: ``tasks`` is the run's own
``qa`` questions written as a task of that name; ``python``: lmms-eval's interpreter, ``make eval-env``;
``model_args``: more of lmms-eval's ``--model_args``).
"""

import ml_collections


def study() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.description = "Each run trains for {steps} steps of {batch} examples."
    c.train_config = ""
    c.train_args = ""
    c.overrides = ml_collections.ConfigDict()
    c.blind_args = ""
    c.smoke = False
    c.smoke_args = "smoke=True"
    c.families = ("pool", "c_abstractor", "qwen_resampler")
    c.budgets = (4, 16)
    c.max_ratio = 2.0
    c.seeds = (0, 1, 2)
    c.steps = 300
    c.tune = ml_collections.ConfigDict(dict(lrs=(3e-4, 1e-3, 3e-3), budget=16, overrides={}))
    c.test_overrides = ml_collections.ConfigDict()
    c.split_key = ""
    c.metric = "qa/accuracy"
    c.metric_label = "accuracy"
    c.higher_is_better = True
    c.kinds = ()
    c.kinds_prefix = ""
    c.examples_key = ""
    c.lm_label = ""
    c.out = "results/token_budget/study"
    c.workdirs = "workdirs/token_budget_study"
    c.report = "study.md"
    c.keep_checkpoints = False
    c.lmms_eval = ml_collections.ConfigDict(dict(tasks="", include_path="", python=".venv-eval/bin/python",
                                                 model_args=""))
    return c
