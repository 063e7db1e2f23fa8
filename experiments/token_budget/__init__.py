"""The token-budget study: connectors × visual-token budgets × seeds on scenes questions, a frozen
tower and a small LM (``python -m experiments.token_budget``; ``sweep.py`` says how it runs).
``args`` (options and presets), ``jobs`` (what a worker process runs), ``report`` (the numbers and
the claims' tests), ``tables``, ``plots``, ``tune`` (the learning-rate grid), ``views`` (the
encoder-side budget) and ``horizon`` (cells trained longer). ``study.py`` runs the same question
with every run a ``vitmm.train`` run, on the tower, LM, data and evaluator a study config names
(``configs/``): ``python -m experiments.token_budget --config FILE``. Results: ``results/token_budget/``."""
