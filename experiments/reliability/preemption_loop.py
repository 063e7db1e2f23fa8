"""Kill a training run again and again (SIGKILL and SIGTERM, at random moments), resume it each
time, and check that it ends exactly where an uninterrupted run ends.

    python -m experiments.reliability.preemption_loop                       # 40 steps, 6 interruptions
    python -m experiments.reliability.preemption_loop --steps 12 --kills 1  # what the tests run

Both runs are ``python -m vitmm.train --config configs/clip_scenes.py:smoke`` with
``total_steps``, ``checkpoint_every`` and ``log_every=1`` set. For each interruption the table
shows the signal, the last step logged before it, the step the resumed run started from, and
the steps lost (redone): SIGTERM saves the step it stops at (nothing lost beyond the step in
flight); SIGKILL loses the steps since the last finished periodic checkpoint. A SIGKILL is sent
only once a periodic checkpoint has finished (at or after its random step), so every resume
restores a checkpoint, its optimizer state and its data position: a kill before the first save
would only restart the run from step 0, which ends where the uninterrupted run ends whether or
not resuming works. At the end: whether every interruption resumed from a step > 0, whether every
parameter equals the uninterrupted run's and whether ``metrics.jsonl`` holds each step once with
the same losses. Writes ``preemption_loop.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def command(workdir, data_dir, steps: int, checkpoint_every: int) -> list[str]:
    return [sys.executable, "-m", "vitmm.train", "--config", "configs/clip_scenes.py:smoke", "--workdir",
            str(workdir), f"--config.input.data_dir={data_dir}", f"--config.total_steps={steps}",
            f"--config.checkpoint_every={checkpoint_every}", "--config.log_every=1", f"--config.eval_every={steps}"]


def logged_steps(workdir: pathlib.Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            steps.append(row["step"])
    return steps


def losses(workdir: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def finished_checkpoint(workdir: pathlib.Path) -> bool:
    """Whether a save has finished: orbax writes into ``<step>.orbax-checkpoint-tmp`` and renames it
    to ``<step>`` when done, and only the finished one can be resumed from."""
    folder = workdir / "checkpoints"
    return folder.is_dir() and any(p.is_dir() and p.name.isdigit() and int(p.name) > 0 for p in folder.iterdir())


def interrupt(cmd, workdir: pathlib.Path, sig: int, after_steps: int, timeout: float = 300) -> dict:
    """Runs ``cmd`` until ``after_steps`` more steps are logged, then sends ``sig``; a SIGKILL also
    waits for a finished checkpoint (SIGTERM saves one itself)."""
    before = max(logged_steps(workdir), default=0)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout

    def waiting() -> bool:
        if max(logged_steps(workdir), default=0) < before + after_steps:
            return True
        return sig == signal.SIGKILL and not finished_checkpoint(workdir)

    while proc.poll() is None and waiting():
        if time.time() > deadline:
            proc.kill()
            raise TimeoutError(f"{cmd} made no progress in {timeout} s")
        time.sleep(0.05)
    seen = max(logged_steps(workdir), default=0)
    if proc.poll() is None:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return {"signal": signal.Signals(sig).name, "returncode": proc.returncode, "last_logged": seen,
            "output": out + err}


def resumed_from(stdout_and_err: str) -> int | None:
    for line in stdout_and_err.splitlines():
        if line.startswith("Resumed from step "):
            return int(line.split()[3])
    return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint_every", type=int, default=5)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_dir", default=None, help="TFDS data_dir (default: a temporary one)")
    parser.add_argument("--out", default="results/reliability")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        data_dir = args.data_dir or str(tmp / "tfds")
        straight, killed = tmp / "straight", tmp / "killed"
        done = subprocess.run(command(straight, data_dir, args.steps, args.checkpoint_every), cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{done.stderr[-3000:]}")
        cmd = command(killed, data_dir, args.steps, args.checkpoint_every)
        rows = []
        for i in range(args.kills):
            sig = (signal.SIGKILL, signal.SIGTERM)[i % 2]
            remaining = args.steps - max(logged_steps(killed), default=0)
            if remaining <= 1:
                break
            row = interrupt(cmd, killed, sig, rng.randint(1, max(1, min(remaining - 1, 2 * args.checkpoint_every))))
            rows.append(row)
        final = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if final.returncode != 0:
            raise SystemExit(f"the last resume failed:\n{final.stderr[-3000:]}")
        # Where each resume started: the next run's "Resumed from step N" line.
        starts = [resumed_from(r["output"]) for r in rows[1:]] + [resumed_from(final.stdout + final.stderr)]
        for row, start in zip(rows, starts, strict=True):  # no "Resumed" line: the run started afresh
            row["resumed_from"] = start or 0
            row["lost"] = max(0, row["last_logged"] - (start or 0))
            del row["output"]
        import jax
        import numpy as np

        from vitmm import checkpoint as ckpt_lib

        a, b = ckpt_lib.load_params(straight), ckpt_lib.load_params(killed)
        equal = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
        logged = logged_steps(killed)
        once = logged == list(range(1, args.steps + 1))
        if not once:
            print(f"steps in metrics.jsonl: {logged}")
        same_losses = losses(straight) == losses(killed)
    # A run that restarted from 0 (or ended before its signal) equals the uninterrupted one trivially.
    resumed = bool(rows) and all(r["resumed_from"] > 0 and r["returncode"] != 0 for r in rows)
    result = {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "interruptions": rows,
              "every_interruption_resumed": resumed, "parameters_equal": equal, "each_step_logged_once": once,
              "losses_equal": same_losses}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{time.strftime('%Y-%m-%d')}: `python -m experiments.reliability.preemption_loop --steps {args.steps} "
             f"--checkpoint_every {args.checkpoint_every} --kills {args.kills} --seed {args.seed}` "
             f"({os.cpu_count()}-core CPU).", "",
             "| # | signal | exit code | last step logged | resumed from | steps redone |",
             "|---:|---|---:|---:|---:|---:|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['signal']} | {r['returncode']} | {r['last_logged']} | {r['resumed_from']} | "
                     f"{r['lost']} |")
    lines += ["", f"Every interruption stopped the run and resumed from a step > 0: **{resumed}**. "
              f"Final parameters equal to the uninterrupted run's, bit for bit: **{equal}**. "
              f"`metrics.jsonl` holds each step once: **{once}**, with the same losses: **{same_losses}**."]
    (out / "preemption_loop.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
