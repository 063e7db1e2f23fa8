"""How close ``python -m vitmm.train``'s loop runs to its bare compiled step.

    python -m experiments.gpu.loop_overhead --config configs/clip_scenes.py:smoke --steps 60
    python -m experiments.gpu.loop_overhead --config configs/clip_scenes.py:scale=b16 --steps 300 \\
        --set input.data_dir=DIR --out $OUT/loop_overhead.json         # on a GPU (issue 27's target: ≥ 0.95)

The loop: ``trainer.train`` in a fresh temporary workdir for ``--steps`` steps (evaluation off,
one checkpoint at the end), logging every ``--log_every`` steps; its steady-state speed is the
median of the logged img/s after the first ``--skip`` intervals (compilation), with their range.
The bare step: the same compiled step (``trainer.build``: the same task, optimizer and
parallelism) run back to back ``--steps`` times on one batch of the same input already on the
devices, blocking only at the end. Their ratio is what the input pipeline, host syncs and
logging cost; the loop's batches come from ``input.num_threads`` reader threads and ``prefetch``
host / ``device_prefetch`` device batches ahead.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import tempfile

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

from vitmm import config_args  # noqa: E402
from vitmm.train import inputs, profiling, trainer  # noqa: E402


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def load_config(spec: str, sets: list[str], steps: int, log_every: int):
    path, _, arg = spec.partition(":")
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in sets)}
    config = config_args.load(ROOT / path if not pathlib.Path(path).is_absolute() else path, arg or None, **overrides)
    with config.unlocked():
        config.total_steps, config.log_every = steps, log_every
        config.optim.warmup_steps = min(config.optim.warmup_steps, steps - 1)  # a timing: any schedule the run allows
        config.checkpoint_every, config.eval_every = steps, steps
        config.evals = type(config.evals)()  # nothing evaluated: the loop's own cost only
    return config


def loop_speed(config, skip: int) -> dict:
    """The trainer's logged img/s after the first ``skip`` intervals: median and range."""
    with tempfile.TemporaryDirectory() as workdir:
        summary = trainer.train(config, workdir)
    speeds = [h.get("img_per_s") for h in summary["history"]][skip:]
    speeds = [x for x in speeds if x is not None]  # a row whose interval held only the compiling step has none
    return {"img_per_s": float(np.median(speeds)), "range": [float(min(speeds)), float(max(speeds))],
            "intervals": len(speeds)}


def bare_speed(config, steps: int, repeats: int = 3) -> dict:
    """The compiled step alone on one device-resident batch: ``steps`` steps back to back, the
    median over ``repeats`` of img/s."""
    setup = trainer.build(config)
    one = config.copy_and_resolve_references()
    with one.unlocked():
        one.input.workers = 0  # one batch of the same shapes: no reader processes started for it
    data = inputs.make(one, setup.tokenizer, setup.par, setup.task)
    batch = next(data)
    data.close()
    state = setup.par.put_state(setup.state)
    times, _ = profiling.time_step(setup.compile(state), state, batch, steps, repeats)
    speeds = [config.batch_size / t for t in times]
    return {"img_per_s": float(np.median(speeds)), "range": [float(min(speeds)), float(max(speeds))]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="configs/X.py[:args]")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides (repeatable)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="logged intervals left out (compilation, warm-up)")
    parser.add_argument("--bare_steps", type=int, default=None, help="steps per bare timing (default --steps / 3)")
    parser.add_argument("--bare_only", action="store_true", help="time the bare step alone (no loop, no ratio)")
    parser.add_argument("--out", default=None, help="a JSON file for the result")
    args = parser.parse_args(argv)
    if not args.bare_only and args.steps // args.log_every <= args.skip:
        raise SystemExit(f"--steps {args.steps} / --log_every {args.log_every} logs too few intervals to leave out "
                         f"--skip {args.skip}; run more steps.")
    config = load_config(args.config, args.set, args.steps, args.log_every)
    result = {"config": args.config, "set": args.set, "batch_size": config.batch_size, "steps": args.steps,
              "devices": [str(d) for d in jax.devices()], "jax": jax.__version__, "loop": None, "bare": None,
              "ratio": None}
    if not args.bare_only:  # written at once: a run cut off in the bare timing keeps the loop's speed
        result["loop"] = loop_speed(config, args.skip)
        report(result, args.out)
    result["bare"] = bare_speed(config, args.bare_steps or max(args.steps // 3, 1))
    result["ratio"] = result["loop"] and result["loop"]["img_per_s"] / result["bare"]["img_per_s"]
    return report(result, args.out)


def report(result: dict, out: str | None) -> dict:
    """Prints ``result`` as JSON and writes it to ``out`` when given (resume_check.py's too)."""
    print(json.dumps(result, indent=1))
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
