"""Lesson 000's positions, measured: learned vs fixed 2D sin-cos vs 2D RoPE vs none.

    python -m experiments.lessons.positions                          # results/lessons/positions/
    python -m experiments.lessons.positions --smoke --out /tmp/pos   # a minute; the tests run it

Small ViTs (patch 8, mean pooling) learn two tasks on single-shape scenes (``medium``: four
shapes on a 3×3 layout, noisy background) at one resolution: ``shape`` (which shape: needs no
positions) and ``region`` (which of the nine cells it sits in: needs them). Each model is then
tested at lower and higher resolutions, more or fewer patches of the same pixel size: the learned
table resampled to the new grid (bicubic, anti-aliased: ``ViT(dynamic_img_size=True)``), sin-cos
recomputed for it, RoPE as it is (its angles grow with the grid). Reported: the mean training
loss of the first epoch, test accuracy per resolution, accuracy on test images whose patches are
shuffled, and how far each encoder is from permutation-equivariance over patches
(``max |f(P x) − P f(x)| / max |f(x)|``, 0 up to float rounding without positions).

Writes ``cells.jsonl`` (each finished (task, positions) cell, all its seeds; a rerun skips
them), ``runs.csv``, ``positions.md`` (mean ± 95% CI over seeds, paired tests), ``positions.png``
and ``setup.json`` to ``--out``.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

from experiments.lessons import common
from vitmm import xla_flags
from vitmm.models.vit import ViT
from vitmm.study import outputs, stats, verdicts

ROOT = pathlib.Path(__file__).resolve().parents[2]

POSEMBS = ("learn", "sincos2d", "rope2d", "none")
PRESETS = {
    "default": dict(difficulty="medium", train_res=64, eval_res="32,48,64,96,128", train_images=8000,
                    test_images=1000, epochs=3, batch_size=64, lr=1e-3, seeds="0,1,2", workers=2,
                    model=dict(width=64, depth=4, num_heads=4, mlp_dim=256, patch_size=8)),
    "smoke": dict(difficulty="medium", train_res=32, eval_res="16,32,48", train_images=128, test_images=64,
                  epochs=1, batch_size=32, lr=1e-3, seeds="0,1", workers=2,
                  model=dict(width=32, depth=1, num_heads=2, mlp_dim=64, patch_size=8)),
}


def model_for(cfg: dict, posemb: str, num_classes: int) -> ViT:
    return ViT(**cfg, posemb=posemb, pool="gap", class_token=False, dynamic_img_size=posemb == "learn",
               num_classes=num_classes)


def shuffle_patches(images: np.ndarray, patch: int, perm: np.ndarray) -> np.ndarray:
    """Images with their patches moved: the patch at raster position ``perm[i]`` goes to ``i``."""
    b, h, w, c = images.shape
    gh, gw = h // patch, w // patch
    tiles = images.reshape(b, gh, patch, gw, patch, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, gh * gw, patch, patch, c)
    tiles = tiles[:, perm]
    return tiles.reshape(b, gh, gw, patch, patch, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


def equivariance_error(clf: common.Classifier, params: dict, images: np.ndarray, patch: int, seed: int) -> float:
    """``max |f(P x) − P f(x)| / max |f(x)|`` over the output patch tokens, one random P."""
    grid = images.shape[1] // patch
    perm = np.random.default_rng(seed).permutation(grid * grid)
    plain = np.asarray(clf.patch_tokens(params, common.to_input(images)))
    moved = np.asarray(clf.patch_tokens(params, common.to_input(shuffle_patches(images, patch, perm))))
    return float(np.abs(moved - plain[:, perm]).max() / np.abs(plain).max())


def run_job(key, arrays: dict, context: dict, progress) -> dict:
    """``{seed: result}`` for one (task, posemb): compiled once, trained per seed."""
    task, posemb = key
    c = context
    train = arrays[f"train{c['train_res']}"]
    steps = c["epochs"] * len(train["images"]) // c["batch_size"]
    clf = common.Classifier(model_for(c["model"], posemb, c["num_classes"][task]), steps, c["lr"],
                            train["images"].shape[1:])
    patch, per_epoch = c["model"]["patch_size"], len(train["images"]) // c["batch_size"]
    out = {}
    for seed in c["seeds"]:
        params, history = clf.train(train["images"], train[task], c["batch_size"], seed)
        result = {"first_epoch_loss": float(np.mean(history[:per_epoch])), "final_loss": float(np.mean(history[-10:])),
                  "steps": steps}
        for res in c["eval_res"]:
            test = arrays[f"test{res}"]
            result[f"acc_{res}"] = clf.accuracy(params, test["images"], test[task])
        test = arrays[f"test{c['train_res']}"]
        grid = c["train_res"] // patch
        perm = np.random.default_rng(1000 + seed).permutation(grid * grid)
        result["acc_shuffled"] = clf.accuracy(params, shuffle_patches(test["images"], patch, perm), test[task])
        result["equivariance_error"] = equivariance_error(clf, params, test["images"][:16], patch, seed)
        out[seed] = result
        progress.update(1)
    return out


def main(argv=None) -> pathlib.Path:
    args, preset, seeds = common.parse_args(__doc__.splitlines()[0], "results/lessons/positions", PRESETS, argv,
                                            extra=(("epochs", int), ("train_images", int)))
    eval_res = [int(r) for r in preset["eval_res"].split(",")]
    out = pathlib.Path(args.out)
    if args.report:
        return common.rewrite(out, "positions", ('runs.csv',), to_markdown)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    arrays, num_classes = {}, None
    train = common.single_shape_set(preset["difficulty"], preset["train_res"], "train", preset["train_images"])
    num_classes = train.pop("num_classes")
    arrays[f"train{preset['train_res']}"] = train
    for res in eval_res:
        test = common.single_shape_set(preset["difficulty"], res, "test", preset["test_images"])
        test.pop("num_classes")
        arrays[f"test{res}"] = test
    print(f"{preset['train_images']} training images at {preset['train_res']} px, {preset['test_images']} test images "
          f"at each of {eval_res} px ({time.perf_counter() - t0:.0f} s)")

    context = dict(model=preset["model"], num_classes=num_classes, train_res=preset["train_res"], eval_res=eval_res,
                   epochs=preset["epochs"], batch_size=preset["batch_size"], lr=preset["lr"], seeds=seeds)
    settings = {**context, "difficulty": preset["difficulty"], "train_images": preset["train_images"],
                "test_images": preset["test_images"]}
    keys = [(task, posemb) for task in common.TASKS for posemb in POSEMBS]
    t0 = time.perf_counter()
    done = common.run_cells(out, settings, keys, run_job, arrays, context, preset["workers"], "positions", len(seeds))
    rows = [{"task": task, "posemb": posemb, "seed": seed, **done[(task, posemb)][seed]}
            for task, posemb in keys for seed in seeds]
    setup = {**{k: v for k, v in preset.items() if k != "seeds"}, "seeds": seeds, "num_classes": num_classes,
             "wall_s_this_sitting": round(time.perf_counter() - t0)}
    outputs.write_outputs(out, "positions", setup, to_markdown(rows, setup), {"runs.csv": rows})
    plot(rows, setup, out / "positions.png")
    return out


def _cell(rows, task, posemb, key) -> dict:
    return {r["seed"]: r[key] for r in rows if r["task"] == task and r["posemb"] == posemb}


def to_markdown(rows: list[dict], setup: dict) -> str:
    res = [int(r) for r in setup["eval_res"].split(",")]
    train_res = setup["train_res"]
    lines = [f"Test accuracy (%) of ViTs trained at {train_res} px on single-shape `{setup['difficulty']}` scenes "
             f"({setup['train_images']} images, {setup['epochs']} epochs of {setup['batch_size']}, model "
             f"{setup['model']}, mean pooling), tested at each resolution ({setup['test_images']} images; grid = "
             f"px / {setup['model']['patch_size']}); mean ± 95% CI over {len(setup['seeds'])} seeds. Shuffled: the "
             f"test images at {train_res} px with their patches permuted. Equivariance error: "
             "max |f(Px) − Pf(x)| / max |f(x)| of the output patch tokens.", ""]
    tests = []
    for task in dict.fromkeys(r["task"] for r in rows):
        lines += [f"**Task `{task}`**", "",
                  "| positions | first-epoch loss | " + " | ".join(f"{r} px" + (" (train)" if r == train_res else "")
                                                          for r in res) + " | shuffled | equivariance error |",
                  "|---|---:|" + "---:|" * len(res) + "---:|---:|"]
        for posemb in POSEMBS:
            err = np.array(list(_cell(rows, task, posemb, "equivariance_error").values()))
            lines.append(f"| {posemb} | {outputs.mean_ci(_cell(rows, task, posemb, 'first_epoch_loss'), 1, 3)} | "
                         + " | ".join(outputs.mean_ci(_cell(rows, task, posemb, f"acc_{r}")) for r in res)
                         + f" | {outputs.mean_ci(_cell(rows, task, posemb, 'acc_shuffled'))} | {err.max():.1e} |")
        lines += ["", "Paired by seed (points, p):", ""]
        for a, b in (("learn", "sincos2d"), ("learn", "none"), ("sincos2d", "none"), ("rope2d", "sincos2d")):
            cells = []
            for r in res:
                x, y = _cell(rows, task, a, f"acc_{r}"), _cell(rows, task, b, f"acc_{r}")
                test = stats.paired(x, y)
                cells.append(f"{r} px {100 * test[0]:+.1f} (p={test[1]:.2g})" if test else f"{r} px –")
                tests.append(verdicts.paired(f"{task}: {a} − {b} at {r} px", x, y))
            lines.append(f"- {a} − {b}: " + "; ".join(cells))
        lines.append("")
    lines = lines[:-1] + verdicts.section(tests, "The paired tests above (points), both tasks.")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], setup: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [int(r) for r in setup["eval_res"].split(",")]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for posemb in POSEMBS:
            cells = [np.array(list(_cell(rows, task, posemb, f"acc_{r}").values())) for r in res]
            ax.errorbar(res, [100 * c.mean() for c in cells], yerr=[100 * np.nan_to_num(stats.ci95(c)) for c in cells],
                        marker="o", capsize=3, label=posemb)
        ax.axvline(setup["train_res"], color="grey", linestyle=":", label="training resolution")
        ax.set_xlabel("test resolution (px)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"task: {task}")
        ax.legend(fontsize=7)
    outputs.save_figure(fig, path)


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
