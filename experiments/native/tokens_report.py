"""The report of ``python -m experiments.native``: ``native_tokens.md`` (means ± 95% CIs per path
and token cap, tests paired by seed and their Verdicts, Holm across the report) and
``native_tokens.png``, from the run's rows and ``setup.json`` (``--report`` rewrites the markdown
from a finished run's ``runs.csv``)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from experiments.common import feature_vlm as run_lib
from experiments.native import features as features_lib
from vitmm.study import outputs, stats, verdicts

PATHS = features_lib.PATHS
BLIND, KINDS = run_lib.BLIND, run_lib.KINDS


def summarise(rows: list[dict]) -> dict:
    """``{(path, budget): {metric: {seed: value}}}``."""
    out: dict = {}
    for r in rows:
        cell = out.setdefault((r["path"], r["budget"]), {})
        for k, v in r.items():
            if k.startswith("acc") or k in ("accuracy", "spatial"):
                cell.setdefault(k, {})[r["seed"]] = v
    return out


def to_markdown(rows: list[dict], setup: dict) -> str:
    s = summarise(rows)
    metrics = [("accuracy", "all"), *((f"acc_{k}", k) for k in KINDS), ("spatial", "spatial"),
               ("acc_wide", "wide images"), ("acc_squarish", "near-square")]
    tokens = {(r["path"], r["budget"]): (r["tokens_mean"], r["tokens_max"]) for r in rows}
    lines = ["# Square resize vs NaFlex vs AnyRes at equal LM tokens", "",
             f"`{setup['command']}` ({setup['date']}, {setup['backend']}); scenes `{setup['difficulty']}` at random "
             f"sizes (longer side {setup['min_side']}–{setup['max_side']} px, aspect ≤ {setup['max_aspect']}), "
             f"{setup['train_images']:,} training images, {setup['test_questions']:,} test questions; tower "
             f"`{setup['tower']}`; connector `mlp`; LM {setup['lm']}; {_seeds(s, setup['seeds'])}; "
             f"{_protocol(setup)}learning rates (validation, budget {max(setup['budgets'])}, seed "
             f"{setup['seeds'][0]}): {setup['chosen']}.{_tuning(setup)}{_interim(setup)}", "",
             "Exact match in %, mean ± 95% CI over seeds. Tokens: the visual tokens the LM reads per image (mean / "
             "max over the test images). *spatial* = mean of color_at, shape_at, relative; *wide* = questions on "
             f"images with aspect ≥ {setup['wide']} ({setup['wide_share']:.0%} of test questions).", "",
             "| budget | path | tokens | " + " | ".join(name for _, name in metrics) + " |",
             "|---|---|---|" + "---:|" * len(metrics)]
    for (path, budget), cell in sorted(s.items(), key=lambda kv: (kv[0][1], (BLIND, *PATHS).index(kv[0][0]))):
        mean, top = tokens[(path, budget)]
        lines.append(f"| {budget} | {path} | {mean:.1f} / {top} | "
                     + " | ".join(outputs.mean_ci(cell[m]) if m in cell else "" for m, _ in metrics) + " |")
    lines += ["", "## Paired tests (same seeds, same data order)", "",
              "| budget | comparison | metric | difference (points) | p |", "|---|---|---|---:|---:|"]
    tests = []
    for budget in setup["budgets"]:
        for a, b in (("naflex", "square"), ("anyres", "square"), ("anyres", "naflex"), ("square", BLIND)):
            if (a, budget) not in s or (b, budget) not in s:
                continue
            for m, name in (("accuracy", "all"), ("spatial", "spatial"), ("acc_wide", "wide images")):
                test = stats.paired(s[(a, budget)][m], s[(b, budget)][m])
                if test:
                    lines.append(f"| {budget} | {a} − {b} | {name} | {100 * test[0]:+.1f} | {test[1]:.3g} |")
                    n = len(set(s[(a, budget)][m]) & set(s[(b, budget)][m]))
                    tests.append(verdicts.paired(f"{a} − {b} at {budget}, {name}", s[(a, budget)][m],
                                                 s[(b, budget)][m], note="" if n == len(setup["seeds"]) else
                                                 f"{n} of {len(setup['seeds'])} seeds"))
    lines += verdicts.section(tests, "The paired tests above (points).", heading="## Verdicts\n\n")
    return "\n".join(lines) + "\n"


def _protocol(setup: dict) -> str:
    """How each run trained and which of its checkpoints is tested (``feature_vlm.train_and_eval``)."""
    steps, every, delta = setup["steps"], setup["eval_every"], setup["min_delta"]
    plateau = (f"each run stopped at its validation plateau (no gain of {delta} in {setup['patience']} checks "
               f"{every} steps apart) or at {steps:,} steps; ")
    tested = (f"the parameters of the last validation check ({setup.get('curve_questions', 0):,} questions every "
              f"{every} steps) that beat the best before it by {100 * delta:g} points tested; ")
    if setup.get("schedule") != "cosine":  # (the first protocol's setup.json has no schedule)
        return (f"a constant rate, {plateau}" if setup["patience"] else
                f"{steps:,} joint steps at a constant rate; {tested}")
    if setup["patience"]:
        return f"the rate on a cosine decay to zero at {steps:,} steps, {plateau}{tested}"
    return f"{steps:,} joint steps, the rate decayed to zero (cosine); {tested}"


def _interim(setup: dict) -> str:
    """``--interim``: how many of the planned runs the tables hold, and the cells with none yet."""
    part = setup.get("interim")
    if not part:
        return ""
    pending = f"; no seed finished yet: {', '.join(part['pending'])}" if part["pending"] else ""
    return f" **Interim**: {part['runs']} of {part['of']} runs finished{pending}."


def _seeds(s: dict, planned: list) -> str:
    """``N seeds``, or the cells holding fewer of them (a partial sweep's rows)."""
    short = {cell: len(v["accuracy"]) for cell, v in s.items() if len(v.get("accuracy", ())) < len(planned)}
    if not short:
        return f"{len(planned)} seeds"
    return (f"{len(planned)} seeds, fewer in {len(short)} cells (" + ", ".join(
        f"{p} at {b}: {n}" for (p, b), n in sorted(short.items(), key=lambda kv: (kv[0][1], kv[0][0])))
            + "; their means, CIs and tests over the seeds they hold)")


def _tuning(setup: dict) -> str:
    """Each path's validation accuracy per rate (the chosen one bold), and the paths whose chosen
    rate sits at an edge of the grid it was chosen from, the rate past it never tried."""
    grids: dict = {}
    for key, acc in (setup.get("tuning") or {}).items():
        point, lr = key.split("|")
        grids.setdefault(point.split("@")[0], {})[float(lr)] = acc
    if not grids:
        return ""
    chosen = setup["chosen"]

    def point(path, lr, acc):
        return f"**{lr:g}: {100 * acc:.1f}**" if lr == chosen.get(path) else f"{lr:g}: {100 * acc:.1f}"

    text = " Validation accuracy per rate (%): " + "; ".join(
        f"{path} " + ", ".join(point(path, lr, acc) for lr, acc in sorted(grid.items()))
        for path, grid in grids.items()) + "."
    edges = [f"{path} ({chosen[path]:g})" for path, grid in grids.items()
             if len(grid) > 1 and chosen.get(path) in (min(grid), max(grid))]
    if edges:
        text += (f" Chosen at an edge of its grid (the rate past it not tried): {', '.join(edges)}; such a path "
                 "may be under-tuned.")
    return text


def write_report(out: pathlib.Path) -> pathlib.Path:
    """``--report``: ``native_tokens.md`` again from the finished run's ``runs.csv`` and ``setup.json``."""
    missing = [name for name in ("runs.csv", "setup.json") if not (out / name).is_file()]
    if missing:
        raise SystemExit(f"--report: {out} has no {' or '.join(missing)}; a finished run writes them.")
    setup = json.loads((out / "setup.json").read_text())
    (out / "native_tokens.md").write_text(to_markdown(outputs.read_rows(out / "runs.csv"), setup))
    print(f"wrote {out}/native_tokens.md from runs.csv and setup.json")
    return out / "native_tokens.md"


def plot(rows: list[dict], out: pathlib.Path) -> None:
    """Accuracy against the mean visual tokens per image, a line per path with 95% CI bands: all
    questions, and those on wide images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarise(rows)
    tokens = {(r["path"], r["budget"]): r["tokens_mean"] for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, (metric, title) in zip(axes, (("accuracy", "all questions"), ("acc_wide", "questions on wide images")),
                                   strict=True):
        for path in PATHS:
            cells = sorted((tokens[k], np.array(list(v[metric].values()), float)) for k, v in s.items()
                           if k[0] == path)
            if not cells:
                continue
            x = np.array([t for t, _ in cells])
            mean = 100 * np.array([v.mean() for _, v in cells])
            ci = 100 * np.nan_to_num(np.array([stats.ci95(v) for _, v in cells]))
            ax.plot(x, mean, marker="o", label=path)
            ax.fill_between(x, mean - ci, mean + ci, alpha=0.2)
        blind = [np.array(list(v[metric].values()), float) for k, v in s.items() if k[0] == BLIND]
        if blind:
            ax.axhline(100 * blind[0].mean(), color="gray", linestyle="--", label="blind")
        ax.set_xlabel("visual tokens per image (mean over test images)")
        ax.set_title(title)
    axes[0].set_ylabel("exact match, % (95% CI)")
    axes[0].legend(fontsize=8)
    outputs.save_figure(fig, out / "native_tokens.png")
