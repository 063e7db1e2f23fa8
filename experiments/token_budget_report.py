"""The token-budget sweep's tables and plots: mean ± 95% CI over seeds per (connector, budget),
paired tests against blind, the spread across connectors at equal token counts, each family's gain
with more tokens."""

from __future__ import annotations

import csv
import pathlib

import numpy as np

from vitmm.data import scenes

BLIND = "blind"
KINDS = scenes.QUESTION_KINDS


def summarise(rows: list[dict]) -> list[dict]:
    """Mean ± std over seeds per (family, requested budget)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["budget"]), []).append(r)
    out = []
    for rs in groups.values():
        first = rs[0]
        s = {k: first.get(k) for k in ("family", "budget", "tokens", "note", "lr", "connector_params",
                                       "connector_mflops", "lm_mflops")}
        s["seeds"] = sum(r["status"] == "ok" for r in rs)
        ok = [r for r in rs if r["status"] == "ok"]
        for key in ("accuracy", *(f"acc_{k}" for k in KINDS), "train_ex_s", "infer_ex_s"):
            values = np.array([r[key] for r in ok], float)
            s[key] = float(values.mean()) if len(values) else float("nan")
            s[key + "_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
            s[key + "_ci"] = ci95(values)
        s["by_seed"] = {int(r["seed"]): float(r["accuracy"]) for r in ok}
        s["status"] = first["status"]
        out.append(s)
    blind = next((s for s in out if s["family"] == BLIND and s["status"] == "ok"), None)
    for s in out:
        s["vs_blind"] = paired_vs(s, blind) if blind is not None and s is not blind and s["status"] == "ok" else None
    return out


def ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean (Student's t over seeds)."""
    from scipy import stats

    if len(values) < 2:
        return float("nan")
    return float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values)))


def paired_vs(s: dict, base: dict) -> tuple[float, float] | None:
    """``(mean difference, two-sided p)`` of a paired t-test over the seeds both cells ran (the data
    order is the same per seed, so the seeds pair); None with fewer than two shared seeds."""
    from scipy import stats

    seeds = sorted(set(s["by_seed"]) & set(base["by_seed"]))
    if len(seeds) < 2:
        return None
    a, b = np.array([s["by_seed"][k] for k in seeds]), np.array([base["by_seed"][k] for k in seeds])
    diff = a - b
    p = 1.0 if np.allclose(diff, diff[0]) and diff[0] == 0 else float(stats.ttest_rel(a, b).pvalue)
    return float(diff.mean()), p


def _pm(s: dict, key: str) -> str:
    return f"{100 * s[key]:.1f} ± {100 * s[key + '_ci']:.1f}"


def _vs(s: dict) -> str:
    if not s.get("vs_blind"):
        return ""
    diff, p = s["vs_blind"]
    return f"{100 * diff:+.1f} (p={p:.2g})"


def _threads(workers: int) -> str:
    return ("one process on all cores" if workers <= 1
            else f"one thread per run, {workers} runs side by side (compare rows with each other, not across "
                 "machines)")


def to_markdown(summary: list[dict], setup: dict) -> str:
    kinds = " | ".join(KINDS)
    test = setup.get("test_questions")
    where = (f"{test:,} test questions" if test else f"{setup['val_questions']:,} validation questions")
    tuned = (f"; each family's learning rate (column lr) the best of {setup['tune_lrs']} on "
             f"{setup['val_questions']:,} validation questions at {setup['tune_budget']} tokens, seed "
             f"{setup['tune_seed']}" if len(setup.get("tune_lrs") or ()) > 1 else "")
    lines = [f"Exact-match accuracy on {where} of `{setup['data']}` "
             f"(mean ± 95% CI half-width, Student's t over {len(setup['seeds'])} seeds; vs blind: the mean "
             "difference in overall accuracy and the p of a t-test paired by seed; "
             f"stage 0 {setup.get('stage0_steps', 0)} LM steps on the "
             f"text, stage 1 {setup.get('stage1_steps', 0)} connector steps, then {setup['steps']} steps × "
             f"{setup['batch_size']} questions per run{tuned}; tower `{setup['tower']}` grid "
             f"{setup['grid'][0]}×{setup['grid'][1]}, LM {setup['lm']}). "
             "FLOPs per example (XLA count, forward); LM FLOPs at BOS + visual tokens + "
             f"{setup['max_len'] - 1} text positions ({setup['tokenizer']} tokens). Examples/s: connector + LM on "
             f"precomputed features, median step, {_threads(setup['workers'])}.",
             "",
             f"| connector | budget | tokens | lr | all | vs blind | {kinds} | params | conn. MFLOP | LM MFLOP | "
             "train ex/s | infer ex/s |",
             "|---|---|---:|---:|---:|---:|" + "---:|" * len(KINDS) + "---:|---:|---:|---:|---:|"]
    for s in summary:
        if s["status"] != "ok":
            lines.append(f"| {s['family']} | {s['budget']} | {s['note']} |" + " |" * (len(KINDS) + 8))
            continue
        tokens = f"{s['tokens']}" + (f" ({s['note']})" if s["note"] else "")
        lines.append(
            f"| {s['family']} | {s['budget']} | {tokens} | {s['lr']:g} | {_pm(s, 'accuracy')} | {_vs(s)} | "
            + " | ".join(_pm(s, f"acc_{k}") for k in KINDS)
            + f" | {s['connector_params']:,} | {s['connector_mflops']:.2f} | {s['lm_mflops']:.1f} | "
            f"{s['train_ex_s']:,.0f} | {s['infer_ex_s']:,.0f} |")
    return "\n".join(lines + [""] + spread_lines(summary)) + "\n"


