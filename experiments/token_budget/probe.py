"""Linear probes on the frozen tower's patch features: does the tower hold what the questions ask?
``python -m experiments.token_budget.probe --out results/token_budget/hard`` encodes OUT/tower's
train / validation / test images as the sweep does (its image counts), reads each image's facts from
``scenes.generate`` and fits L2-regularised logistic regressions on the mean-pooled and the flattened
patch features, the strength chosen per label group on validation: OUT/probe.md and OUT/probe.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.common import qa_features
from experiments.token_budget.args import PRESETS
from vitmm import checkpoint as ckpt_lib
from vitmm.data import pipeline, scenes, scenes_builder
from vitmm.models.vit import ViT

LAMS = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0001)  # strong to weak: each fit starts from the previous one's weights
PRESENCE = ("shape present", "colour present")  # binary groups: balanced accuracy too
ABOUT = (
    "Tower `{tower}` (data `{data}`, grid {grid}, {channels} channels); images: {images}. Labels from "
    "`scenes.generate` (records matched to generated scenes by their pixels), not the questions: presence of each "
    "shape and colour, the object count, and per region of the questions' layout the shape (colour) whose centre "
    "is in it or `none` (regions holding two centres left out; `(occupied)`: the regions holding exactly one, what "
    "shape_at / color_at ask, scored on the probe's best class other than `none`). L2-regularised softmax "
    "regression per label on standardised features, full batch, L-BFGS ({iters} steps per strength), λ from "
    "{lams} chosen per group on validation accuracy ((edge): an end of that grid). Test accuracy in %, 95% "
    "percentile-bootstrap intervals over test images (1,000 resamples); majority: each label's most frequent test "
    "class; base rate: the mean share of positive labels.")
FEATURES = {"mean-pooled": lambda p: p.mean(1), "flattened grid": lambda p: p.reshape(len(p), -1)}


def scene_objects(data: str, split: str, n: int, data_dir=None) -> tuple:
    """The difficulty and the generator's objects of the first ``n`` records of ``split``. TFDS
    stores a build's examples shuffled, so record ``i`` is not ``scenes.generate``'s index ``i``:
    each record is matched to the generated scene (the build's own config: difficulty, size, seed)
    with the same pixels, and a record no scene matches is refused."""
    cfg = scenes_builder.config_from_name(data.split("/", 1)[1])
    size = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}[split]
    made = {hashlib.sha1(ex["image"].tobytes()).digest(): ex["objects"] for ex in
            (scenes.generate(cfg.difficulty, cfg.resolution, i, split, cfg.seed) for i in range(size))}
    source = pipeline.get_source(data, split, data_dir, keys=("image",))
    objs = [made.get(hashlib.sha1(np.asarray(source[i]["image"]).tobytes()).digest()) for i in range(n)]
    if any(o is None for o in objs):
        raise SystemExit(f"{data} {split}: record {objs.index(None)} is no scene of scenes.generate's; rebuild "
                         "the dataset (delete it from the TFDS data_dir).")
    return scenes.DIFFICULTIES[cfg.difficulty], objs


def scene_labels(diff: scenes.Difficulty, objs: list) -> dict:
    """Label groups ``{name: [(head, classes, labels [n], valid [n])]}`` of scenes' objects.
    Region heads (the questions' layout) are valid where at most one centre lies in the region
    (``none``: no centre); ``... (occupied)`` are the same heads on regions holding exactly one."""
    regions = scenes.REGIONS_2X2 if diff.grid == 2 else scenes.REGIONS_3X3
    yes, ones = ("no", "yes"), np.ones(len(objs), bool)
    groups = {
        "shape present": [(s, yes, np.array([s in o["shape"] for o in objs], int), ones) for s in diff.shapes],
        "colour present": [(c, yes, np.array([c in o["color"] for o in objs], int), ones) for c in diff.colors],
        "object count": [("count", tuple(range(1, diff.max_shapes + 1)),
                          np.array([len(o["shape"]) - 1 for o in objs]), ones)],
    }
    for key, field, names in (("shape", "shape", diff.shapes), ("colour", "color", diff.colors)):
        heads, occupied = [], []
        for r in regions:
            inside = [[v for v, reg in zip(o[field], o["region"], strict=True) if reg == r] for o in objs]
            label = np.array([names.index(v[0]) + 1 if len(v) == 1 else 0 for v in inside])
            heads.append((r, ("none", *names), label, np.array([len(v) <= 1 for v in inside])))
            occupied.append((r, ("none", *names), label, np.array([len(v) == 1 for v in inside])))
        groups[f"{key} at region"], groups[f"{key} at region (occupied)"] = heads, occupied
    return groups


def fit(x, heads, lams, iters: int = 100):
    """Softmax regressions, one per head, on ``x`` at each strength of ``lams`` (each from the last
    one's weights): the heads' mean cross-entropies over valid rows, summed (their weights are apart,
    so the joint optimum is each head's), + lam/2 |W|². Yields (lam, params, loss, its last-10-step fall)."""
    sizes = [len(classes) for _, classes, _, _ in heads]
    segment = jnp.asarray(np.repeat(np.arange(len(heads)), sizes))  # each logit column's head
    picked = jnp.asarray(np.stack([y for _, _, y, _ in heads], 1) + np.cumsum([0, *sizes[:-1]]))  # [n, heads]
    mask = jnp.asarray(np.stack([m for _, _, _, m in heads], 1), jnp.float32)
    x = jnp.asarray(x)

    @jax.jit
    def run(params, lam):
        def loss(p):
            logits = (x @ p["w"] + p["b"]).T  # [columns, n]
            top = jax.lax.stop_gradient(jax.ops.segment_max(logits, segment, len(heads)))
            lse = jnp.log(jax.ops.segment_sum(jnp.exp(logits - top[segment]), segment, len(heads))) + top
            ce = lse.T - jnp.take_along_axis(logits.T, picked, 1)  # [n, heads]
            return jnp.sum(jnp.sum(ce * mask, 0) / jnp.maximum(mask.sum(0), 1.0)) + 0.5 * lam * jnp.sum(p["w"] ** 2)

        opt, value_and_grad = optax.lbfgs(), optax.value_and_grad_from_state(loss)

        def step(carry, _):
            p, state = carry
            value, grad = value_and_grad(p, state=state)
            updates, state = opt.update(grad, state, p, value=value, grad=grad, value_fn=loss)
            return (optax.apply_updates(p, updates), state), value

        (p, _), values = jax.lax.scan(step, (params, opt.init(params)), None, length=iters)
        return p, loss(p), values[-min(10, iters)] - loss(p)

    params = {"w": jnp.zeros((x.shape[1], sum(sizes))), "b": jnp.zeros(sum(sizes))}
    for lam in lams:
        params, final, fall = run(params, lam)
        yield lam, params, float(final), float(fall)


def predict(logits: np.ndarray, heads, occupied: bool = False) -> np.ndarray:
    """Each head's predicted class ``[n, heads]`` from the heads' concatenated logits; ``occupied``:
    the best class other than ``none`` (class 0), as a question about an occupied region implies."""
    bounds, skip = np.cumsum([0, *[len(classes) for _, classes, _, _ in heads]]), int(occupied)
    return np.stack([logits[:, lo + skip:hi].argmax(1) + skip for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)],
                    1)


def scores(pred, heads, weights=None) -> dict:
    """Accuracy over the group's valid (image, head) pairs and, for binary heads, the mean per-head
    balanced accuracy; ``weights`` ``[B, n]`` (bootstrap counts per image) gives ``[B]`` of each."""
    y, m = np.stack([h[2] for h in heads], 1), np.stack([h[3] for h in heads], 1).astype(float)
    w = np.ones((1, len(y))) if weights is None else weights
    out = {"accuracy": (w @ ((pred == y) * m).sum(1)) / (w @ m.sum(1))}
    if all(len(h[1]) == 2 for h in heads):
        tpr = (w @ ((pred == 1) & (y == 1))) / np.maximum(w @ (y == 1), 1)
        tnr = (w @ ((pred == 0) & (y == 0))) / np.maximum(w @ (y == 0), 1)
        out["balanced accuracy"] = ((tpr + tnr) / 2).mean(1)
    return {k: v if weights is not None else float(v[0]) for k, v in out.items()}


def probe(patches: dict, labels: dict, lams, iters: int, bootstrap: int = 1000) -> dict:
    """Per feature kind and label group: each strength's validation scores, the chosen one's test
    scores with 95% bootstrap intervals over test images, and the test majority baseline."""
    n_test = len(labels["test"]["object count"][0][2])
    weights = np.random.default_rng(0).multinomial(n_test, np.full(n_test, 1 / n_test), size=bootstrap)
    labels = {s: {g: h for g, h in groups.items() if not g.endswith("(occupied)")} if s == "train" else groups
              for s, groups in labels.items()}  # (occupied): the region probes, scored on occupied regions
    heads = [h for g in labels["train"].values() for h in g]
    result = {}
    for kind, pool in FEATURES.items():
        x = {s: pool(p) for s, p in patches.items()}
        mean, std = x["train"].mean(0), x["train"].std(0) + 1e-6
        x = {s: (v - mean) / std for s, v in x.items()}
        fits, t0 = [], time.perf_counter()
        for lam, params, loss, fall in fit(x["train"], heads, lams, iters):
            logits = {s: np.asarray(jnp.asarray(x[s]) @ params["w"] + params["b"]) for s in ("validation", "test")}
            fits.append(dict(lam=lam, loss=loss, fall=fall, logits=logits))
            print(f"  {kind} λ={lam:g}: train loss {loss:.4f} (fell {fall:.1e} over the last 10 steps; "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
        rows, bounds = {}, np.cumsum([0, *[len(c) for _, c, _, _ in heads]])  # each head's logit columns
        first = dict(zip(labels["train"], np.cumsum([0, *map(len, labels["train"].values())]), strict=False))
        for group, test_heads in labels["test"].items():
            fitted = group.removesuffix(" (occupied)")
            cols = slice(bounds[first[fitted]], bounds[first[fitted] + len(test_heads)])
            preds = [{s: predict(f["logits"][s][:, cols], test_heads, group != fitted) for s in f["logits"]}
                     for f in fits]
            val = [scores(p["validation"], labels["validation"][group]) for p in preds]
            best = int(np.argmax([v["accuracy"] for v in val]))
            pred = preds[best]["test"]  # and the majority baseline: each head's most frequent valid class
            base = np.stack([np.full(len(y), np.bincount(y[m], minlength=len(c)).argmax()) for _, c, y, m in
                             test_heads], 1)
            point, boot = scores(pred, test_heads), scores(pred, test_heads, weights)
            base_boot = scores(base, test_heads, weights)["accuracy"]
            rows[group] = dict(lam=lams[best], edge=best in (0, len(lams) - 1),
                               val={f"{lam:g}": v for lam, v in zip(lams, val, strict=True)},
                               majority=scores(base, test_heads)["accuracy"],
                               pairs=int(sum(h[3].sum() for h in test_heads)),
                               **{k: dict(value=v, ci=np.percentile(boot[k], [2.5, 97.5]).tolist()) for k, v in
                                  point.items()},
                               minus_majority_ci=np.percentile(boot["accuracy"] - base_boot, [2.5, 97.5]).tolist())
            if group in PRESENCE:
                rows[group]["base_rate"] = float(np.mean([h[2].mean() for h in test_heads]))
        result[kind] = dict(groups=rows, fits={f"{f['lam']:g}": dict(train_loss=f["loss"], fall_last_10=f["fall"])
                                               for f in fits})
    return result


def markdown(res: dict, command: str, header: dict) -> str:
    pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
    ci = lambda r: f"{pct(r['value'])} [{pct(r['ci'][0])}, {pct(r['ci'][1])}]"  # noqa: E731
    n = header["counts"]
    lines = ["# Linear probes on the frozen tower's patch features", "", f"    {command}", "", ABOUT.format(
        **header, images=f"{n['train']} train, {n['validation']} validation, {n['test']} test"), ""]
    for kind, r in res.items():
        fall = max(f["fall_last_10"] / max(f["train_loss"], 1e-9) for f in r["fits"].values())
        lines += [f"## {kind}", "", f"Each fit's summed train loss fell by at most {100 * fall:.2g}% over its last 10 "
                  "L-BFGS steps.", "", "| label group | test pairs | base rate | majority | probe accuracy [95% CI] "
                  "| probe − majority [95% CI] | balanced accuracy [95% CI] | λ |", "|---|---|---|---|---|---|---|---|"]
        for group, g in r["groups"].items():
            lo, hi = g["minus_majority_ci"]
            bal = ci(g["balanced accuracy"]) + " (majority 50.0)" if "balanced accuracy" in g else ""
            rate = pct(g["base_rate"]) + "% yes" if "base_rate" in g else ""
            lines.append(f"| {group} | {g['pairs']} | {rate} | {pct(g['majority'])} | {ci(g['accuracy'])} | "
                         f"[{pct(lo)}, {pct(hi)}] | {bal} | {g['lam']:g}{' (edge)' * g['edge']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    default = PRESETS["default"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/token_budget", help="the sweep's folder (reads OUT/tower)")
    parser.add_argument("--data_dir", default=None, help="TFDS data_dir (default ~/tensorflow_datasets)")
    parser.add_argument("--train_images", type=int, default=default["train_images"])
    parser.add_argument("--val_images", type=int, default=default["val_images"])
    parser.add_argument("--test_images", type=int, default=None, help="default: as --val_images (the sweep's)")
    parser.add_argument("--lams", default=",".join(f"{v:g}" for v in LAMS), help="L2 strengths, strong to weak")
    parser.add_argument("--iters", type=int, default=150, help="L-BFGS steps per strength")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    tower_dir = (out := pathlib.Path(args.out)) / "tower"
    if not (tower_dir / "checkpoints").is_dir():
        raise SystemExit(f"No tower in {tower_dir}: run the sweep first (python -m experiments.token_budget --out "
                         f"{out}).")
    config = ckpt_lib.load_config(tower_dir)
    data, image_size = config["input"]["data"]["name"], config["input"]["image_size"]
    counts = {"train": args.train_images, "validation": args.val_images, "test": args.test_images or args.val_images}
    lams, t0 = [float(v) for v in args.lams.split(",")], time.perf_counter()
    tower, params = ViT(**config["model"]["image"]), ckpt_lib.load_params(tower_dir)["img"]
    tokenizer, max_len = qa_features.make_tokenizer("bytes", data, args.data_dir)  # (the questions: not read)
    patches = {}  # the sweep's tower features [images, patches, channels]
    for split, n in counts.items():
        patches[split] = qa_features.encode_split(tower, params, data, split, n, image_size, tokenizer, max_len,
                                                  args.data_dir)["patches"]
        print(f"encoded {len(patches[split])} {split} images: {patches[split].shape[1:]}", flush=True)
    counts = {s: len(p) for s, p in patches.items()}
    labels = {s: scene_labels(*scene_objects(data, s, n, args.data_dir)) for s, n in counts.items()}
    print(f"labels from scenes.generate ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    res = probe(patches, labels, lams, args.iters)
    grid = tower.grid((image_size, image_size))
    header = dict(tower=str(tower_dir), data=data, grid=f"{grid[0]}×{grid[1]}", channels=patches["train"].shape[-1],
                  counts=counts, lams=", ".join(f"{v:g}" for v in lams), iters=args.iters)
    command = "python -m experiments.token_budget.probe " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "probe.md").write_text(markdown(res, command, header))
    (out / "probe.json").write_text(json.dumps(dict(command=command, **header, probes=res), indent=1) + "\n")
    print(f"wrote {out / 'probe.md'} and {out / 'probe.json'} ({time.perf_counter() - t0:.0f} s)")
    return res


if __name__ == "__main__":
    main()
