"""The token-budget study: connectors × visual-token budgets × seeds on scenes questions, a frozen
tower and a small LM (``python -m experiments.token_budget``; ``sweep.py`` says how it runs).
``args`` (options and presets), ``jobs`` (what a worker process runs), ``report`` (the numbers and
the claims' tests), ``tables``, ``plots``, ``tune`` (the learning-rate grid), ``views`` (the
encoder-side budget) and ``horizon`` (cells trained longer). Results: ``results/token_budget/``."""
