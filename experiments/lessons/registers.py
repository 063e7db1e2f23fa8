"""Registers (Darcet et al. 2024, "Vision Transformers Need Registers"), measured at this scale.

    python -m experiments.lessons.registers                          # results/lessons/registers/
    python -m experiments.lessons.registers --smoke --out /tmp/reg   # the tests run it

Small ViTs with a CLS token (``pool="tok"``, sin-cos positions) and 0, 1, 4 or 8 registers,
trained from scratch on the single-shape ``medium`` scenes' shape task. The paper's artefact:
large, long-trained ViTs without registers turn a few background patch tokens into high-norm
tokens that the CLS token attends to (the attention maps go spiky, its entropy falls); registers
give that computation a place of its own. Measured per model on test images: the norms of the
last block's patch outputs (before the final norm) — the share of high-norm outliers (above 2× the
image's median) and the largest / median ratio —, the CLS token's attention entropy in the last
block (nats, over every key, and as a share of the uniform entropy, which grows with the key
count), the attention mass it puts on registers, and accuracy.

Writes ``cells.jsonl``, ``runs.csv``, ``registers.md`` (mean ± 95% CI over seeds, paired tests
against 0 registers), ``norms.png`` (the patch-norm histograms) and ``setup.json`` to ``--out``.
"""

from __future__ import annotations

import pathlib
import time

import jax
import numpy as np

from experiments.lessons import common
from vitmm import xla_flags
from vitmm.models.vit import ViT
from vitmm.study import outputs, stats, verdicts

ROOT = pathlib.Path(__file__).resolve().parents[2]

REGISTERS = (0, 1, 4, 8)
PRESETS = {
    "default": dict(difficulty="medium", res=64, train_images=8000, test_images=1000, probe_images=256, epochs=3,
                    batch_size=64, lr=1e-3, seeds="0,1,2", workers=2,
                    model=dict(width=64, depth=4, num_heads=4, mlp_dim=256, patch_size=8)),
    "smoke": dict(difficulty="medium", res=32, train_images=128, test_images=64, probe_images=16, epochs=1,
                  batch_size=32, lr=1e-3, seeds="0,1", workers=2,
                  model=dict(width=32, depth=2, num_heads=2, mlp_dim=64, patch_size=8)),
}


def model_for(cfg: dict, registers: int, num_classes: int) -> ViT:
    return ViT(**cfg, posemb="sincos2d", pool="tok", class_token=True, num_registers=registers,
               num_classes=num_classes)


def measure(model: ViT, params: dict, images: np.ndarray) -> tuple[dict, np.ndarray]:
    """``(statistics, every patch norm / its image's median)`` for ``images``."""
    registers, last = model.num_registers, f"block_{model.arch().depth - 1:02d}"
    (_, out), state = jax.jit(lambda p, x: model.apply({"params": p}, x, mutable=["intermediates"]))(
        params, common.to_input(images))
    patches = np.asarray(out[last])[:, 1 + registers:]  # [B, N, D]: after CLS and registers
    norms = np.linalg.norm(patches, axis=-1)
    ratio = norms / np.median(norms, axis=1, keepdims=True)
    (probs,) = state["intermediates"]["encoder"][last]["attn"]["attention"]
    cls = np.asarray(probs)[:, :, 0, :]  # [B, heads, S]: the CLS query's weights over every key
    entropy = -(cls * np.log(np.clip(cls, 1e-12, None))).sum(-1)
    return {"outlier_share": float((ratio > 2).mean()), "max_over_median": float(ratio.max(axis=1).mean()),
            "cls_entropy": float(entropy.mean()), "cls_entropy_uniform": float(np.log(cls.shape[-1])),
            "cls_entropy_norm": float(entropy.mean() / np.log(cls.shape[-1])),
            "register_mass": float(cls[..., 1:1 + registers].sum(-1).mean())}, ratio.ravel()


def run_job(key, arrays: dict, context: dict, progress) -> dict:
    """``{seed: result}`` for one register count: compiled once, trained per seed."""
    (registers,), c = key, context
    train, test = arrays["train"], arrays["test"]
    steps = c["epochs"] * len(train["images"]) // c["batch_size"]
    model = model_for(c["model"], registers, c["num_classes"])
    clf = common.Classifier(model, steps, c["lr"], train["images"].shape[1:])
    out = {}
    for seed in c["seeds"]:
        params, history = clf.train(train["images"], train["shape"], c["batch_size"], seed)
        stats, ratio = measure(model, params, test["images"][: c["probe_images"]])
        hist, _ = np.histogram(ratio, bins=HIST_BINS)
        out[seed] = {"accuracy": clf.accuracy(params, test["images"], test["shape"]),
                     "final_loss": float(np.mean(history[-10:])), **stats, "norm_hist": hist.tolist()}
        progress.update(1)
    return out


HIST_BINS = np.linspace(0, 4, 41)  # patch norm / the image's median


