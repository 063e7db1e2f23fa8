"""``--dry_run``'s memory against a real step's on the device, and against the same step compiled for
a named card from another machine (``--dry_run_target``, the memory table's way: results/memory/).

    python -m experiments.gpu.memory_check --config configs/clip_scenes.py:scale=b16 \\
        --set input.data_dir=DIR --out $OUT/memory_check.json              # on a GPU (issue 59)
    python -m experiments.gpu.memory_check --config configs/clip_scenes.py:smoke --out /tmp/m.json  # CPU check

On the device: ``dry_run.plan`` of the config (the device's own compile), then the step built
by ``trainer.build`` run twice on one batch, and the allocator's peak (``memory_stats()
["peak_bytes_in_use"]``, the first device's) minus what was in use before the first step: the
step's own temporaries and outputs, against the plan's ``temporaries + outputs``. The row of the
committed table with the same config (``--table_row``) is printed beside them. On a CPU there are
no allocator statistics: the measured side is absent and said so.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax

from experiments.gpu.loop_overhead import ROOT, load_config
from vitmm.train import dry_run, inputs, trainer


def measure(config) -> dict:
    """The plan's needs and, where the device has allocator statistics, the step's measured peak."""
    needs = dry_run.plan(config)
    setup = trainer.build(config)
    placed = setup.par.put_state(setup.state)
    data = inputs.make(config, setup.tokenizer, setup.par, setup.task)
    batch = next(data)
    data.close()
    step = setup.compile(placed)
    device = jax.local_devices()[0]
    before = (device.memory_stats() or {}).get("bytes_in_use")
    placed, _ = jax.block_until_ready(step(placed, batch))
    placed, _ = jax.block_until_ready(step(placed, batch))
    stats = device.memory_stats() or {}
    out = {"planned_step_bytes": needs["temporaries"] + needs["outputs_not_aliased"], "planned_peak": needs["peak"],
           "backend": jax.default_backend(), "device": device.device_kind}
    if before is None or "peak_bytes_in_use" not in stats:
        out["measured"] = "no allocator statistics on this backend"
    else:
        out["measured_step_bytes"] = stats["peak_bytes_in_use"] - before
        out["measured_over_planned"] = out["measured_step_bytes"] / max(out["planned_step_bytes"], 1)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE overrides")
    parser.add_argument("--table_row", default="CLIP ViT-B/16, 224 px", help="the committed table's row to print")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = measure(load_config(args.config, args.set, steps=2, log_every=1))
    rows = ROOT / "results/memory/rows.jsonl"
    if rows.exists():
        row = next((json.loads(line) for line in rows.open() if json.loads(line)["row"] == args.table_row), None)
        if row:
            result["table"] = {k: row[k] for k in ("backend", "temporaries", "outputs_not_aliased", "peak")}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
