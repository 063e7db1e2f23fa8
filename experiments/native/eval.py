"""CLIP towers evaluated on 64-px squares and at the images' own sizes (NaFlex + packing).

    python -m experiments.native.eval   # the demo's tower and configs/clip_scenes_native.py's
    python -m experiments.native.eval --workdirs w1,w2 --out /tmp/ne --num_examples 200

Each ``python -m vitmm.train`` CLIP workdir is scored by the evaluators of
``configs/clip_scenes_native.py``: zero-shot shape accuracy, image↔text retrieval and the
validation loss, once on ``scenes/easy_64`` validation squares (the demo's evaluation) and once
on validation scenes drawn at random sizes and aspect ratios (``*_native``: longer side 32–128 px,
aspect ≤ 3), each image resized by NaFlex to the 64-patch budget and packed with others into rows.
A tower trained on squares and one trained at native sizes are then compared on both. Writes
``native_eval.md`` and ``native_eval.csv`` to ``--out`` (default ``results/native/``).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import jax
import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm import xla_flags
from vitmm.data import tokenizer as tok_lib
from vitmm.models import two_towers
from vitmm.study import outputs
from vitmm.train import evaluators as eval_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]

METRICS = (("zeroshot", "accuracy", "zero-shot"), ("retrieval", "i2t_r1", "i→t R@1"),
           ("retrieval", "t2i_r1", "t→i R@1"), ("val", "loss", "val loss"))


def evaluate(workdir: pathlib.Path, num_examples: int | None, data_dir=None, smoke: bool = False) -> dict:
    """``{"evaluator/metric": value}`` of the workdir's last checkpoint under every evaluator of
    ``configs/clip_scenes_native.py`` (``num_examples`` each, when given)."""
    from configs import clip_scenes_native

    config = ckpt_lib.load_config(workdir)
    model = two_towers.TwoTowers(**config["model"])
    params = ckpt_lib.load_params(workdir)
    evals = {}
    for name, cfg in clip_scenes_native.get_config("smoke" if smoke else None).evals.to_dict().items():
        cfg["data"] = {**cfg["data"], "data_dir": data_dir}
        if num_examples:
            cfg["num_examples"] = num_examples
            if cfg["type"] == "val_loss":
                cfg["batch_size"] = min(cfg["batch_size"], num_examples)
        evals[name] = cfg
    evaluators = eval_lib.from_config(evals, model, config["model"]["text"]["max_len"],
                                      tok_lib.get_tokenizer(config.get("tokenizer")), config["loss"],
                                      config["input"]["image_size"])
    aux = {"t": float(np.exp(params["t"][0])), "b": float(params["b"][0]) if "b" in params else 0.0}
    out = {}
    for name, evaluator in evaluators.items():
        out.update({f"{name}/{k}": v for k, v in evaluator.run(params, **aux).items()})
    return out


def to_markdown(rows: list[dict], setup: dict) -> str:
    lines = ["# CLIP towers on squares and at the images' own sizes", "",
             f"`{setup['command']}` ({setup['date']}, {setup['backend']}); {setup['num_examples'] or 1000} validation "
             "images per evaluation. *squares*: `scenes/easy_64` validation at 64 px (the demo's evaluation); "
             "*native*: validation scenes at random sizes (longer side 32–128 px, aspect ≤ 3), NaFlex to 64 "
             f"patches of 8 px, packed. Chance: zero-shot 0.25, R@1 {rows[0]['retrieval/chance_r1']:.3f} (squares), "
             f"{rows[0]['retrieval_native/chance_r1']:.3f} (native).", "",
             "| tower (workdir) | trained on | " + " | ".join(f"{label} {where}" for _, _, label in METRICS
                                                    for where in ("squares", "native")) + " |",
             "|---|---|" + "---:|" * (2 * len(METRICS))]
    for r in rows:
        cells = [f"{r[f'{ev}{suffix}/{m}']:.3f}" for ev, m, _ in METRICS for suffix in ("", "_native")]
        lines.append(f"| `{r['workdir']}` | {r['trained_on']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdirs", default="workdirs/clip_scenes,workdirs/clip_native",
                        help="comma-separated CLIP workdirs (python -m vitmm.train)")
    parser.add_argument("--out", default=str(ROOT / "results/native"))
    parser.add_argument("--num_examples", type=int, default=None, help="images per evaluation (default 1000)")
    parser.add_argument("--data_dir", default=None, help="TFDS data_dir (default ~/tensorflow_datasets)")
    parser.add_argument("--smoke", action="store_true", help="the smoke config's evaluators (small data; the tests)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for workdir in (pathlib.Path(w) for w in args.workdirs.split(",")):
        if not (workdir / "checkpoints").is_dir():
            parser.error(f"{workdir} holds no checkpoints: train it first (python -m vitmm.train --config "
                         "configs/clip_scenes.py or configs/clip_scenes_native.py --workdir ...).")
        t0 = time.perf_counter()
        metrics = evaluate(workdir, args.num_examples, args.data_dir, args.smoke)
        packed = bool(ckpt_lib.load_config(workdir)["input"].get("packing"))
        shown = workdir.resolve().relative_to(ROOT) if workdir.resolve().is_relative_to(ROOT) else workdir
        rows.append({"workdir": str(shown), "trained_on": "own sizes (NaFlex, packed)" if packed else "64-px squares",
                     **{k: v for k, v in metrics.items() if not math.isnan(v)}})
        print(f"{workdir}: {time.perf_counter() - t0:.0f} s")
    setup = {"workdirs": args.workdirs, "num_examples": args.num_examples}
    shown = {**setup, "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"),
             "command": " ".join(["python -m experiments.native.eval", *(sys.argv[1:] if argv is None else argv)])}
    (out / "native_eval.md").write_text(to_markdown(rows, shown))
    outputs.write_rows(rows, out / "native_eval.csv")
    print((out / "native_eval.md").read_text())
    return out


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()
    from experiments.common import entry

    entry.quiet()  # the libraries' routine warnings off the console; --verbose keeps them
    main()
