"""Lessons 000 and 002 on pooling, measured: CLS vs mean pooling vs attention pooling (MAP), and
whether a pretrained tower's pooled features separate the four shapes linearly.

    python -m experiments.lessons.pooling                          # results/lessons/pooling/
    python -m experiments.lessons.pooling --smoke --out /tmp/pool --tower WORKDIR

1. **Pooling.** Small ViTs (patch 8, sin-cos positions) trained from scratch with a CLS token
   (``pool="tok"``), mean pooling (``gap``) or a MAP head (``map``) on the single-shape
   ``medium`` scenes, two tasks: ``shape`` and ``region`` (see ``positions.py``).
2. **Linear probe.** The ``make demo`` CLIP image tower (``--tower``, default
   ``workdirs/clip_scenes``), frozen, and the same architecture untrained (random init): a
   softmax regression on its pooled features for the four-shape task (single-shape ``easy``
   scenes at the tower's resolution: circle, square, triangle, star), L2 strength chosen on a
   held-out fifth of the training features. Training accuracy near 100% means separable.

Writes ``cells.jsonl`` (finished cells; a rerun skips them), ``runs.csv``, ``pooling.md`` (mean ±
95% CI over seeds, paired tests) and ``setup.json`` to ``--out``.
"""

from __future__ import annotations

import pathlib
import time

import jax
import numpy as np

from experiments.lessons import common
from vitmm import checkpoint as ckpt_lib
from vitmm import xla_flags
from vitmm.data import scenes
from vitmm.models.vit import ViT
from vitmm.study import outputs, stats, store, verdicts

ROOT = pathlib.Path(__file__).resolve().parents[2]

POOLS = ("tok", "gap", "map")
TOWERS = ("pretrained", "untrained")
PRESETS = {
    "default": dict(difficulty="medium", res=64, train_images=8000, test_images=1000, epochs=3, batch_size=64,
                    lr=1e-3, probe_train=2000, probe_test=1000, probe_fit=1600, seeds="0,1,2", workers=2,
                    model=dict(width=64, depth=4, num_heads=4, mlp_dim=256, patch_size=8)),
    "smoke": dict(difficulty="medium", res=32, train_images=128, test_images=64, epochs=1, batch_size=32, lr=1e-3,
                  probe_train=96, probe_test=64, probe_fit=80, seeds="0,1", workers=2,
                  model=dict(width=32, depth=1, num_heads=2, mlp_dim=64, patch_size=8)),
}


def model_for(cfg: dict, pool: str, num_classes: int) -> ViT:
    return ViT(**cfg, posemb="sincos2d", pool=pool, class_token=pool == "tok", num_classes=num_classes)


def train_job(task: str, pool: str, arrays: dict, c: dict, progress) -> dict:
    return common.train_per_seed(model_for(c["model"], pool, c["num_classes"][task]), arrays["train"], arrays["test"],
                                 task, c, progress)


def probe_job(tower: str, arrays: dict, c: dict, progress) -> dict:
    model = ViT(**c["tower_cfg"])
    pooled = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
    train, test = arrays["probe_train"], arrays["probe_test"]
    out = {}
    for seed in c["seeds"]:
        if tower == "pretrained":
            params = c["tower_params"]
        else:
            params = jax.jit(model.init)(jax.random.key(seed), common.to_input(train["images"][:1]))["params"]

        def features(images, params=params):
            return np.concatenate([np.asarray(pooled(params, common.to_input(images[i:i + 250])))
                                   for i in range(0, len(images), 250)])

        order = np.random.default_rng(seed).permutation(len(train["images"]))  # which images fit, which choose L2
        x, y = features(train["images"])[order], train["shape"][order]
        out[seed] = common.linear_probe(x, y, features(test["images"]), test["shape"], c["num_shapes"],
                                        fit_size=c["probe_fit"])
        progress.update(1)
    return out


def run_job(key, arrays: dict, context: dict, progress) -> dict:
    if key[0] == "train":
        return train_job(key[1], key[2], arrays, context, progress)
    return probe_job(key[1], arrays, context, progress)


