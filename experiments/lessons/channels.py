"""Lesson 003's options for inputs that are not RGB, measured: 1- and 8-channel scenes through a
linear patch embedding of that many channels, a convolutional stem, or a learned 1×1 projection
to 3 channels in front of the RGB model.

    python -m experiments.lessons.channels                          # results/lessons/channels/
    python -m experiments.lessons.channels --smoke --out /tmp/ch    # the tests run it

Inputs, made from the single-shape ``medium`` scenes (task: the shape's colour, which needs the
channels): ``1`` channel, the luminance (0.299 R + 0.587 G + 0.114 B); ``8`` channels, a
multispectral-like stack: 8 fixed positive mixtures of R, G and B (one seeded matrix, rows
normalised) with independent noise per band (σ = 6 of 255); ``3``, the RGB images themselves
(the reference). Stems: ``linear`` (``PatchEmbed`` over C channels: C·P² inputs per patch),
``conv`` (``ViT(stem="conv")``: stride-2 3×3 convolutions, Xiao et al.) and ``proj3`` (a learned
1×1 convolution C → 3, then the RGB ViT: the lesson's "channel projection"). Reported: accuracy
(mean ± 95% CI over seeds), parameters, XLA forward FLOPs and measured training-step time (in
turns, median and range).

Writes ``cells.jsonl``, ``runs.csv``, ``cost.csv``, ``channels.md`` and ``setup.json`` to ``--out``.
"""

from __future__ import annotations

import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.lessons import common
from vitmm import tree, xla_flags
from vitmm.models import common as model_common
from vitmm.models.vit import ViT
from vitmm.study import outputs, stats, verdicts

ROOT = pathlib.Path(__file__).resolve().parents[2]

STEMS = ("linear", "conv", "proj3")
CONFIGS = [(3, "linear")] + [(c, s) for c in (1, 8) for s in STEMS]
PRESETS = {
    "default": dict(difficulty="medium", res=64, train_images=8000, test_images=1000, epochs=3, batch_size=64,
                    lr=1e-3, seeds="0,1,2", workers=2, timing_batch=64, repeats=3,
                    model=dict(width=64, depth=4, num_heads=4, mlp_dim=256, patch_size=8)),
    "smoke": dict(difficulty="medium", res=32, train_images=64, test_images=32, epochs=1, batch_size=32, lr=1e-3,
                  seeds="0,1", workers=2, timing_batch=4, repeats=1,
                  model=dict(width=32, depth=1, num_heads=2, mlp_dim=64, patch_size=8)),
}


def to_channels(images: np.ndarray, channels: int, seed: int = 0) -> np.ndarray:
    """uint8 RGB ``[..., 3]`` as 1 (luminance), 3 (itself) or 8 (mixed, noisy) uint8 channels.
    The 8 bands' mixture is one fixed matrix (the same sensor for every split); ``seed`` draws
    only the noise."""
    x = images.astype(np.float32)
    if channels == 3:
        return images
    if channels == 1:
        out = x @ np.array([0.299, 0.587, 0.114], np.float32)[:, None]
    elif channels == 8:
        mix = np.random.default_rng(0).uniform(0.0, 1.0, (3, 8)).astype(np.float32)
        mix /= mix.sum(0, keepdims=True)  # each band a weighted mean of R, G, B
        noise = np.random.default_rng(1 + seed).normal(0.0, 6.0, (*x.shape[:-1], 8)).astype(np.float32)
        out = x @ mix + noise
    else:
        raise ValueError(f"channels must be 1, 3 or 8, got {channels}.")
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


class ProjectThenViT(nn.Module):
    """A learned 1×1 convolution from C channels to 3 (a Dense over the channel axis), then the
    RGB ViT."""

    vit: dict

    @nn.compact
    def __call__(self, images, train: bool = False):
        rgb = nn.Dense(3, name="channel_proj")(images)
        return ViT(**self.vit, name="vit")(rgb, train=train)


def model_for(cfg: dict, stem: str, num_classes: int):
    vit = dict(cfg, posemb="sincos2d", pool="gap", class_token=False, num_classes=num_classes)
    if stem == "proj3":
        return ProjectThenViT(vit)
    return ViT(**vit, stem="conv" if stem == "conv" else "patch")


def train_job(key, arrays: dict, context: dict, progress) -> dict:
    channels, stem = key
    return common.train_per_seed(model_for(context["model"], stem, context["num_classes"]), arrays[f"train{channels}"],
                                 arrays[f"test{channels}"], "color", context, progress)


