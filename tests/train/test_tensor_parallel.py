"""Tensor parallelism over a ``model`` mesh axis (``tensor_parallel``), alone and with FSDP and data
parallelism: the sharded step gives the data-parallel step's loss and parameters, for the
contrastive and the VLM task; a run resumes onto another layout."""

import dataclasses
import pathlib

import jax
import numpy as np
import pytest

from vitmm import checkpoint as ckpt_lib
from vitmm.config_args import load
from vitmm.train import inputs, trainer
from vitmm.train.parallel import MODEL_AXIS, Parallel

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYOUTS = {"TP 2 × DP 2": dict(tensor_parallel=2), "TP 4": dict(tensor_parallel=4),
           "TP 2 × FSDP 2": dict(tensor_parallel=2, fsdp=True, fsdp_min_size=64)}


def _step(setup, par):
    """One training step of ``setup``'s state on its first batch under ``par``'s layout."""
    setup = dataclasses.replace(setup, par=par)
    placed = par.put_state(jax.tree.map(np.asarray, setup.state))  # fresh buffers: the step donates them
    data = inputs.make(setup.config, setup.tokenizer, par, setup.task)
    batch = next(data)
    data.close()
    state, metrics = setup.compile(placed)(placed, batch)
    return jax.tree.map(np.asarray, state["params"]), float(metrics["loss"]), placed


def test_the_batch_splits_over_the_data_axis_not_every_device():
    """With tensor_parallel=K the batch (and each micro-batch) is sharded over the n/K devices of the
    data axis: on the 4 test devices TP 4 takes a batch of 2, TP 2 refuses an odd one naming that axis."""
    path = ROOT / "configs/clip_scenes.py"
    trainer.validate(load(path, "smoke", tensor_parallel=4, batch_size=2))
    trainer.validate(load(path, "smoke", tensor_parallel=2, batch_size=4, **{"optim.accum_steps": 2}))
    axis = r"the 2 devices of the data axis \(4 devices / tensor_parallel=2\)"
    with pytest.raises(ValueError, match=rf"batch_size=3 does not split over {axis}; use a multiple of 2\."):
        trainer.validate(load(path, "smoke", tensor_parallel=2, batch_size=3))
    with pytest.raises(ValueError, match=rf"accum_steps=4: .* dividing batch_size=4 / {axis}\."):
        trainer.validate(load(path, "smoke", tensor_parallel=2, batch_size=4, **{"optim.accum_steps": 4}))


@pytest.mark.parametrize("config", [pytest.param("clip_scenes.py:smoke", marks=pytest.mark.slow),  # the VLM's tower
                                    "vlm_scenes.py:smoke,stage=2"])  # and LM cover its layers (~5 s saved)
def test_tensor_parallel_steps_equal_the_data_parallel_step(config, data_dir):
    """On the 4 test devices (the issue asks 8; the layouts are the same with 4): TP 2 × DP 2, TP 4
    and TP 2 × FSDP 2 against DP 4 (itself tested equal to one device): loss and every updated
    parameter within 1e-6 (relative) / 1e-7; the projections are split over ``model``."""
    path, _, arg = config.partition(":")
    setup = trainer.build(load(ROOT / "configs" / path, arg, **{"input.data_dir": data_dir}))
    want_params, want_loss, _ = _step(setup, Parallel("jit"))
    for name, layout in LAYOUTS.items():
        if name == "TP 4" and path.startswith("clip"):  # the VLM's LM and tower cover it; a compile saved
            continue
        params, loss, placed = _step(setup, Parallel("jit", **layout))
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6, err_msg=name)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
        split = [p for p, x in jax.tree_util.tree_leaves_with_path(placed["params"])
                 if MODEL_AXIS in str(x.sharding.spec)]
        assert len(split) >= 4, name


STOP_AT_2 = """
import sys
from vitmm.config_args import load
from vitmm.train import trainer
config = load("configs/vlm_scenes.py", "smoke,stage=2", **{"input.data_dir": sys.argv[2], "total_steps": 4,
                                                          "tensor_parallel": 2, "fsdp": True})
import jax
assert jax.device_count() == 8
print(trainer.train(config, sys.argv[1], stop_at=2)["final_step"])
"""


def test_a_tensor_parallel_run_on_8_devices_resumes_on_4_without_it(tmp_path, data_dir):
    """Stopped at step 2 on 8 devices with TP 2 × FSDP 4 (another process), resumed here on 4
    devices with plain data parallelism: it ends where an uninterrupted 4-device run ends (the
    restore reshards the checkpoint onto the new mesh)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": os.environ["VITMM_TEST_XLA_FLAGS"] + " --xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, "-c", STOP_AT_2, str(tmp_path / "run"), str(data_dir)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("2"), result.stderr[-2000:]
    config = load(ROOT / "configs/vlm_scenes.py", "smoke,stage=2", **{"input.data_dir": data_dir, "total_steps": 4})
    straight = trainer.train(config, tmp_path / "straight")
    resumed = trainer.train(config, tmp_path / "run")
    assert resumed["final_step"] == 4
    assert resumed["param_checksum"] == pytest.approx(straight["param_checksum"], rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 ckpt_lib.load_params(tmp_path / "run"), ckpt_lib.load_params(tmp_path / "straight"))
