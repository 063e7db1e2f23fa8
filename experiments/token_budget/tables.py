"""The token-budget sweep's Markdown: the main table, the spread across connectors at equal token
counts and each family's gain with more tokens, the equal-parameter and encoder-side tables, the
claims' tests, the per-seed outcomes and the tuning grid (the numbers: ``report``)."""

from __future__ import annotations

import numpy as np

from experiments.token_budget.report import (
    BLIND,
    GLOBAL,
    KINDS,
    LATE,
    LEARNED_MARGIN,
    LEARNED_QUERY,
    LOCALITY,
    SPATIAL,
    chosen_pair,
    detail_test,
    factor_test,
    group_test,
    learned,
    ok_rows,
    paired_vs,
    verdict_tests,
)
from vitmm.study import verdicts


def mean_ci(s: dict, key: str) -> str:
    """Mean ± 95% CI half-width in points; the mean alone where one seed gives no interval (--interim)."""
    ci = s[key + "_ci"]
    return f"{100 * s[key]:.1f}" + ("" if ci != ci else f" ± {100 * ci:.1f}")


def diff_p(test) -> str:
    """A paired test ``(mean difference, p)`` as ``+d.d (p=...)`` in points; blank without one."""
    return "" if test is None else f"{100 * test[0]:+.1f} (p={test[1]:.2g})"


def _ms(s: dict, key: str) -> str:
    if s.get(key) is None or s[key] != s[key]:
        return ""
    lo, hi = s[key + "_range"]
    return f"{s[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def _joint(plan: dict) -> str:
    """The joint phase's schedule in words."""
    if plan.get("schedule", "constant") == "cosine" and not plan["patience"]:
        return f"{plan['max_steps']:,} joint steps of {plan['batch_size']} questions (warmup, then a cosine decay to 0)"
    return (f"joint steps of {plan['batch_size']} questions (warmup, then a {plan.get('schedule', 'constant')} lr) "
            + (f"until the validation accuracy has not risen by {100 * plan['min_delta']:g} points for "
               f"{plan['patience']} checks (no sooner than step {plan.get('min_steps', 0)}, at most "
               f"{plan['max_steps']})" if plan["patience"] else f"for {plan['max_steps']:,} steps"))


