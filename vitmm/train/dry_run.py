"""``python -m vitmm.train --config ... --workdir W --dry_run``: the training step compiled for the
run's devices and mesh, not run, and what it needs per device.

    parameters 12.3 MiB, optimizer state 24.6 MiB, batch 1.5 MiB, temporaries 210.0 MiB,
    outputs 0.0 MiB beyond the donated state: 248.4 MiB a device at the step's peak; 3.1 GFLOPs a step

Nothing is trained or written: the parameters and the optimizer state are shapes only
(``jax.eval_shape`` of the model's initialisation, ``init_params(load=False)``): no weight of an
``init.*`` folder is read (a 7B LM would be gigabytes of host memory for shapes the model already
has; the run checks the folders' shapes against the model when it starts); what the run reads of
those folders besides weights is read (their saved config, the tokenizer). The batch is one batch
of the run's own input. The numbers are XLA's for the compiled program (``memory_analysis``,
``cost_analysis``), per device: parameters, optimizer state and batch from their shardings, the
temporaries (activations kept for the backward pass, gradients, workspace) from the buffer
assignment, the peak as arguments + temporaries + outputs not aliased to a donated argument. On
the CPU the measured growth of the process's memory over a step is within a stated margin of it
(``tests/train/test_dry_run.py``). The numbers are the backend's: XLA:CPU computes bfloat16
matmuls in float32 and has no fused attention, so a GPU config's temporaries dry-run on the CPU
come out several times what its GPU needs (CLIP-B/16 at batch 256: 47.7 GiB on the CPU). For a
GPU's numbers, run it on the GPU, or compile for one from any machine:

    python -m vitmm.train --config ... --workdir W --dry_run --dry_run_target=h100 --dry_run_devices=8

compiles the program XLA would build for eight H100s (``gpu_targets``: compile-only devices through
JAX's CUDA plugin, no GPU or driver; ``batch_size`` is then the global batch): CLIP-B/16 at batch
256 with cuDNN attention, 20.0 GiB of temporaries. FLOPs are then XLA:CPU's count of the
unpartitioned program divided by the devices (work inside cuDNN's fused attention is not counted).
What a GPU's allocator adds (fragmentation, NCCL buffers) is not in it, and no number from a
target compile has been checked against a GPU's measured peak yet (issue 59).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vitmm.models import layers
from vitmm.train import determinism, distributed, gpu_targets, imported_vlm, inputs, optim, tasks, trainer
from vitmm.train.parallel import Parallel

MIB = 2**20


def _bytes_per_device(tree, shardings) -> int:
    """Bytes one device holds of ``tree`` (shapes) laid out by ``shardings``."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        shape = sharding.shard_shape(leaf.shape) if hasattr(sharding, "shard_shape") else leaf.shape
        total += int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


def plan(config, tokenizer=None, target: str | None = None, num_devices: int = 1) -> dict:
    """The compiled step's needs per device (bytes) and its FLOPs; see the module docstring.
    ``tokenizer``: instead of the run's (e.g. bytes in a vocabulary the size of an LM's whose
    tokenizer is not at hand: the memory table's). ``target``: compile for ``num_devices`` GPUs of
    that kind (``gpu_targets.CARDS``) instead of this machine's devices, with ``batch_size`` the
    global batch over them."""
    if not target:  # this machine's step, as the run would compile it (a target's flag is a compile option)
        determinism.set_flags(config)
    devices = gpu_targets.devices(target, num_devices) if target else None
    distributed.maybe_initialize(config)
    config = imported_vlm.from_imported_vlm(config)
    trainer.validate(config)
    if target and config.batch_size % num_devices:
        raise ValueError(f"batch_size={config.batch_size} does not split over dry_run_devices={num_devices}; "
                         f"use a multiple of {num_devices} (the global batch).")
    par = Parallel(config.parallel, fsdp=config.get("fsdp", False), tensor_parallel=config.get("tensor_parallel", 1),
                   devices=devices)
    if par.kind == "pmap":
        raise ValueError("--dry_run compiles the jit step over a mesh; set --config.parallel=jit.")
    with layers.compiling_for("gpu" if target else layers.platform()):
        return _compile(config, tokenizer, par, target)


