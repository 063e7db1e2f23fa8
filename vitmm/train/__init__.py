"""Training: optimizer, parallelism, checkpoints, metrics, evaluators and the loop.

Command line: ``python -m vitmm.train --config configs/X.py --workdir DIR [--config.k=v]``.
"""
