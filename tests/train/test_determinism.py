"""``deterministic=True``: XLA's deterministic GPU kernels requested before JAX opens its backend,
refused where that is too late or contradicted, and cuDNN's attention run as XLA's (said once)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from vitmm.config_args import load
from vitmm.train import determinism, dry_run, tasks, vlm_start
from vitmm.train.parallel import Parallel

ROOT = pathlib.Path(__file__).resolve().parents[2]

FRESH_PROCESS = """
import json, os
from vitmm.train import determinism
determinism.set_flags({"deterministic": True})
import jax, jax.numpy as jnp
print(json.dumps({"flags": os.environ["XLA_FLAGS"], "backend": jax.default_backend(),
                  "sum": float(jax.jit(lambda a: (2 * a).sum())(jnp.ones(4)))}))
"""


def test_the_flag_reaches_xla_before_its_backend_opens():
    """In a fresh process the flag joins what XLA_FLAGS held, and XLA (here its CPU backend) starts with it."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out == {"flags": "--xla_force_host_platform_device_count=2 --xla_gpu_deterministic_ops=true",
                   "backend": "cpu", "sum": 8.0}


def test_too_late_or_contradicted_is_refused_in_one_line(monkeypatch):
    jax.devices()  # this process's backend is open
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=0")
    with pytest.raises(ValueError, match=r"XLA_FLAGS sets --xla_gpu_deterministic_ops=false; drop one of the two"):
        determinism.set_flags({"deterministic": True})
    monkeypatch.setenv("XLA_FLAGS", "")
    determinism.set_flags({"deterministic": True})  # a CPU's kernels already repeat: nothing to do, nothing said
    determinism.set_flags({"deterministic": False})
    assert os.environ["XLA_FLAGS"] == ""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match=r"gpu backend started before the run.*XLA_FLAGS=--xla_gpu_deterministic_ops="
                                         r"true"):
        determinism.set_flags({"deterministic": True})
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")  # set by the user: fine, even that late
    determinism.set_flags({"deterministic": True})
    # --dry_run on this machine compiles the step as the run would: the same flags, the same refusals.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    with pytest.raises(ValueError, match="drop one of the two"):
        dry_run.plan(load(ROOT / "configs/clip_scenes.py", "smoke", deterministic=True))


def test_cudnn_attention_runs_as_xlas_in_a_deterministic_run(data_dir, capsys, monkeypatch):
    """The image tower of a contrastive run, and a VLM's tower and LM, whatever their attn_impl came from;
    a run that is not deterministic keeps cuDNN's."""
    monkeypatch.setattr(determinism, "_said", set())
    clip = load(ROOT / "configs/clip_scenes.py", "smoke", **{"input.data_dir": data_dir, "deterministic": True})
    with clip.unlocked():
        clip.model.image.attn_impl = "cudnn"
    task = tasks.ContrastiveTask(clip, Parallel("jit"), tasks.tokenizer_for(clip))
    assert task.model.image["attn_impl"] == "xla"
    vlm = load(ROOT / "configs/vlm_scenes.py", "smoke", **{"input.data_dir": data_dir, "deterministic": True,
                                                           "model.vision.attn_impl": "cudnn",
                                                           "model.lm.attn_impl": "cudnn"})
    for _ in range(2):
        vision, lm = vlm_start.vlm_parts(vlm)
        assert vision["attn_impl"] == lm["attn_impl"] == "xla"
    said = capsys.readouterr().out.splitlines()
    assert [line.split(" runs ")[0] for line in said] == [f"deterministic=True: {part}" for part in
                                                           ("the image tower", "the tower", "the LM")]
    assert all("not attn_impl='cudnn'" in line and "docs/failures.md" in line for line in said)
    with vlm.unlocked():
        vlm.deterministic = False
    assert vlm_start.vlm_parts(vlm)[0]["attn_impl"] == "cudnn"


GPU_AOT = """
import json, sys
from vitmm.config_args import load
from vitmm.train import dry_run
out = {}
for impl, det in (("cudnn", False), ("cudnn", True), ("xla", True)):
    config = load("configs/clip_scenes.py", "smoke", **{"input.data_dir": sys.argv[1], "batch_size": 64,
                  "deterministic": det})
    with config.unlocked():
        config.model.image.update(attn_impl=impl, dtype_mm="bfloat16")
    out[f"{impl} {det}"] = dry_run.plan(config, target="h100")["temporaries"]
print(json.dumps(out))
"""


def test_a_deterministic_step_compiled_for_an_h100_uses_xlas_attention(data_dir, gpu_aot):
    """Compiled for an H100 (``VITMM_GPU_AOT_PYTHON``, skipped without it; see tests/README.md): the
    deterministic run with ``attn_impl=cudnn`` is the XLA-attention program (the same temporaries),
    not the cuDNN one."""
    temps = gpu_aot(GPU_AOT, data_dir)
    assert temps["cudnn True"] == temps["xla True"] != temps["cudnn False"], temps