def main(argv=None) -> pathlib.Path:
    args, preset, seeds = common.parse_args(__doc__.splitlines()[0], "results/lessons/registers", PRESETS, argv,
                                            extra=(("epochs", int),))
    out = pathlib.Path(args.out)
    if args.report:
        return common.rewrite(out, "registers", ('runs.csv',), to_markdown)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train = common.single_shape_set(preset["difficulty"], preset["res"], "train", preset["train_images"])
    test = common.single_shape_set(preset["difficulty"], preset["res"], "test", preset["test_images"])
    num_classes = train.pop("num_classes")["shape"]
    test.pop("num_classes")
    print(f"scenes made ({time.perf_counter() - t0:.0f} s)")
    context = dict(model=preset["model"], num_classes=num_classes, epochs=preset["epochs"],
                   batch_size=preset["batch_size"], lr=preset["lr"], seeds=seeds, probe_images=preset["probe_images"])
    settings = {**context, "difficulty": preset["difficulty"], "res": preset["res"],
                "sizes": [preset["train_images"], preset["test_images"]]}
    keys = [(r,) for r in REGISTERS]
    t0 = time.perf_counter()
    done = common.run_cells(out, settings, keys, run_job, {"train": train, "test": test}, context, preset["workers"],
                            "registers", len(seeds))
    rows = [{"registers": r, "seed": seed, **{k: v for k, v in done[(r,)][seed].items() if k != "norm_hist"}}
            for (r,) in keys for seed in seeds]
    setup = {**{k: v for k, v in preset.items() if k != "seeds"}, "seeds": seeds, "num_classes": num_classes,
             "wall_s_this_sitting": round(time.perf_counter() - t0)}
    outputs.write_outputs(out, "registers", setup, to_markdown(rows, setup), {"runs.csv": rows})
    plot({r: np.sum([done[(r,)][s]["norm_hist"] for s in seeds], axis=0) for (r,) in keys}, out / "norms.png")
    return out


def to_markdown(rows: list[dict], setup: dict) -> str:
    def cell(r, key):
        return {row["seed"]: row[key] for row in rows if row["registers"] == r}

    lines = [f"ViTs with a CLS token and registers trained on single-shape `{setup['difficulty']}` scenes at "
             f"{setup['res']} px (shape task; {setup['train_images']} images, {setup['epochs']} epochs of "
             f"{setup['batch_size']}, model {setup['model']}); statistics on {setup['probe_images']} test images, "
             f"accuracy on {setup['test_images']}; mean ± 95% CI over {len(setup['seeds'])} seeds. Outliers: patch "
             "outputs of the last block whose norm exceeds 2× their image's median; CLS entropy: of its attention "
             "weights over every key in the last block (uniform: the log of the key count).", "",
             "| registers | accuracy (%) | outlier share (%) | max / median norm | CLS entropy (nats) | uniform | "
             "entropy / uniform | mass on registers (%) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in REGISTERS:
        uniform = np.mean(list(cell(r, "cls_entropy_uniform").values()))
        lines.append(f"| {r} | {outputs.mean_ci(cell(r, 'accuracy'))} | "
                     f"{outputs.mean_ci(cell(r, 'outlier_share'), 100, 2)} | "
                     f"{outputs.mean_ci(cell(r, 'max_over_median'), 1, 2)} | "
                     f"{outputs.mean_ci(cell(r, 'cls_entropy'), 1, 3)} | {uniform:.3f} | "
                     f"{outputs.mean_ci(cell(r, 'cls_entropy_norm'), 1, 3)} | "
                     f"{outputs.mean_ci(cell(r, 'register_mass'))} |")
    lines += ["", "Against 0 registers, paired by seed (difference, p):", ""]
    tests = []
    for r in REGISTERS[1:]:
        parts = []
        for key, scale, name, digits in (("accuracy", 100, "accuracy", 1), ("outlier_share", 100, "outlier share", 3),
                                         ("cls_entropy_norm", 1, "CLS entropy / uniform", 3)):
            test = stats.paired(cell(r, key), cell(0, key))
            parts.append(f"{name} {scale * test[0]:+.3g} (p={test[1]:.2g})" if test else f"{name} –")
            tests.append(verdicts.paired(f"{r} − 0 registers: {name}", cell(r, key), cell(0, key), scale,
                                         digits=digits))
        lines.append(f"- {r} registers: " + "; ".join(parts))
    what = "The paired tests above (accuracy and outlier share in points; the entropy ratio as a ratio)."
    return "\n".join(lines + verdicts.section(tests, what)) + "\n"


def plot(hists: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    centres = (HIST_BINS[1:] + HIST_BINS[:-1]) / 2
    for r, hist in hists.items():
        ax.plot(centres, np.maximum(np.asarray(hist) / max(np.sum(hist), 1), 1e-6), label=f"{r} registers")
    ax.set_yscale("log")
    ax.axvline(2, color="grey", linestyle=":", label="outlier threshold")
    ax.set_xlabel("patch-output norm / the image's median (last block)")
    ax.set_ylabel("share of patch tokens")
    ax.legend(fontsize=7)
    outputs.save_figure(fig, path)


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
