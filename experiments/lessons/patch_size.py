"""Lesson 004, measured: what patch size and resolution cost, and what they buy.

    python -m experiments.lessons.patch_size                          # results/lessons/patch_size/
    python -m experiments.lessons.patch_size --smoke --out /tmp/ps    # the tests run it

1. **Cost** of a small ViT (width 64, 4 blocks, mean pooling, no CLS) for patch 4/8/16/32 at
   32–224 px (up to 1,024 tokens: patch 4 at 224 px, 3,136, would hold ~5 GB of attention
   weights for the backward pass): tokens, the analytic count (``vit_tools.forward_flops``), XLA's count of the
   compiled forward, the attention-score entries per image (heads × N²), the training step's
   compiled temporary memory (XLA's memory analysis) and measured seconds per training and
   inference step (batch 8; the configurations take turns, ``--repeats`` rounds, median and
   range; run it on a quiet machine), each also as a ratio to patch 16 at 224 px next to the
   token and score-matrix ratios that predict it. The lesson's worked example (224 → 448 px at
   patch 16, with a CLS token: 4× the tokens, 785²/197² ≈ 15.9× the score matrix) is computed
   exactly.
2. **Accuracy** where training is affordable here (≤ 64 px): the shape task on single-shape
   ``medium`` scenes, trained per (patch, resolution) with ``--seeds``.

Writes ``cells.jsonl`` (the accuracy runs; a rerun skips them), ``cost.csv``, ``accuracy.csv``,
``patch_size.md``, ``cost.png`` and ``setup.json`` to ``--out``.
"""

from __future__ import annotations

import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lessons import common
from vitmm import xla_flags
from vitmm.models import common as model_common
from vitmm.models import vit as vit_lib
from vitmm.models import vit_tools
from vitmm.study import outputs, stats, verdicts

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODEL = dict(width=64, depth=4, num_heads=4, mlp_dim=256)
PRESETS = {
    "default": dict(patches="4,8,16,32", resolutions="32,64,112,224", max_tokens=1024, batch=8, repeats=3,
                    reference="16@224", train=[(4, 32), (8, 32), (16, 32), (8, 64), (16, 64), (32, 64)],
                    difficulty="medium", train_images=8000, test_images=1000, epochs=3, batch_size=64, lr=1e-3,
                    seeds="0,1,2", workers=2, model=MODEL),
    "smoke": dict(patches="8,16", resolutions="32,64", max_tokens=64, batch=2, repeats=1, reference="16@64",
                  train=[(8, 32), (16, 32)], difficulty="medium", train_images=64, test_images=32, epochs=1,
                  batch_size=32, lr=1e-3, seeds="0,1", workers=1, model=dict(width=32, depth=1, num_heads=2,
                                                                             mlp_dim=64)),
}


def model_for(cfg: dict, patch: int, num_classes: int = 0) -> vit_lib.ViT:
    return vit_lib.ViT(**cfg, patch_size=patch, posemb="sincos2d", pool="gap", class_token=False,
                       num_classes=num_classes)


def score_ratio(res_a: int, res_b: int, patch: int, prefix: int = 1) -> float:
    """``(N_b / N_a)²`` with ``N = (res / patch)² + prefix``: how much the score matrix grows."""
    n_a, n_b = (res_a // patch) ** 2 + prefix, (res_b // patch) ** 2 + prefix
    return (n_b / n_a) ** 2


def compile_config(cfg: dict, patch: int, res: int, batch: int) -> dict:
    """The compiled training step and forward of one configuration, with their XLA counts."""
    model = model_for(cfg, patch, num_classes=4)
    x = jnp.zeros((batch, res, res, 3), jnp.float32)
    y = jnp.zeros((batch,), jnp.int32)
    params = model.init(jax.random.key(0), x[:1])["params"]

    def loss(p, x, y):
        logits, _ = model.apply({"params": p}, x)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()

    def train_step(p, x, y):  # plain SGD: the step's cost is the forward and backward
        g = jax.grad(loss)(p, x, y)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)

    train = jax.jit(train_step).lower(params, x, y).compile()
    infer = jax.jit(lambda p, x: model.apply({"params": p}, x)[0]).lower(params, x).compile()
    memory = train.memory_analysis()
    return {"train": train, "infer": infer, "params": params, "x": x, "y": y,
            "xla_gflops": model_common.xla_flops(infer) / batch / 1e9,
            "temp_mib": (getattr(memory, "temp_size_in_bytes", 0) or 0) / 2**20}


