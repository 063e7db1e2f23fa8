"""``python -m vitmm.train --dry_run``: the step compiled, not run; its per-device memory against
what a real step takes on this CPU, and nothing written."""

import pathlib

import jax
import pytest

from vitmm.config_args import load
from vitmm.train import dry_run, inputs, trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_the_dry_run_predicts_a_real_steps_memory_growth(data_dir):
    """A VLM stage-2 step (batch 256): the process's peak memory grows over one step by the
    temporaries and outputs the dry run predicts (per device, times the devices: this process holds
    them all), within 0.8–1.5× (measured 1.08× on one device; a smaller batch's overheads weigh
    more: 1.20× at batch 64). Parameters are their shapes' bytes (replicated)."""
    config = load(ROOT / "configs/vlm_scenes.py", "smoke,stage=2", **{"input.data_dir": data_dir, "batch_size": 256})
    needs = dry_run.plan(config)
    setup = trainer.build(config)
    params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.state["params"]))
    assert needs["parameters"] == params_bytes and needs["devices"] == jax.device_count()
    devices = needs["devices"]  # the numbers are per device; this process holds every (virtual) CPU device
    assert devices * needs["temporaries"] > 100 * 2**20 and needs["flops"] > 1e9 / devices
    placed = setup.par.put_state(setup.state)
    data = inputs.make(config, setup.tokenizer, setup.par, setup.task)
    batch = next(data)
    data.close()
    compiled = setup.compile(placed).lower(placed, batch).compile()
    jax.block_until_ready((placed, batch))
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from here
        f.write("5")
    before = _status("VmRSS")
    jax.block_until_ready(compiled(placed, batch))
    grown = _status("VmHWM") - before
    predicted = devices * (needs["temporaries"] + needs["outputs_not_aliased"])
    assert 0.8 <= grown / predicted <= 1.5, (grown / 2**20, predicted / 2**20)


def test_the_cli_prints_the_needs_and_writes_nothing(tmp_path, data_dir):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "vitmm.train", "--config", "configs/vlm_scenes.py:smoke",
                             "--workdir", str(tmp_path / "run"), "--dry_run", f"--config.input.data_dir={data_dir}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("per device (") and "temporaries" in result.stdout
    assert "GFLOPs a step" in result.stdout and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="parallel=jit"):
        dry_run.plan(load(ROOT / "configs/vlm_scenes.py", "smoke", **{"input.data_dir": data_dir, "parallel": "pmap"}))


def test_the_dry_run_reads_no_weights_of_the_init_folders(data_dir, clip_smoke_run, monkeypatch):
    """The parameters are the model's shapes: init.vision's weights (and init.lm's, a 7B LM's
    gigabytes) are not read; it once restored them all on the host to learn their shapes."""
    import ml_collections

    from vitmm import checkpoint as ckpt_lib

    config = load(ROOT / "configs/vlm_scenes.py", "smoke,connector=pool,budget=4",
                  **{"input.data_dir": data_dir, "init.vision": str(clip_smoke_run.workdir),
                     "init.allow_random_tower": False})
    with config.unlocked():
        config.evals = ml_collections.ConfigDict()

    def refused(path, *args, **kwargs):
        raise AssertionError(f"--dry_run read the weights of {path}")

    monkeypatch.setattr(ckpt_lib, "load_params", refused)
    assert dry_run.plan(config)["parameters"] > 0


def test_a_gpu_target_is_a_known_card_and_needs_jaxs_cuda_plugin(data_dir):
    """``--dry_run_target``: the card's description as XLA reads it; without JAX's CUDA plugin (as in
    this environment) one error that names what to install, nothing compiled."""
    from vitmm.train import gpu_targets

    assert "core_count: 132" in gpu_targets.target_config("h100") and "major: 8" in gpu_targets.target_config("a100")
    with pytest.raises(ValueError, match=r"dry_run_target='v100'.*\['a100', 'h100', 'h200'\]"):
        gpu_targets.target_config("v100")
    with pytest.raises(ValueError, match="dry_run_devices=0"):
        gpu_targets.devices("h100", 0)
    config = load(ROOT / "configs/vlm_scenes.py", "smoke", **{"input.data_dir": data_dir})
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"CUDA plugin.*pip install \"jax\[cuda13\]\""):
            dry_run.plan(config, target="h100")


