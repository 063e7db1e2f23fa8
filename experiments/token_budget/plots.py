"""The token-budget sweep's plots: accuracy against the token budget (one panel per family, CI
bands over seeds, the other families in grey behind it, and a panel for the encoder-side budget),
accuracy against cost (compiled FLOPs and measured milliseconds), encoder-side against
connector-side budget, and the learning curves. A family has one colour in every plot."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from experiments.token_budget.report import BLIND, LEARNED_QUERY, LOCALITY, ok_rows

ORDER = ("linear", "mlp", *LOCALITY, *LEARNED_QUERY)  # the ten families: tab10's ten colours
ENCODER_SIDE = {"image": "smaller image", "patch": "larger patches"}  # variant prefix → what shrinks


def colours(plt, families) -> dict:
    """A fixed colour per family (tab10 for the ten known ones, Dark2 for others, in order)."""
    known = dict(zip(ORDER, plt.get_cmap("tab10").colors, strict=True))
    extra = iter(plt.get_cmap("Dark2").colors * 4)
    return {f: known[f] if f in known else next(extra) for f in families}


def plot(summary: list[dict], out: pathlib.Path, curves: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = ok_rows(summary, "")
    blind = next((s for s in ok if s["family"] == BLIND), None)
    families = [f for f in dict.fromkeys(s["family"] for s in ok) if f != BLIND]
    colour = colours(plt, families)
    if families:
        plot_budget(plt, summary, families, colour, blind, out / "accuracy_vs_budget.png")
        plot_cost(plt, ok, families, colour, blind, out / "accuracy_vs_cost.png")
    plot_encoder(plt, summary, colour, out / "encoder_vs_connector.png")
    if curves:
        plot_curves(plt, curves, colour, out / "learning_curves.png")


def _points(rows: list[dict], family: str, x: str = "tokens") -> list[dict]:
    """A family's main-table rows, one per token count (two budgets reaching one count share a
    run), in token order."""
    return sorted({s["tokens"]: s for s in rows if s["family"] == family}.values(), key=lambda s: s[x])


def _band(ax, xs, rows, colour, label=None, marker="o", linestyle="-"):
    """Means joined by a line, the 95% CI as a band (as error bars where a row stands alone)."""
    mean = np.array([100 * s["accuracy"] for s in rows])
    ci = np.array([100 * np.nan_to_num(s["accuracy_ci"]) for s in rows])
    ax.plot(xs, mean, marker=marker, linestyle=linestyle, color=colour, label=label, markersize=4)
    if len(rows) > 1:
        ax.fill_between(xs, mean - ci, mean + ci, color=colour, alpha=0.25, linewidth=0)
    else:
        ax.errorbar(xs, mean, yerr=ci, color=colour, capsize=3, linestyle="none")


def _token_axis(ax, ticks):
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def plot_budget(plt, summary, families, colour, blind, path: pathlib.Path) -> None:
    """Accuracy against visual tokens, one panel per family (its default size), the other
    families' means in grey behind it; a last panel reaches the counts on the encoder side
    (``mlp`` on every patch of a smaller image or of larger patches, joined to ``mlp`` on the
    full grid)."""
    ok = ok_rows(summary, "")
    enc = [s for s in ok_rows(summary) if s["variant"].startswith(tuple(ENCODER_SIDE))]
    panels = families + (["encoder side"] if enc else [])
    ticks = sorted({s["tokens"] for s in ok + enc if s["family"] != BLIND})
    cols = min(5, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.7 * cols, 2.5 * rows + 0.6), sharex=True, sharey=True,
                             squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for other in families:  # context: every family's means
            pts = _points(ok, other)
            ax.plot([s["tokens"] for s in pts], [100 * s["accuracy"] for s in pts], color="0.8", linewidth=0.8,
                    zorder=0)
        if panel == "encoder side":
            full = _points(ok, "mlp")
            for prefix, name in ENCODER_SIDE.items():
                pts = sorted([s for s in enc if s["variant"].startswith(prefix)] + full, key=lambda s: s["tokens"])
                _band(ax, [s["tokens"] for s in pts], pts, "black", name, *(("s", "--") if prefix == "patch" else ()))
            ax.legend(fontsize=6, loc="lower right")
            ax.set_title("encoder side (mlp, all patches)", fontsize=9)
        else:
            pts = _points(ok, panel)
            _band(ax, [s["tokens"] for s in pts], pts, colour[panel])
            ax.set_title(panel, fontsize=9, color=colour[panel])
        if blind:
            ax.axhline(100 * blind["accuracy"], color="grey", linestyle="--", linewidth=0.8)
        _token_axis(ax, ticks)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("visual tokens")
    for ax in axes[:, 0]:
        ax.set_ylabel("exact match (%)")
    fig.suptitle("Test accuracy against the token budget: mean and 95% CI over seeds (grey: the other families; "
                 "dashed: blind)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cost(plt, ok, families, colour, blind, path: pathlib.Path) -> None:
    """Accuracy against two costs side by side: compiled forward FLOPs of connector + LM and the
    measured milliseconds of a training step, per example; each family's points joined in token
    order and labelled with their token count."""
    costs = (("flops", "connector + LM forward MFLOP per example (XLA count)"),
             ("train_ms", "training ms per example (measured, median over seeds)"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    for ax, (key, label) in zip(axes, costs, strict=True):
        for family in families:
            pts = [s for s in _points(ok, family) if key == "flops" or s.get(key) == s.get(key)]
            xs = [s["connector_mflops"] + s["lm_mflops"] if key == "flops" else s[key] for s in pts]
            ax.errorbar(xs, [100 * s["accuracy"] for s in pts], yerr=[100 * np.nan_to_num(s["accuracy_ci"])
                                                                      for s in pts],
                        marker="o", markersize=4, capsize=2, color=colour[family], label=family)
            for x, s in zip(xs, pts, strict=True):
                ax.annotate(str(s["tokens"]), (x, 100 * s["accuracy"]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        if blind:
            ax.axhline(100 * blind["accuracy"], color="grey", linestyle="--", linewidth=0.8, label="blind (no image)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.tick_params(axis="x", which="both", labelsize=7)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("exact match (%), mean and 95% CI")
    axes[1].legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.suptitle("Accuracy against cost (labels: visual tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mean_curve(runs: list) -> tuple[list[int], list[float], list[int]]:
    """The checks any seed reached, the mean validation accuracy over the seeds that reached each,
    and how many did (runs stop at different checks: past the first stop the mean is over the
    survivors, which the plot draws dashed)."""
    by_step: dict[int, list[float]] = {}
    for curve in runs:
        for step, acc in curve:
            by_step.setdefault(int(step), []).append(float(acc))
    steps = sorted(by_step)
    return steps, [float(np.mean(by_step[s])) for s in steps], [len(by_step[s]) for s in steps]


def plot_curves(plt, curves: dict, colour: dict, path: pathlib.Path) -> None:
    """Validation accuracy against joint steps, one panel per token count of the main table, one
    line per family (the mean over seeds: solid while every seed is still training, dashed
    beyond, the mean of the seeds still training), blind's mean curve in grey in each."""
    by_tokens: dict[int, dict[str, list]] = {}
    for key, curve in curves.items():
        family, tokens, variant, _ = key.split("|")
        if variant == "":
            by_tokens.setdefault(int(tokens), {}).setdefault(family, []).append(curve)
    blind = next((by_tokens.pop(t)[BLIND] for t in list(by_tokens) if BLIND in by_tokens[t]), None)
    if not by_tokens:
        return
    fig, axes = plt.subplots(1, len(by_tokens), figsize=(4.2 * len(by_tokens), 3.8), squeeze=False, sharey=True)
    for ax, tokens in zip(axes[0], sorted(by_tokens), strict=True):
        if blind:
            steps, mean, _ = mean_curve(blind)
            ax.plot(steps, [100 * m for m in mean], color="grey", linewidth=0.8, label="blind")
        for family, runs in sorted(by_tokens[tokens].items(), key=lambda kv: ORDER.index(kv[0])
                                   if kv[0] in ORDER else len(ORDER)):
            steps, mean, count = mean_curve(runs)
            full = sum(c == len(runs) for c in count)  # checks are a prefix: every seed starts at step 0
            ax.plot(steps[:full], [100 * m for m in mean[:full]], label=family, color=colour.get(family))
            if full < len(steps):
                ax.plot(steps[full - 1:], [100 * m for m in mean[full - 1:]], linestyle="--", color=colour.get(family))
        ax.set_title(f"{tokens} visual tokens")
        ax.set_xlabel("joint steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    axes[0][0].set_ylabel("validation exact match (%), mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_encoder(plt, summary: list[dict], colour: dict, path: pathlib.Path) -> None:
    """Encoder-side against connector-side budget: at each token count with an encoder-side row,
    every way of reaching that count, sorted by accuracy (95% CI over seeds)."""
    enc = [s for s in ok_rows(summary) if s["variant"].startswith(tuple(ENCODER_SIDE))]
    counts = sorted({int(s["tokens"]) for s in enc})
    if not counts:
        return
    blind = next((s for s in ok_rows(summary, "") if s["family"] == BLIND), None)
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4), squeeze=False)
    for ax, tokens in zip(axes[0], counts, strict=True):
        side = [s for s in ok_rows(summary, "") if int(s["tokens"]) == tokens and s["family"] != BLIND]
        rows = sorted([s for s in enc if int(s["tokens"]) == tokens] + side, key=lambda s: s["accuracy"])
        names = [f"encoder: {s['variant']}" if s in enc else s["family"] for s in rows]
        ax.barh(names, [100 * s["accuracy"] for s in rows], xerr=[100 * np.nan_to_num(s["accuracy_ci"]) for s in rows],
                color=["black" if s in enc else colour.get(s["family"], "tab:blue") for s in rows], capsize=3)
        if blind:
            ax.axvline(100 * blind["accuracy"], color="grey", linestyle="--", label="blind (no image)")
            ax.legend(fontsize=7)
        ax.set_title(f"{tokens} visual tokens (black: encoder side)")
        ax.set_xlabel("exact-match accuracy (%), 95% CI over seeds")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
