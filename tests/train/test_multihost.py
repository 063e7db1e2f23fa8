"""Two processes on 127.0.0.1 (gloo CPU collectives), one device each, train as one: started with a
coordinator in the config, and as SLURM's ``srun`` starts them (found from its variables)."""

import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

WORKER = r"""
import json, os, sys
from vitmm import config_args
c = config_args.load(sys.argv[1], "smoke")
with c.unlocked():
    c.input.data_dir = sys.argv[3]
    for ev in c.evals.values():
        ev.data.data_dir = sys.argv[3]
    c.total_steps = 6
    c.log_every = c.checkpoint_every = 1
    c.keep_checkpoints = 6  # every step's parameters stay, to compare a resumed pair's with
    c.parallel = os.environ.get("VITMM_TEST_PARALLEL", c.parallel)
    if sys.argv[4] != "slurm":  # else no coordinator: the trainer finds the SLURM variables the test set
        c.multihost.coordinator = sys.argv[4]
        c.multihost.num_processes = 2
        c.multihost.process_id = int(sys.argv[5])
from vitmm.train import startup, trainer
import jax
if len(sys.argv) > 6 and int(sys.argv[5]) == int(sys.argv[6]):  # this process is sent SIGTERM at batch argv[8]
    sys.path.insert(0, sys.argv[7])
    import signalling
    signalling.send_at_batch(int(sys.argv[8]), "SIGTERM")
try:
    summary = trainer.train(c, sys.argv[2])
except trainer.Preempted as stop:
    print("PREEMPTED " + json.dumps(dict(process=jax.process_index(), step=stop.step)), flush=True)
    sys.exit(75)
except startup.REFUSALS as refused:
    print("REFUSED " + json.dumps(dict(process=jax.process_index(), message=str(refused))), flush=True)
    sys.exit(2)
print("RESULT " + json.dumps(dict(process=jax.process_index(), count=jax.process_count(),
      devices=jax.device_count(), losses=[h["loss"] for h in summary["history"]],
      checksum=summary["param_checksum"], evals=summary["evals"])), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_job_id() -> int:
    """A SLURM job id whose port (JAX: ``id % 4096 + 61440``) is free here."""
    for _ in range(100):
        job = random.randrange(10_000, 1_000_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", job % 4096 + 61440))
                return job
            except OSError:
                continue
    raise RuntimeError("no free port in 61440-65535")


def _own_core(i: int) -> list[str]:
    """The command prefix that runs process ``i`` on a core of its own (the suite pins each test worker
    to one: ``tests/conftest.py``; a ``preexec_fn`` would fork the multithreaded test process)."""
    cores = [c for c in os.environ.get("VITMM_TEST_CORES", "").split(",") if c]
    return ["taskset", "-c", cores[i % len(cores)]] if cores and shutil.which("taskset") else []


def _run_two(tmp_path, workdir, data_dir, signalled=None, expect=0, at_batch=3, slurm=False,
             parallel="jit") -> list[str]:
    """Both processes' stdout, after each exits with ``expect``; ``slurm``: no coordinator in the
    config, the processes started as ``srun -n 2`` starts them (its environment variables)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    coordinator = "slurm" if slurm else f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"{os.environ.get('VITMM_TEST_XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"
    env["PYTHONPATH"], env["VITMM_TEST_PARALLEL"] = str(ROOT), parallel
    job = _slurm_job_id() if slurm else None
    slurm_env = lambda i: {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",  # noqa: E731
                           "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)} if slurm else {}
    extra = [] if signalled is None else [str(signalled), str(pathlib.Path(__file__).resolve().parent), str(at_batch)]
    procs = [subprocess.Popen(
        [*_own_core(i), "timeout", "-s", "KILL", "240", sys.executable, str(script),
         str(ROOT / "configs/clip_scenes.py"), str(workdir), str(data_dir), coordinator, str(i), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, **slurm_env(i)}, cwd=ROOT)
        for i in range(2)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == expect, err[-3000:]
        outs.append(out)
    return outs


def _results(outs, tag="RESULT "):
    return [json.loads(next(line for line in out.splitlines() if line.startswith(tag))[len(tag):]) for out in outs]


def test_two_processes_train_as_one_and_stop_together_on_sigterm(tmp_path):
    data_dir = tmp_path / "tfds"
    from configs import common
    from vitmm.data import pipeline

    pipeline.get_source(common.SMOKE_DATA, "train", str(data_dir))  # build once, up front
    results = _results(_run_two(tmp_path, tmp_path / "workdir", data_dir))
    a, b = sorted(results, key=lambda r: r["process"])
    assert (a["count"], a["devices"], b["process"]) == (2, 2, 1)
    # One global batch, one loss, one set of parameters: every step and the end agree exactly.
    assert len(a["losses"]) == 6 and a["losses"] == b["losses"]
    assert a["checksum"] == pytest.approx(b["checksum"], rel=1e-7)
    assert a["evals"] == b["evals"]
    assert (tmp_path / "workdir" / "checkpoints" / "6").is_dir()
    lines = [json.loads(x) for x in (tmp_path / "workdir" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4, 5, 6]  # process 0 writes once

    # The pair again from its step-3 checkpoint, started as `srun -n 2` starts them (no coordinator in the
    # config: the trainer finds SLURM's variables), SIGTERM reaching process 1 only at its second batch:
    # both processes save step 5 and stop, and the resumed steps equal the uninterrupted ones, bit for bit.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "workdir", resumed)
    for step in (4, 5, 6):
        shutil.rmtree(resumed / "checkpoints" / str(step))
    stopped = _results(_run_two(tmp_path, resumed, data_dir, signalled=1, expect=75, at_batch=2, slurm=True),
                       "PREEMPTED ")
    assert sorted((r["process"], r["step"]) for r in stopped) == [(0, 5), (1, 5)]
    assert sorted(int(p.name) for p in (resumed / "checkpoints").iterdir()) == [1, 2, 3, 4, 5]
    lines = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    losses = {x["step"]: x["loss"] for x in lines if "loss" in x}
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4, 5]  # the redone steps logged once
    assert [losses[s] for s in (4, 5)] == a["losses"][3:5]
    import jax
    import numpy as np

    from vitmm import checkpoint as ckpt_lib

    mine, straight = ckpt_lib.load_params(resumed, 5), ckpt_lib.load_params(tmp_path / "workdir", 5)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(straight), strict=True))