GPU_AOT = """
import json, sys
from vitmm.config_args import load
from vitmm.train import dry_run
out = {}
for devices, fsdp in [(1, False), (2, True)]:
    config = load("configs/vlm_scenes.py", "smoke,stage=2",
                  **{"input.data_dir": sys.argv[1], "batch_size": 64 * devices, "fsdp": fsdp})
    out[devices] = dry_run.plan(config, target="h100", num_devices=devices)
print(json.dumps(out))
"""


def test_compiled_for_h100s_on_a_machine_without_one(data_dir, gpu_aot):
    """``plan(target="h100")`` in an environment with JAX's CUDA plugin (``VITMM_GPU_AOT_PYTHON``, see
    tests/README.md; skipped without it): the step XLA compiles for one H100 and for two with FSDP,
    per device: FSDP's shards of the parameters in the compiled program's inputs, the batch a GPU the same,
    the parameters and FLOPs those of XLA:CPU's program of the same step."""
    one, two = gpu_aot(GPU_AOT, data_dir).values()
    assert one["backend"] == two["backend"] == "h100" and (one["devices"], two["devices"]) == (1, 2)
    for needs in one, two:  # XLA's count of a device's inputs: the state as laid out, its batch (less unused fields)
        assert abs(needs["arguments"] - (needs["parameters"] + needs["optimizer_state"] + needs["batch"])) < 4096
    assert two["parameters"] < 0.8 * one["parameters"] and two["batch"] == one["batch"]
    cpu = dry_run.plan(load(ROOT / "configs/vlm_scenes.py", "smoke,stage=2",
                            **{"input.data_dir": data_dir, "batch_size": 64}))
    assert cpu["parameters"] == one["parameters"] and one["temporaries"] > 0
    assert abs(one["flops"] / (cpu["flops"] * cpu["devices"]) - 1) < 0.02  # XLA:CPU's are per (virtual) device


LM_AOT = """
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from vitmm.models import layers, lm
from vitmm.train import gpu_targets
device = gpu_targets.devices("h100")[0]
out = {}
for impl, remat in ((None, "none"), ("cudnn", "none"), ("cudnn", "nothing_saveable")):
    model = lm.LM(vocab_size=300, width=256, depth=4, num_heads=4, num_kv_heads=2, dtype_mm="bfloat16", attn_impl=impl,
                  remat_policy=remat)
    ids = jax.ShapeDtypeStruct((8, 1024), jnp.int32, sharding=NamedSharding(jax.sharding.Mesh([device], ("d",)), P()))
    with layers.compiling_for("gpu"):
        params = jax.eval_shape(model.init, jax.random.key(0), ids)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ids.sharding), params)
        loss = lambda p, i: model.apply(p, i, prefix_len=100).astype(jnp.float32).mean()
        compiled = jax.jit(jax.grad(loss)).lower(params, ids).compile({"xla_gpu_autotune_level": 0})
    out[f"{impl} {remat}"] = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps(out))
"""


def test_the_lms_fused_attention_holds_no_scores_on_an_h100(gpu_aot):
    """The LM's ``attn_impl="cudnn"`` compiled for an H100 (``VITMM_GPU_AOT_PYTHON``, skipped without
    it), training at 1,024 positions with a prefix mask and grouped heads: XLA's attention holds every
    score (float32, batch × heads × 1,024² a layer) for the backward pass, cuDNN's a few vectors
    (measured 1.09 GiB against 0.32); with the blocks checkpointed (``remat_policy``) half the rest (0.16)."""
    temps = gpu_aot(LM_AOT)
    scores = 4 * 8 * 4 * 1024**2 * 4  # four layers' float32 scores
    assert temps["None none"] > scores and temps["None none"] > 3 * temps["cudnn none"], temps
    assert temps["cudnn nothing_saveable"] < 0.7 * temps["cudnn none"], temps
