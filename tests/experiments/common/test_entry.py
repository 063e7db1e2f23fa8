"""The experiments' entry points (``python -m experiments.…``): the libraries' routine warnings
kept off the console as ``python -m vitmm.train`` keeps them (``--verbose`` keeps them on), and
a study of several scripts answers ``--help`` with their names."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]

# What an entry point does first, then a warning TFDS logs for every scenes build and one of a run's own.
EMIT = """
import logging, sys
sys.argv = ["python -m experiments.x", *sys.argv[1:]]
from experiments.common import entry
entry.quiet()
absl = logging.getLogger("absl")
absl.handle(logging.LogRecord("absl", logging.WARNING, "/x/tensorflow_datasets/core/dataset_builder.py", 1,
                              "Using custom data configuration: ScenesConfig(name='easy_32')", None, None))
absl.handle(logging.LogRecord("absl", logging.WARNING, "/x/experiments/x.py", 1, "a warning of its own", None, None))
print(sys.argv[1:])
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_an_entry_point_keeps_the_routine_warnings_off_the_console_unless_verbose():
    quiet = _python("-c", EMIT, "--smoke")
    assert quiet.returncode == 0, quiet.stderr
    assert "Using custom data configuration" not in quiet.stderr
    assert "a warning of its own" in quiet.stderr  # every other warning still prints
    assert quiet.stdout.strip() == "['--smoke']"
    verbose = _python("-c", EMIT, "--smoke", "--verbose")
    assert "Using custom data configuration" in verbose.stderr
    assert verbose.stdout.strip() == "['--smoke']"  # taken out: the entry point's own parser never sees it


def test_every_experiments_entry_point_runs_the_quiet_setup():
    """Each ``experiments/*/__main__.py`` calls ``entry.quiet()`` itself or through ``dispatch.main``."""
    mains = sorted((ROOT / "experiments").glob("*/__main__.py"))
    assert len(mains) >= 7
    for path in mains:
        text = path.read_text()
        assert "entry.quiet()" in text or "dispatch.main(" in text, path
    assert "entry.quiet()" in (ROOT / "experiments/common/dispatch.py").read_text()


def test_a_study_of_several_scripts_answers_help_with_their_names():
    shown = _python("-m", "experiments.lessons", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "is not one of them" not in shown.stdout + shown.stderr
    assert "python -m experiments.lessons pooling" in shown.stdout
    wrong = _python("-m", "experiments.lessons", "poolin")
    assert wrong.returncode == 1 and "'poolin' is not one of them" in wrong.stderr
