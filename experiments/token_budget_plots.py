"""The token-budget sweep's plots: accuracy against the token budget and against cost (CI bands
over seeds), encoder-side against connector-side budget, and the learning curves."""

from __future__ import annotations

import pathlib

import numpy as np
from token_budget_report import BLIND, ok_rows  # a sibling module: experiments/ is on sys.path


def plot(summary: list[dict], out: pathlib.Path, curves: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = ok_rows(summary, "")
    blind = next((s for s in ok if s["family"] == BLIND), None)
    families = [f for f in dict.fromkeys(s["family"] for s in ok) if f != BLIND]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in families:
        pts = sorted({s["tokens"]: s for s in ok if s["family"] == family}.values(), key=lambda s: s["tokens"])
        ax.errorbar([s["tokens"] for s in pts], [100 * s["accuracy"] for s in pts],
                    yerr=[100 * np.nan_to_num(s["accuracy_ci"]) for s in pts], marker="o", capsize=3, label=family)
    enc = [s for s in ok_rows(summary) if s["variant"].startswith(("image", "patch"))]
    for s in enc:
        ax.errorbar([s["tokens"]], [100 * s["accuracy"]], yerr=[100 * np.nan_to_num(s["accuracy_ci"])], marker="s",
                    color="black", capsize=3, linestyle="none", label=f"encoder side: {s['variant']}")
    ax.set_xscale("log", base=2)
    _finish(plt, fig, ax, blind, "visual tokens handed to the LM",
            "Accuracy vs. token budget (mean, 95% CI over seeds)", out / "accuracy_vs_budget.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in families:
        pts = [s for s in ok if s["family"] == family]
        ax.scatter([s["connector_mflops"] + s["lm_mflops"] for s in pts], [100 * s["accuracy"] for s in pts],
                   label=family)
        for s in pts:
            ax.annotate(str(s["tokens"]), (s["connector_mflops"] + s["lm_mflops"], 100 * s["accuracy"]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    _finish(plt, fig, ax, blind, "connector + LM forward MFLOP per example (labels: visual tokens)",
            "Accuracy vs. cost", out / "accuracy_vs_cost.png")
    plot_encoder(plt, summary, out / "encoder_vs_connector.png")
    if curves:
        plot_curves(plt, curves, out / "learning_curves.png")


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


def plot_curves(plt, curves: dict, path: pathlib.Path) -> None:
    """Validation accuracy against joint steps, one panel per token count of the main table, one
    line per family: the mean over seeds, solid while every seed is still training and dashed
    beyond (the mean of the seeds still training)."""
    by_tokens: dict[int, dict[str, list]] = {}
    for key, curve in curves.items():
        family, tokens, variant, _ = key.split("|")
        if variant == "":
            by_tokens.setdefault(int(tokens), {}).setdefault(family, []).append(curve)
    if not by_tokens:
        return
    fig, axes = plt.subplots(1, len(by_tokens), figsize=(4.2 * len(by_tokens), 3.8), squeeze=False)
    for ax, tokens in zip(axes[0], sorted(by_tokens), strict=True):
        for family, runs in sorted(by_tokens[tokens].items()):
            steps, mean, count = mean_curve(runs)
            full = sum(c == len(runs) for c in count)  # checks are a prefix: every seed starts at step 0
            line, = ax.plot(steps[:full], [100 * m for m in mean[:full]], label=family)
            if full < len(steps):
                ax.plot(steps[full - 1:], [100 * m for m in mean[full - 1:]], linestyle="--", color=line.get_color())
        ax.set_title(f"{tokens} visual tokens")
        ax.set_xlabel("joint steps (dashed: mean of the seeds still training)")
        ax.set_ylabel("validation exact match (%)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_encoder(plt, summary: list[dict], path: pathlib.Path) -> None:
    """Encoder-side against connector-side budget: at each token count with an encoder-side row,
    every way of reaching that count, sorted by accuracy (95% CI over seeds)."""
    enc = [s for s in ok_rows(summary) if s["variant"].startswith(("image", "patch"))]
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
                color=["black" if s in enc else "tab:blue" for s in rows], capsize=3)
        if blind:
            ax.axvline(100 * blind["accuracy"], color="grey", linestyle="--", label="blind (no image)")
            ax.legend(fontsize=7)
        ax.set_title(f"{tokens} visual tokens (black: encoder side)")
        ax.set_xlabel("exact-match accuracy (%), 95% CI over seeds")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finish(plt, fig, ax, blind, xlabel: str, title: str, path: pathlib.Path) -> None:
    if blind:
        ax.axhline(100 * blind["accuracy"], color="grey", linestyle="--", label="blind (no image)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