def measure_costs(preset: dict) -> list[dict]:
    """Cost rows for every (patch, resolution) within ``max_tokens``, timed in turns."""
    cfg, batch = preset["model"], preset["batch"]
    resolutions, patches = (list(map(int, preset[k].split(","))) for k in ("resolutions", "patches"))
    configs = [(p, r) for r in resolutions for p in patches if r % p == 0 and (r // p) ** 2 <= preset["max_tokens"]]
    compiled = {c: compile_config(cfg, *c, batch) for c in configs}
    times = {c: {"train": [], "infer": []} for c in configs}
    for _ in range(preset["repeats"]):
        for c in configs:  # one round visits every configuration: drift hits all alike
            k = compiled[c]
            for mode in ("train", "infer"):
                args = (k["params"], k["x"], k["y"]) if mode == "train" else (k["params"], k["x"])
                jax.block_until_ready(k[mode](*args))  # warm
                t0 = time.perf_counter()
                jax.block_until_ready(k[mode](*args))
                times[c][mode].append(time.perf_counter() - t0)
    rows = []
    for patch, res in configs:
        arch = model_for(cfg, patch).arch()
        tokens = (res // patch) ** 2
        row = {"patch": patch, "res": res, "tokens": tokens,
               "analytic_gflops": vit_tools.forward_flops(arch, (res, res), num_prefix_tokens=0) / 1e9,
               "xla_gflops": compiled[(patch, res)]["xla_gflops"], "score_entries": cfg["num_heads"] * tokens ** 2,
               "temp_mib": compiled[(patch, res)]["temp_mib"]}
        for mode in ("train", "infer"):
            t = np.array(times[(patch, res)][mode])
            row.update({f"{mode}_s": float(np.median(t)), f"{mode}_s_min": float(t.min()),
                        f"{mode}_s_max": float(t.max())})
        rows.append(row)
    ref_patch, ref_res = map(int, preset["reference"].split("@"))
    ref = next((r for r in rows if (r["patch"], r["res"]) == (ref_patch, ref_res)), None)
    for r in rows:
        if ref is not None:
            r["token_ratio"] = r["tokens"] / ref["tokens"]
            r["score_ratio"] = r["score_entries"] / ref["score_entries"]
            r["flop_ratio"] = r["analytic_gflops"] / ref["analytic_gflops"]
            r["train_ratio"] = r["train_s"] / ref["train_s"]
            r["infer_ratio"] = r["infer_s"] / ref["infer_s"]
    return rows


def train_job(key, arrays: dict, context: dict, progress) -> dict:
    patch, res = key
    return common.train_per_seed(model_for(context["model"], patch, context["num_classes"]), arrays[f"train{res}"],
                                 arrays[f"test{res}"], "shape", context, progress)


def main(argv=None) -> pathlib.Path:
    args, preset, seeds = common.parse_args(__doc__.splitlines()[0], "results/lessons/patch_size", PRESETS, argv,
                                            extra=(("repeats", int),))
    out = pathlib.Path(args.out)
    if args.report:
        return common.rewrite(out, "patch_size", ('cost.csv', 'accuracy.csv'), to_markdown)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    arrays, num_classes = {}, None
    for res in sorted({r for _, r in preset["train"]}):
        train = common.single_shape_set(preset["difficulty"], res, "train", preset["train_images"])
        num_classes = train.pop("num_classes")["shape"]
        test = common.single_shape_set(preset["difficulty"], res, "test", preset["test_images"])
        test.pop("num_classes")
        arrays[f"train{res}"], arrays[f"test{res}"] = train, test
    context = dict(model=preset["model"], num_classes=num_classes, epochs=preset["epochs"],
                   batch_size=preset["batch_size"], lr=preset["lr"], seeds=seeds)
    settings = {**context, "difficulty": preset["difficulty"], "sizes": [preset["train_images"], preset["test_images"]]}
    keys = [tuple(k) for k in preset["train"]]
    done = common.run_cells(out, settings, keys, train_job, arrays, context, preset["workers"], "accuracy", len(seeds))
    accuracy = [{"patch": p, "res": r, "tokens": (r // p) ** 2, "seed": s, **done[(p, r)][s]} for p, r in keys
                for s in seeds]
    t_train = time.perf_counter() - t0

    t0 = time.perf_counter()
    cost = measure_costs(preset)
    setup = {**{k: v for k, v in preset.items() if k not in ("seeds", "train")}, "seeds": seeds,
             "trained": [list(k) for k in keys], "train_wall_s": round(t_train),
             "cost_wall_s": round(time.perf_counter() - t0)}
    outputs.write_outputs(out, "patch_size", setup, to_markdown(cost, accuracy, setup),
                         {"cost.csv": cost, "accuracy.csv": accuracy})
    plot(cost, out / "cost.png")
    return out


def to_markdown(cost: list[dict], accuracy: list[dict], setup: dict) -> str:
    ref = setup["reference"].replace("@", " at ") + " px"
    lines = [f"Cost of a ViT {setup['model']} (mean pooling, no CLS) per configuration, batch {setup['batch']}, "
             f"float32 on this CPU; step times: median [min, max] of {setup['repeats']} rounds in which every "
             f"configuration took a turn; ratios to patch {ref}. Predicted: the token ratio for the linear "
             "parts and the score-matrix ratio for attention; measured: the step time ratio.", "",
             "| patch | px | tokens | analytic GFLOP/img | XLA GFLOP/img | score entries/img | train temp MiB | "
             "train s/step | infer s/step | tokens × | scores × | FLOPs × | train × | infer × |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cost:
        ratios = " | ".join(f"{r[k]:.3g}" if k in r else "" for k in ("token_ratio", "score_ratio", "flop_ratio",
                                                                       "train_ratio", "infer_ratio"))
        lines.append(f"| {r['patch']} | {r['res']} | {r['tokens']:,} | {r['analytic_gflops']:.4g} | "
                     f"{r['xla_gflops']:.4g} | {r['score_entries']:,} | {r['temp_mib']:.1f} | "
                     f"{r['train_s']:.4f} [{r['train_s_min']:.4f}, {r['train_s_max']:.4f}] | "
                     f"{r['infer_s']:.4f} [{r['infer_s_min']:.4f}, {r['infer_s_max']:.4f}] | {ratios} |")
    grow = (448 // 16) ** 2 / (224 // 16) ** 2
    lines += ["", f"The lesson's example, computed: 224 → 448 px at patch 16 is {grow:g}× "
              f"the patches and, with a CLS token, ({(448 // 16) ** 2 + 1}/{(224 // 16) ** 2 + 1})² = "
              f"{score_ratio(224, 448, 16):.2f}× the score matrix.", "",
              f"Accuracy (%) on the shape task (single-shape `{setup['difficulty']}` scenes, {setup['train_images']} "
              f"images, {setup['epochs']} epochs of {setup['batch_size']}; {setup['test_images']} test images), mean ± "
              f"95% CI over {len(setup['seeds'])} seeds:", "", "| patch | px | tokens | accuracy |",
              "|---:|---:|---:|---:|"]
    for patch, res in setup["trained"]:
        cell = {r["seed"]: r["accuracy"] for r in accuracy if (r["patch"], r["res"]) == (patch, res)}
        lines.append(f"| {patch} | {res} | {(res // patch) ** 2} | {outputs.mean_ci(cell)} |")
    pairs = [(a, b) for a in setup["trained"] for b in setup["trained"] if a[1] == b[1] and a[0] * 2 == b[0]]
    if pairs:
        lines += ["", "Halving the patch at one resolution (4× the tokens), paired by seed:", ""]
        tests = []
        for (pa, ra), (pb, rb) in pairs:
            cells = [{x["seed"]: x["accuracy"] for x in accuracy if (x["patch"], x["res"]) == c}
                     for c in ((pa, ra), (pb, rb))]
            test = stats.paired(*cells)
            if test:
                lines.append(f"- {ra} px, patch {pb} → {pa}: {100 * test[0]:+.1f} points (p={test[1]:.2g})")
                tests.append(verdicts.paired(f"{ra} px, patch {pb} → {pa}", *cells))
        lines += verdicts.section(tests, "The halvings above (points).")
    return "\n".join(lines) + "\n"


def plot(cost: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in (("train", "o"), ("infer", "s")):
        ax.scatter([r["tokens"] for r in cost], [r[f"{mode}_s"] for r in cost], marker=marker, label=f"{mode} step")
    tokens = np.array(sorted({r["tokens"] for r in cost}), float)
    ref = max(cost, key=lambda r: r["tokens"])
    for power, style in ((1, ":"), (2, "--")):
        ax.plot(tokens, ref["train_s"] * (tokens / ref["tokens"]) ** power, style, color="grey",
                label=f"∝ tokens^{power} (through the largest)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per image")
    ax.set_ylabel("seconds per step (batch of the table)")
    ax.legend(fontsize=7)
    outputs.save_figure(fig, path)


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
