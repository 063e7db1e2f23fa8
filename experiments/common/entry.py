"""What each ``python -m experiments.…`` entry point does first: the libraries' routine warnings
off the console, as ``python -m vitmm.train`` does (``vitmm/console.py``, docs/failures.md), so
that a sweep's console is its own lines and progress, not TFDS's "Using custom data configuration"
per scenes build or orbax's notes on each read-only checkpoint it reads."""

from __future__ import annotations

import sys

VERBOSE = "--verbose"


def quiet(argv: list[str] | None = None) -> bool:
    """``console.quiet``: ``--verbose`` in ``argv`` (default ``sys.argv``) keeps the warnings and
    absl's INFO lines. The flag is taken out of ``argv``, so an entry point's own parser need not
    know it. Returns whether it was given."""
    from vitmm import console

    argv = sys.argv if argv is None else argv
    verbose = VERBOSE in argv[1:]
    argv[1:] = [a for a in argv[1:] if a != VERBOSE]
    console.quiet(verbose)
    return verbose