def measure_costs(preset: dict, num_classes: int) -> list[dict]:
    """Parameters, XLA forward FLOPs per image and training-step seconds per configuration."""
    steps = {}
    rows = {}
    for channels, stem in CONFIGS:
        model = model_for(preset["model"], stem, num_classes)
        x = jnp.zeros((preset["timing_batch"], preset["res"], preset["res"], channels), jnp.float32)
        clf = common.Classifier(model, 10, 1e-3, x.shape[1:])
        params = clf._init(jax.random.key(0))
        shapes, flops = model_common.traced_cost(lambda k, x, m=model: m.init(k, x),
                                                 lambda p, x, m=model: m.apply(p, x)[0], x[:1])
        rows[(channels, stem)] = {"channels": channels, "stem": stem, "params": tree.count(shapes["params"]),
                                  "mflops": flops / 1e6}
        steps[(channels, stem)] = (clf, params, clf.tx.init(params), x, jnp.zeros((x.shape[0],), jnp.int32))
    times = {k: [] for k in steps}
    for k, (clf, params, state, x, y) in steps.items():  # compile; the step donates, so keep what it returns
        steps[k] = (clf, *clf._step(params, state, x, y)[:2], x, y)
    for _ in range(preset["repeats"]):
        for k, (clf, params, state, x, y) in steps.items():
            t0 = time.perf_counter()
            params, state, loss = clf._step(params, state, x, y)
            loss.block_until_ready()
            times[k].append(time.perf_counter() - t0)
            steps[k] = (clf, params, state, x, y)
    for k, t in times.items():
        rows[k].update(step_s=float(np.median(t)), step_s_min=float(min(t)), step_s_max=float(max(t)))
    return list(rows.values())


def main(argv=None) -> pathlib.Path:
    args, preset, seeds = common.parse_args(__doc__.splitlines()[0], "results/lessons/channels", PRESETS, argv,
                                            extra=(("repeats", int),))
    out = pathlib.Path(args.out)
    if args.report:
        return common.rewrite(out, "channels", ('runs.csv', 'cost.csv'), to_markdown)
    out.mkdir(parents=True, exist_ok=True)
    train = common.single_shape_set(preset["difficulty"], preset["res"], "train", preset["train_images"])
    test = common.single_shape_set(preset["difficulty"], preset["res"], "test", preset["test_images"])
    num_classes = train.pop("num_classes")["color"]
    test.pop("num_classes")
    arrays = {}
    for channels in sorted({c for c, _ in CONFIGS}):
        arrays[f"train{channels}"] = {"images": to_channels(train["images"], channels, 0), "color": train["color"]}
        arrays[f"test{channels}"] = {"images": to_channels(test["images"], channels, 1), "color": test["color"]}
    context = dict(model=preset["model"], num_classes=num_classes, epochs=preset["epochs"],
                   batch_size=preset["batch_size"], lr=preset["lr"], seeds=seeds)
    settings = {**context, "difficulty": preset["difficulty"], "res": preset["res"],
                "sizes": [preset["train_images"], preset["test_images"]]}
    t0 = time.perf_counter()
    done = common.run_cells(out, settings, CONFIGS, train_job, arrays, context, preset["workers"], "channels",
                            len(seeds))
    rows = [{"channels": c, "stem": s, "seed": seed, **done[(c, s)][seed]} for c, s in CONFIGS for seed in seeds]
    train_s = time.perf_counter() - t0
    cost = measure_costs(preset, num_classes)
    setup = {**{k: v for k, v in preset.items() if k != "seeds"}, "seeds": seeds, "num_classes": num_classes,
             "train_wall_s": round(train_s)}
    outputs.write_outputs(out, "channels", setup, to_markdown(rows, cost, setup), {"runs.csv": rows, "cost.csv": cost})
    groups = {f"{c} channel{'s' if c > 1 else ''}": {s: {r["seed"]: 100 * r["accuracy"] for r in rows
                                                      if (r["channels"], r["stem"]) == (c, s)}
                                                  for s in STEMS if (c, s) in CONFIGS}
              for c in dict.fromkeys(c for c, _ in CONFIGS)}
    outputs.bar_plot(groups, "colour accuracy (%)", out / "channels.png", "stems for 1-, 3- and 8-channel inputs")
    return out


def to_markdown(rows: list[dict], cost: list[dict], setup: dict) -> str:
    def cell(c, s):
        return {r["seed"]: r["accuracy"] for r in rows if (r["channels"], r["stem"]) == (c, s)}

    by = {(r["channels"], r["stem"]): r for r in cost}
    lines = [f"Colour accuracy (%) on single-shape `{setup['difficulty']}` scenes at {setup['res']} px "
             f"({setup['train_images']} images, {setup['epochs']} epochs of {setup['batch_size']}, model "
             f"{setup['model']}; {setup['test_images']} test images), mean ± 95% CI over {len(setup['seeds'])} seeds; "
             f"cost: parameters, XLA forward MFLOP per image, training-step seconds at batch {setup['timing_batch']} "
             f"(median [min, max] of {setup['repeats']} rounds in turns).", "",
             "| channels | stem | accuracy | vs linear (paired) | params | MFLOP/img | step s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    tests = []
    for c, s in CONFIGS:
        test = stats.paired(cell(c, s), cell(c, "linear")) if s != "linear" else None
        if test:
            tests.append(verdicts.paired(f"{c} channel(s): {s} − linear", cell(c, s), cell(c, "linear")))
        k = by[(c, s)]
        lines.append(f"| {c} | {s} | {outputs.mean_ci(cell(c, s))} | "
                     f"{'' if test is None else f'{100 * test[0]:+.1f} (p={test[1]:.2g})'} | {k['params']:,} | "
                     f"{k['mflops']:.1f} | {k['step_s']:.4f} [{k['step_s_min']:.4f}, {k['step_s_max']:.4f}] |")
    return "\n".join(lines + verdicts.section(tests, "Each stem against the linear one (points).")) + "\n"


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