def spread_lines(summary: list[dict]) -> list[str]:
    """Connector vs token count at a glance: at each token count, how far apart the families are
    (MM1 / TokenPacker's question), and per family, what going from its fewest to its most tokens
    gains. Rows at the same actual count are compared whatever budget was requested."""
    ok = [s for s in summary if s["status"] == "ok" and s["family"] != "blind"]
    at: dict[int, dict[str, float]] = {}
    cell: dict[tuple[int, str], dict] = {}
    for s in ok:
        at.setdefault(int(s["tokens"]), {})[s["family"]] = 100 * s["accuracy"]
        cell[(int(s["tokens"]), s["family"])] = s
    lines = ["Spread across connectors at equal token counts (points of exact-match accuracy; p: best against "
             "worst, t-test paired by seed):", "",
             "| tokens | families | best | worst | spread | p | mean |", "|---:|---:|---|---|---:|---:|---:|"]
    for tokens in sorted(at):
        acc = at[tokens]
        if len(acc) < 2:
            continue
        best, worst = max(acc, key=acc.get), min(acc, key=acc.get)
        test = paired_vs(cell[(tokens, best)], cell[(tokens, worst)])
        lines.append(f"| {tokens} | {len(acc)} | {best} {acc[best]:.1f} | {worst} {acc[worst]:.1f} | "
                     f"{acc[best] - acc[worst]:.1f} | {'' if test is None else f'{test[1]:.2g}'} | "
                     f"{np.mean(list(acc.values())):.1f} |")
    lines += ["", "Gain from the family's fewest to its most tokens (points; p: t-test paired by seed):", "",
              "| connector | fewest | most | gain | p |", "|---|---|---|---:|---:|"]
    for family in dict.fromkeys(s["family"] for s in ok):
        counts = {t: acc[family] for t, acc in at.items() if family in acc}
        if len(counts) > 1:
            lo, hi = min(counts), max(counts)
            gain = counts[hi] - counts[lo]
            test = paired_vs(cell[(hi, family)], cell[(lo, family)])
            lines.append(f"| {family} | {lo}: {counts[lo]:.1f} | {hi}: {counts[hi]:.1f} | {gain:+.1f} | "
                         f"{'' if test is None else f'{test[1]:.2g}'} |")
    blind = [s for s in summary if s["family"] == "blind" and s["status"] == "ok"]
    if blind:
        lines += ["", f"No image (`blind`, the questions' prior): {100 * blind[0]['accuracy']:.1f}."]
    return lines


def plot(summary: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in summary if s["status"] == "ok"]
    blind = next((s for s in ok if s["family"] == BLIND), None)
    families = [f for f in dict.fromkeys(s["family"] for s in ok) if f != BLIND]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in families:
        pts = sorted({s["tokens"]: s for s in ok if s["family"] == family}.values(), key=lambda s: s["tokens"])
        ax.errorbar([s["tokens"] for s in pts], [100 * s["accuracy"] for s in pts],
                    yerr=[100 * np.nan_to_num(s["accuracy_ci"]) for s in pts], marker="o", capsize=3, label=family)
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


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
