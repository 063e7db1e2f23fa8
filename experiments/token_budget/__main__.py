"""``python -m experiments.token_budget``: the sweep on scenes features (``sweep.py``); with
``--config FILE``, the study on any inputs that FILE names (``study.py``)."""

import sys

from experiments.common import entry
from vitmm import xla_flags

xla_flags.use_vitmm_defaults()  # before JAX opens a backend
entry.quiet()  # the libraries' routine warnings off the console; --verbose keeps them
if any(a == "--config" or a.startswith("--config=") for a in sys.argv[1:]):
    from experiments.token_budget import study

    study.main()
else:
    from experiments.token_budget import sweep

    sweep.main()
