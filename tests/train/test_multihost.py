"""Two processes on 127.0.0.1 (gloo CPU collectives), one device each, train as one."""

import json
import os
import pathlib
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
    if os.environ.get("NO_EVALS"):  # the preempted and resumed pairs: their losses and parameters are compared
        c.evals = {}
    c.total_steps = 6
    c.log_every = 1
    c.multihost.coordinator = sys.argv[4]
    c.multihost.num_processes = 2
    c.multihost.process_id = int(sys.argv[5])
from vitmm.train import trainer
import jax
if len(sys.argv) > 6 and int(sys.argv[5]) == int(sys.argv[6]):  # this process is sent SIGTERM at batch 3
    sys.path.insert(0, sys.argv[7])
    import signalling
    signalling.send_at_batch(trainer, 3, "SIGTERM")
try:
    summary = trainer.train(c, sys.argv[2])
except trainer.Preempted as stop:
    print("PREEMPTED " + json.dumps(dict(process=jax.process_index(), step=stop.step)), flush=True)
    sys.exit(75)
print("RESULT " + json.dumps(dict(process=jax.process_index(), count=jax.process_count(),
      devices=jax.device_count(), losses=[h["loss"] for h in summary["history"]],
      checksum=summary["param_checksum"], evals=summary["evals"])), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(tmp_path, workdir, data_dir, signalled=None, expect=0, evals=True) -> list[str]:
    """Both processes' stdout, after each exits with ``expect``."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"{os.environ.get('VITMM_TEST_XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"
    env["PYTHONPATH"] = str(ROOT)
    if not evals:
        env["NO_EVALS"] = "1"
    extra = [] if signalled is None else [str(signalled), str(pathlib.Path(__file__).resolve().parent)]
    procs = [subprocess.Popen(
        ["timeout", "-s", "KILL", "240", sys.executable, str(script), str(ROOT / "configs/clip_scenes.py"),
         str(workdir), str(data_dir), coordinator, str(i), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(2)]
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

    # SIGTERM reaches process 1 only: both processes save step 3 and stop; resumed, the pair
    # continues exactly as the uninterrupted pair did.
    stopped = _results(_run_two(tmp_path, tmp_path / "preempted", data_dir, signalled=1, expect=75, evals=False),
                       "PREEMPTED ")
    assert sorted((r["process"], r["step"]) for r in stopped) == [(0, 3), (1, 3)]
    assert sorted(p.name for p in (tmp_path / "preempted" / "checkpoints").iterdir()) == ["3"]
    resumed = sorted(_results(_run_two(tmp_path, tmp_path / "preempted", data_dir, evals=False)),
                     key=lambda r: r["process"])
    assert resumed[0]["losses"] == resumed[1]["losses"] == a["losses"][3:]
    assert resumed[0]["checksum"] == pytest.approx(a["checksum"], rel=1e-7)
