"""Starting a run of several processes (one per host or GPU): from the coordinator the config names,
or from what the launcher that started the processes left in their environment."""

from __future__ import annotations

import os

import jax


def launcher() -> str | None:
    """The launcher that started this process as one of several, from its environment: ``slurm``
    (``srun``: JAX's SLURM variables, more than one task), ``openmpi`` (``mpirun``), ``tpu`` (a
    Cloud TPU pod slice: several worker hosts) or ``env`` (``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, as a Kubernetes job or any launcher can);
    None for a single process."""
    env = os.environ
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                              "SLURM_LOCALID")) and int(env["SLURM_NTASKS"]) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    if "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return "tpu"
    if all(env.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")):
        return "env"
    return None


def maybe_initialize(config) -> None:
    """``jax.distributed.initialize``: with the coordinator ``config.multihost`` names, else, when a
    launcher started this process as one of several (``launcher``), with what JAX detects from it
    (or the ``JAX_*`` variables); a single process is left alone."""
    mh = config.get("multihost")
    if mh and mh.get("coordinator"):
        bind = {"coordinator_bind_address": mh.bind_address} if mh.get("bind_address") else {}  # else every interface
        jax.distributed.initialize(coordinator_address=mh.coordinator, num_processes=mh.num_processes,
                                   process_id=mh.process_id, **bind)
        return
    found = launcher()
    if found == "env":
        env = os.environ
        jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=int(env["JAX_NUM_PROCESSES"]), process_id=int(env["JAX_PROCESS_ID"]))
    elif found is not None:
        jax.distributed.initialize()  # JAX's own detection of the SLURM / Open MPI / Cloud TPU environment