def main(argv=None) -> pathlib.Path:
    args, preset, seeds = common.parse_args(__doc__.splitlines()[0], "results/lessons/pooling", PRESETS, argv,
                                            extra=(("tower", str), ("epochs", int)))
    out = pathlib.Path(args.out)
    if args.report:
        return common.rewrite(out, "pooling", ('runs.csv',), to_markdown)
    out.mkdir(parents=True, exist_ok=True)
    tower_dir = pathlib.Path(preset.get("tower") or ROOT / "workdirs/clip_scenes")
    if not (tower_dir / "checkpoints").is_dir():
        raise SystemExit(f"No CLIP checkpoint in {tower_dir}: run `make demo` first, or pass --tower WORKDIR.")
    clip_config = ckpt_lib.load_config(tower_dir)
    tower_cfg, tower_res = clip_config["model"]["image"], clip_config["input"]["image_size"]

    t0 = time.perf_counter()
    train = common.single_shape_set(preset["difficulty"], preset["res"], "train", preset["train_images"])
    test = common.single_shape_set(preset["difficulty"], preset["res"], "test", preset["test_images"])
    probe_train = common.single_shape_set("easy", tower_res, "train", preset["probe_train"])
    probe_test = common.single_shape_set("easy", tower_res, "test", preset["probe_test"])
    num_classes = train.pop("num_classes")
    arrays = {"train": train, "test": test, "probe_train": probe_train, "probe_test": probe_test}
    for split in arrays.values():
        split.pop("num_classes", None)
    print(f"scenes made ({time.perf_counter() - t0:.0f} s)")

    context = dict(model=preset["model"], num_classes=num_classes, epochs=preset["epochs"],
                   batch_size=preset["batch_size"], lr=preset["lr"], seeds=seeds, tower_cfg=tower_cfg,
                   tower_params=jax.tree.map(np.asarray, ckpt_lib.load_params(tower_dir)["img"]),
                   num_shapes=len(scenes.DIFFICULTIES["easy"].shapes), probe_fit=preset["probe_fit"])
    store.check_tower(out, tower_dir, context["tower_params"])  # a tower retrained at the same path is refused
    settings = {k: v for k, v in context.items() if k != "tower_params"}
    settings.update(tower=str(tower_dir.resolve()), difficulty=preset["difficulty"], res=preset["res"],
                    sizes=[preset[k] for k in ("train_images", "test_images", "probe_train", "probe_test")])
    keys = [("train", task, pool) for task in common.TASKS for pool in POOLS] + [("probe", t) for t in TOWERS]
    t0 = time.perf_counter()
    done = common.run_cells(out, settings, keys, run_job, arrays, context, preset["workers"], "pooling", len(seeds))
    rows = [{"part": key[0], "task": key[1] if key[0] == "train" else "shape (easy)",
             "model": key[2] if key[0] == "train" else key[1], "seed": seed, **done[key][seed]}
            for key in keys for seed in seeds]
    shown = tower_dir.resolve()
    setup = {**{k: v for k, v in preset.items() if k not in ("seeds", "tower")}, "seeds": seeds,
             "tower": str(shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown), "tower_config": tower_cfg,
             "tower_res": tower_res, "num_classes": num_classes, "wall_s_this_sitting": round(time.perf_counter() - t0)}
    outputs.write_outputs(out, "pooling", setup, to_markdown(rows, setup), {"runs.csv": rows})
    groups = {task: {pool: _cell(rows, "train", task, pool) for pool in POOLS} for task in common.TASKS}
    groups["probe (4 shapes)"] = {f"{tower} tower": _cell(rows, "probe", "shape (easy)", tower) for tower in TOWERS}
    outputs.bar_plot({k: {b: {s: 100 * a for s, a in v.items()} for b, v in g.items()} for k, g in groups.items()},
                    "test accuracy (%)", out / "pooling.png", "pooling (trained from scratch) and the linear probe")
    return out


def _cell(rows, part, task, model, key="accuracy") -> dict:
    return {r["seed"]: r[key] for r in rows if r["part"] == part and r["task"] == task and r["model"] == model}


def to_markdown(rows: list[dict], setup: dict) -> str:
    names = {"tok": "CLS token", "gap": "mean pooling", "map": "MAP head"}
    lines = [f"**Pooling.** Test accuracy (%) of ViTs trained from scratch on single-shape `{setup['difficulty']}` "
             f"scenes at {setup['res']} px ({setup['train_images']} images, {setup['epochs']} epochs of "
             f"{setup['batch_size']}, model {setup['model']}, sin-cos positions; {setup['test_images']} test images); "
             f"mean ± 95% CI over {len(setup['seeds'])} seeds.", "",
             "| pooling | " + " | ".join(common.TASKS) + " |", "|---|" + "---:|" * len(common.TASKS)]
    for pool in POOLS:
        lines.append(f"| {names[pool]} (`{pool}`) | "
                     + " | ".join(outputs.mean_ci(_cell(rows, "train", t, pool)) for t in common.TASKS) + " |")
    lines += ["", "Paired by seed (points, p):", ""]
    tests = []
    for a, b in (("tok", "gap"), ("map", "gap"), ("tok", "map")):
        cells = []
        for task in common.TASKS:
            x, y = _cell(rows, "train", task, a), _cell(rows, "train", task, b)
            test = stats.paired(x, y)
            cells.append(f"{task} {100 * test[0]:+.1f} (p={test[1]:.2g})" if test else f"{task} –")
            tests.append(verdicts.paired(f"{task}: {names[a]} − {names[b]}", x, y))
        lines.append(f"- {names[a]} − {names[b]}: " + "; ".join(cells))
    lines += ["", f"**Linear probe** on the pooled features of `{setup['tower']}` (pool "
              f"`{setup['tower_config'].get('pool')}`, class token {setup['tower_config'].get('class_token', False)}) "
              f"and of the same tower untrained, for the four shapes of `easy` scenes at {setup['tower_res']} px "
              f"({setup['probe_fit']} of {setup['probe_train']} training images per seed, {setup['probe_test']} test "
              "images; untrained: a new random init per seed):", "",
              "| tower | train accuracy | test accuracy | L2 |", "|---|---:|---:|---:|"]
    for tower in TOWERS:
        l2 = sorted({r["l2"] for r in rows if r["part"] == "probe" and r["model"] == tower})
        lines.append(f"| {tower} | {outputs.mean_ci(_cell(rows, 'probe', 'shape (easy)', tower, 'train_accuracy'))} | "
                     f"{outputs.mean_ci(_cell(rows, 'probe', 'shape (easy)', tower))} | {', '.join(map(str, l2))} |")
    test = stats.paired(_cell(rows, "probe", "shape (easy)", "pretrained"),
                        _cell(rows, "probe", "shape (easy)", "untrained"))
    if test:
        lines += ["", f"Pretrained − untrained test accuracy: {100 * test[0]:+.1f} points (p={test[1]:.2g}, paired by "
                  "seed)."]
    tests.append(verdicts.paired("linear probe: pretrained − untrained tower", _cell(rows, "probe", "shape (easy)",
                                                                                  "pretrained"),
                                 _cell(rows, "probe", "shape (easy)", "untrained")))
    return "\n".join(lines + verdicts.section(tests, "The paired tests above (points).")) + "\n"


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