def _compile(config, tokenizer, par: Parallel, target: str | None) -> dict:
    tokenizer = tokenizer or tasks.tokenizer_for(config)
    task = tasks.from_config(config, par, tokenizer)
    # also sets the task's host-side settings (e.g. num_visual); load=False: the model's shapes, no weights read
    params = jax.eval_shape(lambda: task.init_params(load=False))
    optim_cfg = config.optim.copy_and_resolve_references()
    with optim_cfg.unlocked():
        optim_cfg.total_steps = config.total_steps
    tx, lr_schedule = optim.make_optimizer(optim_cfg, params)
    state = dict(params=params, opt_state=jax.eval_shape(tx.init, params),
                 step=jax.ShapeDtypeStruct((), jnp.int32),
                 rng=jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
                 bad=jax.ShapeDtypeStruct((2,), jnp.int32))
    data = inputs.make(config, tokenizer, par, task)
    try:
        batch = next(data)
    finally:
        if hasattr(data, "close"):
            data.close()
    setup = trainer.Setup(par, tokenizer, task, tx, lr_schedule, state, config)
    shardings = par.state_sharding(state)
    lowered = setup.compile(state).lower(state, batch)
    # A GPU not here cannot time candidate kernels: no autotuning, matmuls as cuBLAS calls (XLA's Triton
    # GEMMs need a tiling chosen by timing); the buffers stay what the GPU's compile assigns (±0.1%, CLIP-B/16).
    compiled = lowered.compile({"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False,
                                **determinism.compile_options(config)} if target else None)
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if not cost:  # compiled for a machine not here: XLA:CPU's count of the program before partitioning
        cost = {"flops": _unpartitioned_flops(lowered) / par.num_devices}
    out = {
        "devices": par.num_devices,
        "parameters": _bytes_per_device(state["params"], shardings["params"]),
        "optimizer_state": _bytes_per_device(state["opt_state"], shardings["opt_state"]),
        "batch": sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
                     for x in jax.tree.leaves(batch) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))),
        "arguments": int(memory.argument_size_in_bytes),
        "temporaries": int(memory.temp_size_in_bytes),
        "outputs_not_aliased": int(memory.output_size_in_bytes - memory.alias_size_in_bytes),
        "code": int(memory.generated_code_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
        "backend": target or jax.default_backend(),
    }
    out["peak"] = out["arguments"] + out["temporaries"] + max(out["outputs_not_aliased"], 0)
    return out


def _unpartitioned_flops(lowered) -> float:
    """FLOPs of the whole (global) program as XLA's cost analysis counts them on this machine's CPU
    backend: JAX's public ``Lowered.cost_analysis`` asks the target's backend, which is not here."""
    from jax._src.lib import _jax

    module = lowered._lowering.hlo().as_hlo_module()
    return float(_jax.hlo_module_cost_analysis(jax.extend.backend.get_backend("cpu"), module).get("flops", 0.0))


def report(needs: dict) -> str:
    """``plan``'s numbers as the lines ``--dry_run`` prints."""
    mib = lambda k: f"{needs[k] / MIB:,.1f} MiB"  # noqa: E731
    backend = needs.get("backend")
    flops = f"{needs['flops'] / 1e9:,.2f} GFLOPs a step"
    lines = [f"per device ({needs['devices']} device{'s' * (needs['devices'] > 1)}): parameters {mib('parameters')}, "
             f"optimizer state {mib('optimizer_state')}, batch {mib('batch')}, temporaries {mib('temporaries')}, "
             f"outputs {mib('outputs_not_aliased')} beyond the donated state: {mib('peak')} at the step's peak"]
    if backend in gpu_targets.CARDS:
        lines.append(f"{flops} (XLA:CPU's count of the program before partitioning, per device); compiled for "
                     f"{backend} GPUs, none of them here")
    else:
        lines.append(f"{flops} (XLA's count of the compiled program, per device)")
    if backend == "cpu":
        lines.append("These are XLA:CPU's buffers: it computes bfloat16 matmuls in float32 and materialises attention "
                     "scores, so a GPU run's temporaries are smaller; --dry_run_target=h100 (or --dry_run on the GPU) "
                     "gives a GPU's.")
    return "\n".join(lines)