# ~13 s: a third pair of processes; in make test, refuse_together's broadcast with the collective faked
# (test_an_unexpected_error_on_process_0_*) and a held workdir refused in one process (test_reliability)
@pytest.mark.slow
def test_a_workdir_process_0_refuses_stops_both_processes_at_once(tmp_path):
    """A workdir process 0 refuses (held by another run) stops both at once, each in one line, nothing written."""
    data_dir = tmp_path / "tfds"
    from configs import common
    from vitmm.data import pipeline
    from vitmm.train import workdir as workdir_lib

    pipeline.get_source(common.SMOKE_DATA, "train", str(data_dir))

    held = workdir_lib.Lock(tmp_path / "busy")
    (tmp_path / "busy").mkdir()
    held.acquire()
    try:
        refused = sorted(_results(_run_two(tmp_path, tmp_path / "busy", data_dir, expect=2), "REFUSED "),
                         key=lambda r: r["process"])
    finally:
        held.release()
    assert "is in use by pid" in refused[0]["message"] and "process 0 refused this run" in refused[1]["message"]
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == []


@pytest.mark.slow  # ~13 s: a fourth pair of processes; one process's pmap is in make test (test_trainer)
def test_two_processes_under_pmap_train_as_the_jit_pair(tmp_path):
    """Each process's replica is saved as one global array (orbax saves no process-local one), with
    the losses of the jit pair."""
    data_dir = tmp_path / "tfds"
    from configs import common
    from vitmm.data import pipeline

    pipeline.get_source(common.SMOKE_DATA, "train", str(data_dir))
    jit = _results(_run_two(tmp_path, tmp_path / "jit", data_dir))
    pmap = _results(_run_two(tmp_path, tmp_path / "pmap", data_dir, parallel="pmap"))
    assert pmap[0]["losses"] == pytest.approx(jit[0]["losses"], rel=1e-4) == pmap[1]["losses"]
    assert (tmp_path / "pmap" / "checkpoints" / "6").is_dir()


@pytest.mark.parametrize(("env", "found"), [
    ({}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node01", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, None),  # one task: a single process, nothing to join
    ({"OMPI_MCA_orte_hnp_uri": "1;tcp://10.0.0.1:4000", "OMPI_COMM_WORLD_SIZE": "4"}, "openmpi"),
    ({"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1"}, "tpu"),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "3"}, "env"),
])
def test_the_launcher_is_found_from_the_environment(monkeypatch, env, found):
    from vitmm.train import distributed

    for key in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS",
                "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed.launcher() == found


def test_an_unexpected_error_on_process_0_while_checking_the_workdir_stops_every_process(monkeypatch, tmp_path):
    """Process 0 checks the workdir alone; an error there that is not a refusal (say, a permission
    error reading its log) reaches the others through the same broadcast, which they would otherwise
    wait at until the coordination timeout. The broadcast faked: process 0 sends, the others receive."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from vitmm.train import startup

    sent = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: sent.append(int(x)) or np.int32(sent[0]))
    with pytest.raises(PermissionError, match="metrics.jsonl"):  # process 0: its own error, as it was
        startup.refuse_together(PermissionError("metrics.jsonl: permission denied"), tmp_path)
    with pytest.raises(startup.ProcessZeroFailed, match="process 0 failed while checking the workdir"):
        startup.refuse_together(None, tmp_path)  # another process: told to stop, not left waiting
    sent.clear()
    with pytest.raises(startup.HistoryWithoutCheckpoint):
        startup.refuse_together(startup.HistoryWithoutCheckpoint("earlier run"), tmp_path)
    with pytest.raises(startup.HistoryWithoutCheckpoint, match="process 0 refused this run"):
        startup.refuse_together(None, tmp_path)
    sent[:] = [0]
    startup.refuse_together(None, tmp_path)  # nothing refused: every process goes on
