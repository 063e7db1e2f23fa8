"""A data folder for the training tests, one per worker: the smoke builds are made in it once; and
``gpu_aot``, the runner of the opt-in compiles for H100s."""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture
def gpu_aot():
    """``run(script, *args) -> the JSON its last line prints``: ``script`` run by the Python that
    ``VITMM_GPU_AOT_PYTHON`` names (one with JAX's CUDA plugin, which compiles for GPUs not here; see
    tests/README.md). Without it the test is skipped: ``make test`` cannot install the plugin's 4 GB."""
    python = os.environ.get("VITMM_GPU_AOT_PYTHON")
    if not python:
        pytest.skip("VITMM_GPU_AOT_PYTHON (a Python with jax[cuda13]) is not set")

    def run(script: str, *args: str):
        result = subprocess.run([python, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                                env={**os.environ, "JAX_PLATFORMS": "", "PYTHONPATH": str(ROOT)})
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1])

    return run