def to_markdown(summary: list[dict], setup: dict) -> str:
    kinds = " | ".join(KINDS)
    plan = setup["plan"]
    tuned = (f"; each family's learning rate and warmup (column lr/warmup) the best of lr {setup['tune_lrs']} "
             f"(warmup {setup['tune_warmups'][0]}), then warmup {setup['tune_warmups']} at that lr, on all "
             f"{setup['val_questions']:,} validation questions {_tuned_where(setup)}"
             if len(setup["tune_lrs"]) > 1 or len(setup["tune_warmups"]) > 1 else "")
    if setup.get("chosen_given"):
        tuned = "; each family's learning rate and warmup (column lr/warmup) given with `--chosen`, not tuned here"
    interim, lines = setup.get("interim"), []
    if interim:
        # Budgets that reach the same token count share one cell: name it once.
        pending = list(dict.fromkeys(f"{s['family']}@{s['tokens']}" + (f" ({s['variant']})" if s["variant"] else "")
                                     for s in summary if s["status"] == "pending"))
        lines += [f"**Interim: {interim['runs']} of {interim['of']} main-stage runs finished** (`--interim`, "
                  f"{setup['date']}): means and tests over the seeds each cell has so far; no seed finished yet: "
                  f"{', '.join(pending) or 'none'}.", ""]
    lines += [f"Exact-match accuracy on {setup['test_questions']:,} test questions of `{setup['data']}` "
             f"(mean ± 95% CI half-width, Student's t over {len(setup['seeds'])} seeds; vs blind: the mean "
             "difference in overall accuracy and the p of a t-test paired by seed). Each run: stage 0 "
             f"{setup['stage0_steps']} LM steps on the text (per seed), stage 1 {setup['stage1_steps']} connector "
             f"steps, then {_joint(plan)}; the parameters of the last check (on {plan['curve_questions']:,} "
             f"validation questions every {plan['eval_every']} steps) that beat the best before it by at least "
             f"{100 * plan['min_delta']:g} points are tested, within {100 * plan['min_delta']:g} points of the highest "
             f"check (steps: mean tested check / mean steps trained){tuned}; tower `{setup['tower']}` grid "
             f"{setup['grid'][0]}×{setup['grid'][1]}, "
             f"LM {setup['lm']}. FLOPs per example (XLA count, forward); LM FLOPs at BOS + visual tokens + "
             f"{setup['max_len'] - 1} text positions ({setup['tokenizer']} tokens). ms/ex: milliseconds per example "
             "of a training step and of scoring (connector + LM on precomputed features; "
             f"{setup['workers']} single-core worker(s) side by side; per seed the median of 20 steps after its "
             "training; the median over seeds [range]; compare rows, not machines)."
             + (f" The sweep's runs took {setup['worker_hours']:.1f} worker-hours ({setup['runs_timed']} runs, tuning "
                "included, summed over sittings)." if setup.get("worker_hours") else ""),
             "",
             f"| connector | budget | tokens | lr/warmup | steps | all | vs blind | {kinds} | params | conn. MFLOP | "
             "LM MFLOP | train ms/ex | infer ms/ex |",
             "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(KINDS) + "---:|---:|---:|---:|---:|"]
    for s in [s for s in summary if s["variant"] == ""]:
        if s["status"] != "ok":
            lines.append(f"| {s['family']} | {s['budget']} | {s['note']} |" + " |" * (len(KINDS) + 9))
            continue
        tokens = f"{s['tokens']}" + (f" ({s['note']})" if s["note"] else "")
        lines.append(
            f"| {s['family']} | {s['budget']} | {tokens} | {s['lr']:g}/{s['warmup']} | "
            f"{s['best_step']:.0f}/{s['steps_trained']:.0f} | {mean_ci(s, 'accuracy')}"
            + (f" ({s['seeds']} of {len(setup['seeds'])} seeds)" if interim and s["seeds"] < len(setup["seeds"])
               else "")
            + f" | {diff_p(s['vs_blind'])} | "
            + " | ".join(mean_ci(s, f"acc_{k}") for k in KINDS)
            + f" | {s['connector_params']:,} | {s['connector_mflops']:.2f} | {s['lm_mflops']:.1f} | "
            f"{_ms(s, 'train_ms')} | {_ms(s, 'infer_ms')} |")
    lines += ["", *spread_lines(summary), "", *param_lines(summary, setup), "", *encoder_lines(summary, setup), "",
              *factor_lines(summary), "", *claim_lines(summary), "", *seed_lines(summary), "", *tuning_lines(setup), "",
              *verdicts.table_lines(verdicts.correct(verdict_tests(summary)), "**Verdicts.** The tables' tests "
                                    "(points; the analysis of variance: shares of the variance in %).")]
    return "\n".join(lines) + "\n"


def _tuned_where(setup: dict) -> str:
    """Where and on which seeds the rates were tuned (a setup from before these options: one budget, one seed)."""
    where = "at each budget on its own" if setup.get("tune_each_budget") else f"at {setup['tune_budget']} tokens"
    seeds = setup.get("tune_seeds") or [setup["tune_seed"]]
    return where + (f", the mean of seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f", seed {seeds[0]}")


def tuning_lines(setup: dict) -> list[str]:
    """The tuning grid as a table: each family's validation accuracy (%) per learning rate at the
    first warmup, then at the other warmups (run at the family's best rate), the chosen setting in bold."""
    tuning, chosen = setup.get("tuning") or {}, setup.get("chosen") or {}
    if not tuning:
        return []
    first = int(setup["tune_warmups"][0])
    runs = {name: {(float(k.split("/")[0]), int(k.split("/")[1])): acc for k, acc in scores.items()}
            for name, scores in tuning.items()}
    lrs = sorted({lr for r in runs.values() for lr, w in r if w == first})
    warmups = sorted({w for r in runs.values() for _, w in r} - {first})

    def cell(r, setting, family):
        if setting not in r:
            return ""
        text = f"{100 * r[setting]:.1f}"
        return f"**{text}**" if list(setting) == [float(x) for x in chosen.get(family, ())] else text

    each = bool(setup.get("tune_each_budget"))
    seeds = setup.get("tune_seeds") or [setup["tune_seed"]]

    # Each family's best rate at the first warmup (ties: the smaller rate); runs at another warmup
    # and another rate (e.g. a pilot's) are off the grid and listed apart.
    best = {name: max((lr for lr, w in r if w == first), key=lambda lr: (r[(lr, first)], -lr), default=None)
            for name, r in runs.items()}
    extra = {name: sorted(s for s in r if s[1] != first and s[0] != best[name]) for name, r in runs.items()}
    runs_each = (f"seed {seeds[0]}, one run each" if len(seeds) == 1 else
                 f"the mean of seeds {', '.join(map(str, seeds))}, {len(seeds)} runs each")
    lines = [f"Tuning (validation exact match in %, all {setup['val_questions']:,} validation questions, {runs_each}; "
             f"the chosen lr/warmup in bold, used for every row of its family{' at these tokens' if each else ''}; "
             "blank: not run, the grid grows past its edge only for a family best there):", "",
             "| family @ tokens | " + " | ".join(f"lr {lr:g}" for lr in lrs)
             + "".join(f" | warmup {w} (at the best lr)" for w in warmups) + " | chosen lr/warmup |"
             + (" other runs |" if any(extra.values()) else ""),
             "|---|" + "---:|" * (len(lrs) + len(warmups)) + "---:|" + ("---|" if any(extra.values()) else "")]
    for name, r in runs.items():
        family = name if each else name.split("@")[0]  # the key of its choice
        lr_w = chosen.get(family)
        lines.append(f"| {name} | " + " | ".join(cell(r, (lr, first), family) for lr in lrs)
                     + "".join(f" | {cell(r, (best[name], w), family)}" for w in warmups)
                     + (f" | {lr_w[0]:g}/{lr_w[1]} |" if lr_w else " | |")
                     + (" " + ", ".join(f"{lr:g}/{w}: {cell(r, (lr, w), family)}" for lr, w in extra[name]) + " |"
                        if any(extra.values()) else ""))
    return lines


def spread_lines(summary: list[dict]) -> list[str]:
    """Connector vs token count at a glance (the main table's rows): at each token count, how far
    apart the families are (MM1 / TokenPacker's question), and per family, what going from its
    fewest to its most tokens gains. Rows at the same actual count are compared whatever budget
    was requested."""
    ok = [s for s in ok_rows(summary, "") if s["family"] != BLIND]
    at: dict[int, dict[str, float]] = {}
    cell: dict[tuple[int, str], dict] = {}
    for s in ok:
        at.setdefault(int(s["tokens"]), {})[s["family"]] = 100 * s["accuracy"]
        cell[(int(s["tokens"]), s["family"])] = s
    lines = ["Spread across connectors at equal token counts (points of exact-match accuracy; p: best against "
             "worst, t-test paired by seed — a pair picked after seeing the means, so p overstates the evidence; "
             "the analysis of variance below tests the connector as a whole):", "",
             "| tokens | families | best | worst | spread | p | mean |", "|---:|---:|---|---|---:|---:|---:|"]
    for tokens in sorted(at):
        acc = at[tokens]
        if len(acc) < 2:
            continue
        best, worst = (s["family"] for s in chosen_pair([cell[(tokens, f)] for f in acc]))
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
            test = paired_vs(cell[(hi, family)], cell[(lo, family)])
            lines.append(f"| {family} | {lo}: {counts[lo]:.1f} | {hi}: {counts[hi]:.1f} | "
                         f"{counts[hi] - counts[lo]:+.1f} | {'' if test is None else f'{test[1]:.2g}'} |")
    blind = [s for s in ok_rows(summary) if s["family"] == BLIND]
    if blind:
        lines += ["", f"No image (`blind`, the questions' prior): {100 * blind[0]['accuracy']:.1f}."]
    return lines


def param_lines(summary: list[dict], setup: dict) -> list[str]:
    """The equal-parameter table: each family sized to one connector parameter count, against
    itself at its default size (paired by seed)."""
    sized = [s for s in ok_rows(summary) if s["variant"].startswith("params")]
    if not sized:
        return []
    default = {(s["family"], s["tokens"]): s for s in ok_rows(summary, "")}
    knobs = {k.split("|")[0]: v["connector"] for k, v in setup.get("connectors", {}).items() if "params" in k}
    lines = [f"At equal parameters ({sized[0]['variant']} connector parameters, {setup['param_tokens']} tokens; each "
             "family's size knob set to the nearest count; vs default: paired by seed against the main table's row):",
             "", f"| connector | tokens | size | params | all | vs default size | {' | '.join(KINDS)} |",
             "|---|---:|---|---:|---:|---:|" + "---:|" * len(KINDS)]
    for s in sized:
        cfg = knobs.get(s["family"], {})
        size = ", ".join(f"{k}={v}" for k, v in cfg.items() if k not in ("name", "budget"))
        base = default.get((s["family"], s["tokens"]))
        lines.append(f"| {s['family']} | {s['tokens']} | {size} | {s['connector_params']:,} | "
                     f"{mean_ci(s, 'accuracy')} | {vs_default(s, base)} | "
                     + " | ".join(mean_ci(s, f"acc_{k}") for k in KINDS) + " |")
    acc = {s["family"]: 100 * s["accuracy"] for s in sized}
    best_cell, worst_cell = chosen_pair(sized)
    best, worst = best_cell["family"], worst_cell["family"]
    test = paired_vs(best_cell, worst_cell)
    lines += ["", f"Spread at equal parameters: {best} {acc[best]:.1f} − {worst} {acc[worst]:.1f} = "
              f"{acc[best] - acc[worst]:.1f} points"
              + ("" if test is None else f" (p={test[1]:.2g}, paired by seed, unadjusted: the pair was chosen after "
                 "seeing the means, so the Verdicts table's test pays for the choice)") + "."]
    return lines


def vs_default(s: dict, base: dict | None) -> str:
    """A sized row against the family's default size: the paired difference, or, where the nearest
    size is the default itself (the same connector, so the same runs), says so."""
    if base is not None and base["connector_params"] == s["connector_params"]:
        return "its default size"
    return diff_p(paired_vs(s, base) if base else None)


def tower_mflops(setup: dict, variant: str) -> float:
    """The tower's forward MFLOP per image for a row: at the full image and patch, or at an
    encoder-side view (``"image 32 px"``: a smaller image; ``"patch 16"``: larger patches) —
    the analytic ViT count (``vit_tools.forward_flops``), which the connector and LM columns leave out."""
    from vitmm.models.vit import Arch
    from vitmm.models.vit_tools import forward_flops

    cfg, size = setup["tower_config"], int(setup["image_size"])
    patch = int(cfg["patch_size"])
    if variant.startswith("image "):
        size = int(variant.split()[1])
    elif variant.startswith("patch "):
        patch = int(variant.split()[1])
    arch = Arch(cfg["width"], cfg["depth"], cfg["mlp_dim"], cfg["num_heads"], (patch, patch))
    return forward_flops(arch, (size, size), num_prefix_tokens=int(bool(cfg.get("class_token", True)))) / 1e6


def encoder_lines(summary: list[dict], setup: dict) -> list[str]:
    """Encoder-side against connector-side budget at equal LM tokens: ``mlp`` on every patch of a
    smaller image or of larger patches, against each connector compressing the full grid; with the
    whole forward's cost, since the encoder side saves in the tower what the others save in the LM."""
    enc = [s for s in ok_rows(summary) if s["variant"].startswith(("image", "patch"))]
    if not enc:
        return []
    lines = ["Encoder side against connector side at equal LM tokens (the encoder-side rows: `mlp` on all patches "
             "of a smaller image, sin-cos positions recomputed, or of larger patches, the patch kernel PI-resized; "
             "p: paired by seed against the best connector-side row, unadjusted: that row was chosen after seeing "
             "the means, so the Verdicts table's test pays for the choice; forward MFLOP per example: the tower's "
             "(analytic ViT count), and tower + connector + LM):", "",
             f"| tokens | how | all | vs best connector side | {' | '.join(KINDS)} | tower MFLOP | total MFLOP |",
             "|---:|---|---:|---:|" + "---:|" * (len(KINDS) + 2)]
    for tokens in sorted({s["tokens"] for s in enc}):
        side = [s for s in ok_rows(summary, "") if s["tokens"] == tokens and s["family"] != BLIND]
        best = chosen_pair(side)[0] if side else None
        for s in [s for s in enc if s["tokens"] == tokens] + sorted(side, key=lambda s: -s["accuracy"]):
            how = f"encoder: {s['variant']}" if s in enc else f"connector: {s['family']}"
            vs = diff_p(paired_vs(s, best)) if s in enc and best is not None else ""
            tower = tower_mflops(setup, s["variant"])
            total = tower + float(s["connector_mflops"]) + float(s["lm_mflops"])
            lines.append(f"| {tokens} | {how} | {mean_ci(s, 'accuracy')} | {vs} | "
                         + " | ".join(mean_ci(s, f"acc_{k}") for k in KINDS) + f" | {tower:.1f} | {total:.1f} |")
    return lines


def _pval(p) -> str:
    return "n/a (no residual variance)" if p is None else f"{p:.2g}"


def factor_lines(summary: list[dict]) -> list[str]:
    test = factor_test(summary)
    if test is None:
        return []
    fam, bud = test["family_means"], test["budget_means"]
    lines = [f"Budget or connector (MM1, TokenPacker): analysis of variance over the {len(fam)} families that ran at "
             f"every budget ({', '.join(fam)}) × requested budgets {', '.join(test['budgets'])} × "
             f"{len(test['seeds'])} seeds (seeds as blocks; accuracy in points). Marginal means: budgets "
             + ", ".join(f"{b} {m:.1f}" for b, m in bud.items())
             + f" (range {max(bud.values()) - min(bud.values()):.1f}); families "
             + ", ".join(f"{f} {m:.1f}" for f, m in fam.items())
             + f" (range {max(fam.values()) - min(fam.values()):.1f}).", "",
             "| source | sum of squares | df | share of the variance | F | p |", "|---|---:|---:|---:|---:|---:|"]
    for name, s in test["sources"].items():
        f = "" if s["f"] is None else f"{s['f']:.1f}"
        p = "" if name == "residual" else _pval(s["p"])
        lines.append(f"| {name} | {s['ss']:.1f} | {s['df']} | {100 * s['eta2']:.1f}% | {f} | {p} |")
    return lines


def claim_lines(summary: list[dict]) -> list[str]:
    def fmt(t):
        return "too few rows" if t is None else f"{100 * t[0]:+.1f} ± {100 * t[1]:.1f} points (p={t[2]:.2g})"

    lines = ["Claims, tested (mean over seeds ± 95% CI; t-tests over seeds, the variance shares' p the analysis of "
             "variance's F-tests; p unadjusted; the Verdicts table at the end corrects every test of this report "
             "together, and the verdicts follow it):", ""]
    counts = sorted({int(s["tokens"]) for s in ok_rows(summary, "") if s["family"] != BLIND})
    honeybee = [(tokens, name, test) for tokens in counts
                for name, kinds in (("spatial kinds (" + ", ".join(SPATIAL) + ")", SPATIAL),
                                    ("global kinds (" + ", ".join(GLOBAL) + ")", GLOBAL))
                if (test := group_test(summary, tokens, kinds)) is not None]
    for tokens, name, test in honeybee:
        present = {s["family"] for s in ok_rows(summary, "") if s["tokens"] == tokens}  # the groups as tested
        loc, query = ([f for f in group if f in present] for group in (LOCALITY, LEARNED_QUERY))
        lines.append(f"- Honeybee, {tokens} tokens, {name}: locality-preserving ({', '.join(loc)}) − "
                     f"learned-query ({', '.join(query)}) = {fmt(test)}")
    test = factor_test(summary)
    if test is not None:
        src = test["sources"]
        lines.append("- MM1 / TokenPacker, budget matters more than the connector: of the variance over the balanced "
                     "grid, " + ", ".join(f"{name} {100 * src[name]['eta2']:.1f}% (p={_pval(src[name]['p'])})"
                                            for name in ("budget", "family", "family × budget")))
    lines.append(f"- More tokens help fine detail more: (gain on spatial kinds − gain on global kinds), fewest to most "
                 f"tokens, mean over families = {fmt(detail_test(summary))}")
    return lines + honeybee_kind_lines(summary, counts)


def honeybee_kind_lines(summary: list[dict], counts: list[int]) -> list[str]:
    """Honeybee's difference kind by kind, to read the grouped tests (a kind no family learns pulls
    its group's difference towards zero); unadjusted p, not claims of their own."""
    cells = {t: [group_test(summary, t, (k,)) for k in KINDS] for t in counts}
    cells = {t: tests for t, tests in cells.items() if any(x is not None for x in tests)}
    if not cells:
        return []
    lines = ["", "Honeybee kind by kind: locality-preserving − learned-query, points (mean over seeds ± 95% CI, p of a "
             "t-test over seeds, unadjusted: to read the grouped tests above, not claims of their own):", "",
             f"| tokens | {' | '.join(KINDS)} |", "|---:|" + "---:|" * len(KINDS)]
    for t, tests in cells.items():
        lines.append(f"| {t} | " + " | ".join("" if x is None else f"{100 * x[0]:+.1f} ± {100 * x[1]:.1f} "
                                              f"(p={x[2]:.2g})" for x in tests) + " |")
    return lines


def seed_lines(summary: list[dict]) -> list[str]:
    """Outcomes that a mean over seeds hides: how many seeds learn each spatial kind (some kinds are
    learned or not, per seed, so their mean ± CI describes no run), and whether training had levelled
    off (the seeds whose highest check came in the last quarter, and what that quarter added)."""
    got = learned(summary)
    if got is None:
        return []
    lines = [f"Per seed: a seed learns a kind when its test accuracy on it is at least {100 * LEARNED_MARGIN:g} "
             "points above blind's mean (" + ", ".join(f"{k} ≥ {100 * v:.1f}" for k, v in got["bar"].items())
             + f"); late best: seeds whose highest validation check came after {100 * LATE:g}% of their steps; last "
             f"quarter: validation points gained from {100 * LATE:g}% of the steps to the end (mean ± 95% CI):", "",
             f"| connector | tokens | seeds | {' | '.join(f'learn {k}' for k in SPATIAL)} | late best | last quarter |",
             "|---|---:|---:|" + "---:|" * len(SPATIAL) + "---:|---:|"]
    for s, n in got["cells"]:
        name = s["family"] + (f" ({s['variant']})" if s["variant"] else "")
        lines.append(f"| {name} | {s['tokens']} | {s['seeds']} | " + " | ".join(str(n[k]) for k in SPATIAL)
                     + f" | {s['late_best']} | {100 * s['late_gain']:+.1f}"
                     + ("" if s["late_gain_ci"] != s["late_gain_ci"] else f" ± {100 * s['late_gain_ci']:.1f}") + " |")
    groups = []
    for label, families in (("locality-preserving", LOCALITY), ("learned-query", LEARNED_QUERY)):
        cells = [(s, n) for s, n in got["cells"] if s["family"] in families and s["variant"] == ""]
        if cells:
            seeds = sum(s["seeds"] for s, _ in cells)
            groups.append(f"{label}: " + ", ".join(f"{k} {sum(n[k] for _, n in cells)}/{seeds}" for k in SPATIAL))
    if groups:
        lines += ["", "Seeds that learn each spatial kind, main-table cells pooled over token counts: "
                  + "; ".join(groups) + "."]
    return lines
