"""``python -m experiments.token_budget``: the sweep on scenes features (``sweep.py``)."""

from experiments.token_budget import sweep
from vitmm import xla_flags

xla_flags.use_vitmm_defaults()  # before JAX opens a backend
sweep.main()
