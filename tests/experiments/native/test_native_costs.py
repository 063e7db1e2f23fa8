"""``python -m experiments.native.costs``: a smoke run writes its tables, and packing pads less."""

import csv
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.slow  # ~15 s: packing and FLIP are tests/models/test_packing.py's; this is the script's tables
def test_native_costs_smoke(tmp_path):
    env = dict(os.environ, XLA_FLAGS=os.environ.get("VITMM_TEST_XLA_FLAGS", ""))
    cmd = [sys.executable, "-m", "experiments.native.costs", "--out", str(tmp_path), "--examples", "32",
           "--keeps", "1.0,0.5", "--repeats", "1", "--flip_batch", "8", "--flip_steps", "1", "--rows", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    square, packed = list(csv.DictReader((tmp_path / "packing.csv").open()))
    assert square["layout"] == "padded square" and packed["layout"] == "NaFlex + packing"
    # the same patch budget: squares lose tokens to the bars, NaFlex images use their budget
    assert float(packed["padding_tokens"]) < float(square["padding_tokens"])
    assert float(square["image_tokens_per_image"]) < float(packed["image_tokens_per_image"]) <= 64
    flip = list(csv.DictReader((tmp_path / "flip.csv").open()))
    assert [int(r["image_tokens"]) for r in flip] == [64, 32]
    assert "## FLIP" in (tmp_path / "native_costs.md").read_text()
