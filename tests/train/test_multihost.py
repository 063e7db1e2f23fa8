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
import json, sys
import importlib.util
spec = importlib.util.spec_from_file_location("cfg", sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
c = module.get_config("smoke")
with c.unlocked():
    c.input.data_dir = sys.argv[3]
    for ev in c.evals.values():
        ev.data.data_dir = sys.argv[3]
    c.total_steps = 6
    c.log_every = 1
    c.multihost.coordinator = sys.argv[4]
    c.multihost.num_processes = 2
    c.multihost.process_id = int(sys.argv[5])
from vitmm.train import trainer
import jax
summary = trainer.train(c, sys.argv[2])
print("RESULT " + json.dumps(dict(process=jax.process_index(), count=jax.process_count(),
      devices=jax.device_count(), losses=[h["loss"] for h in summary["history"]],
      checksum=summary["param_checksum"], evals=summary["evals"])), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_as_one(tmp_path):
    data_dir = tmp_path / "tfds"
    from configs import common
    from vitmm.data import pipeline

    pipeline.get_source(common.SMOKE_DATA, "train", str(data_dir))  # build once, up front
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"{os.environ.get('VITMM_TEST_XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen(
        ["timeout", "-s", "KILL", "240", sys.executable, str(script), str(ROOT / "configs/clip_scenes.py"),
         str(tmp_path / "workdir"), str(data_dir), coordinator, str(i)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    a, b = sorted(results, key=lambda r: r["process"])
    assert (a["count"], a["devices"], b["process"]) == (2, 2, 1)
    # One global batch, one loss, one set of parameters: every step and the end agree exactly.
    assert len(a["losses"]) == 6 and a["losses"] == b["losses"]
    assert a["checksum"] == pytest.approx(b["checksum"], rel=1e-7)
    assert a["evals"] == b["evals"]
    assert (tmp_path / "workdir" / "checkpoints" / "6").is_dir()
    lines = [json.loads(x) for x in (tmp_path / "workdir" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4, 5, 6]  # process 0 writes once
