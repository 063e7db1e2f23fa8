"""Does a stopped and resumed run continue the run it stopped? Step by step, on this machine.

    python -m experiments.reliability.resume_check --config configs/clip_scenes.py:smoke --half 4 \
        --set input.data_dir=DIR
    XLA_FLAGS=--xla_gpu_deterministic_ops=true python -m experiments.reliability.resume_check ... --repeat   # on a GPU

Trains ``2 × --half`` steps straight, then the same config stopped after ``--half`` steps (with its
checkpoint) and resumed to the end, every step's loss logged. A resumed run can only be compared
exactly where the machine repeats itself: ``--repeat`` trains the straight run a second time, so
the report separates what the resume changes from what the machine's own nondeterminism does
(XLA's GPU reductions by atomics, autotuned kernels). Reported: the largest loss difference and
the first differing step before the stop (split vs straight: the same code path, so anything here
is nondeterminism) and after it (resumed vs straight), the same for the repeat, and each run's
parameter checksum. ``resume_exact`` also needs the stopped run to have logged steps 1..half and
the resumed one half + 1..2·half: a second run that silently starts over equals the straight run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

from experiments.gpu.loop_overhead import load_config, report  # noqa: E402
from vitmm.train import trainer  # noqa: E402


def losses(summary: dict) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in summary["history"]}


def compare(a: dict[int, float], b: dict[int, float], steps) -> dict:
    """Largest |a - b| over ``steps`` and the first step where they differ (None: equal)."""
    diffs = [(s, abs(a[s] - b[s])) for s in steps]
    first = next((s for s, d in diffs if d != 0), None)
    return {"max_loss_difference": float(max((d for _, d in diffs), default=0.0)), "first_differing_step": first}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="configs/X.py[:args]")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides (repeatable)")
    parser.add_argument("--half", type=int, default=30, help="steps before the stop (and after it)")
    parser.add_argument("--repeat", action="store_true", help="train the straight run twice")
    parser.add_argument("--out", default=None, help="a JSON file for the result")
    args = parser.parse_args(argv)
    half = args.half
    config = load_config(args.config, args.set, steps=2 * half, log_every=1)  # no evaluations; stop_at checkpoints
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        straight = trainer.train(config, tmp / "straight")
        split = trainer.train(config, tmp / "split", stop_at=half)
        resumed = trainer.train(config, tmp / "split")
        again = trainer.train(config, tmp / "again") if args.repeat else None
    a = losses(straight)
    if sorted(a) != list(range(1, 2 * half + 1)):
        raise SystemExit(f"The straight run logged steps {sorted(a)}, not 1..{2 * half}.")
    # The two halves stay apart: a second run that starts over from step 0 (no checkpoint found, or
    # one ignored) equals the straight run at every step, so merged it would look like an exact resume.
    before, after = range(1, half + 1), range(half + 1, 2 * half + 1)
    b_before, b_after = losses(split), losses(resumed)
    continues = sorted(b_before) == list(before) and sorted(b_after) == list(after)
    out = {"config": args.config, "set": args.set, "steps": 2 * half, "stopped_at": half,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "resumed_continues": continues, "resumed_from": min(b_after, default=1) - 1,
           "resumed_before_stop": compare(a, b_before, [s for s in before if s in b_before]),
           "resumed_after_stop": compare(a, b_after, [s for s in after if s in b_after]),
           "param_checksums": {"straight": straight["param_checksum"], "resumed": resumed["param_checksum"]}}
    if not continues:
        print(f"The stopped run logged steps {sorted(b_before)} (expected 1..{half}) and the resumed one "
              f"{sorted(b_after)} (expected {half + 1}..{2 * half}): it did not resume from step {half}.")
    if again is not None:
        out["repeat"] = compare(a, losses(again), range(1, 2 * half + 1))
        out["param_checksums"]["repeat"] = again["param_checksum"]
    out["resume_exact"] = continues and out["resumed_before_stop"]["first_differing_step"] is None and \
        out["resumed_after_stop"]["first_differing_step"] is None
    return report(out, args.out)


if __name__ == "__main__":
    main()
