"""One ``python -m vitmm.train`` run as a study's unit: started as its own process (so its peak
memory is its own), resumed from its checkpoint when it was stopped, and summarised from the
``metrics.jsonl`` and ``config.json`` it leaves."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
PREEMPTED = 75  # vitmm.train's exit code after a SIGTERM or SIGINT, its checkpoint saved


def train(config: str, workdir: pathlib.Path, args=(), name: str = "") -> tuple[dict, list[dict]]:
    """Trains ``config`` (``FILE:ARGS``) into ``workdir`` with the command-line ``args``; returns
    the run's summary (the connector, steps, batch, examples, wall seconds, peak memory of the
    process in GiB, the median training speed after the first two logs, the last training loss)
    and every line of its ``metrics.jsonl``. A failed run stops the study in one line. A SIGTERM to
    the study (``kill``) goes on to the run, which saves its step and exits (75): stopped together,
    they resume together, instead of the run training on alone in the workdir a rerun then finds locked."""
    cmd = [sys.executable, "-m", "vitmm.train", "--config", config, "--workdir", str(workdir), *args]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    forward = threading.current_thread() is threading.main_thread()  # (signal handlers live there only)
    previous = signal.signal(signal.SIGTERM, lambda signum, _: proc.send_signal(signum)) if forward else None
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # retried after the handler (PEP 475)
    finally:
        if forward:
            signal.signal(signal.SIGTERM, previous)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        how = "stopped (exit 75: its step saved)" if code == PREEMPTED else f"failed (exit {code})"
        raise SystemExit(f"{name or workdir.name} {how}; rerun to resume it.")
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "loss" in x]
    saved = json.loads((workdir / "config.json").read_text())
    speeds = [x["img_per_s"] for x in steps[2:] if "img_per_s" in x] or [x.get("img_per_s", 0) for x in steps]
    connector = saved["model"]["connector"]
    summary = dict(connector=f"{connector['name']}@{connector['budget']}", steps=saved["total_steps"],
                   batch=saved["batch_size"], examples=saved["total_steps"] * saved["batch_size"], wall_s=round(wall),
                   peak_rss_gib=round(usage.ru_maxrss / 2**20, 2), img_per_s=round(float(np.median(speeds)), 2),
                   final_loss=round(steps[-1]["loss"], 4))
    return summary, lines
