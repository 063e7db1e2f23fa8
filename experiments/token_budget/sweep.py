"""The token-budget experiment: connectors × visual-token budgets × seeds on scenes questions.

    python -m experiments.token_budget                        # the default sweep (results/token_budget/)
    python -m experiments.token_budget --smoke --out /tmp/tb  # about a minute; the tests run it
    python -m experiments.token_budget --families pool,perceiver --budgets 4,16 --seeds 0,1,2
    python -m experiments.token_budget --interim              # the tables so far, while it runs
    python -m experiments.token_budget --report               # token_budget.md again from runs.csv

One frozen CLIP image tower encodes every image once; all runs of the sweep read those features.
It is part of the results: ``OUT/tower`` (the image tower's parameters and the CLIP config, 3 MB),
taken from ``workdirs/clip_scenes`` (which ``make demo`` writes, and this script trains first when
it is missing) the first time, and read from there by every later sitting, so that a sweep
spanning several machines runs on one tower (the same config trained on another machine gives
another tower: ``results/demo/README.md``). ``--tower`` takes any ``vitmm.train`` workdir instead.
Stage 0 trains the small Llama-style LM (word tokens) on the training questions' text alone, once
per seed (``--stage0_steps``), so that connector training starts from an LM that answers in the
right format. Each run then trains its connector alone for ``--stage1_steps`` (the LM frozen:
LLaVA's stage 1, so a fresh connector's tokens do not disturb the trained LM), and then the
connector and the LM together on (image, question, answer) triples — LLaVA's stage 2 with the
tower frozen — for ``--steps`` steps: a linear warmup, then a cosine decay to zero (``--schedule
cosine``; a constant rate with early stopping, ``--schedule constant --patience N``, made the
score depend on when a run happened to stop: ``results/token_budget/v2_constant/README.md``). The
exact match on ``--curve_questions`` validation questions is checked every ``--eval_every`` steps
(the learning curves), and the parameters of the last check that beat the best before it by
``--min_delta`` (so within ``--min_delta`` of the highest check) are scored per question kind on
the test questions. Each family's learning rate and warmup are chosen first on the validation
split at ``--tune_budget`` tokens and the first seed (the first K: ``--tune_seeds K``): the best
of ``--tune_lrs`` at the first of ``--tune_warmups`` (a best rate at an edge of the grid tries the
next one past it, up to ``--tune_extend`` more), then the other warmups at that rate
(``tuning.jsonl``; ``--lr`` skips tuning). ``--tune_each_budget`` tunes every family at every
budget on its own, each run then at its own budget's rate (an encoder-side row at its family's
nearest tuned count), and ``--tune_seeds K`` trains each tuning point on the first K seeds and
chooses on their mean (points already tuned on fewer seeds train only the new ones). Exact match
is computed teacher-forced in one forward pass, which equals greedy decoding's exact match
(``vitmm.decode.answer_scores``).

Two more comparisons share the sweep: at equal parameters (``--param_budget`` connector
parameters at ``--param_tokens`` tokens, each family's size knob set by ``connectors.size_to``),
and the encoder-side budget (``--encoder_budgets``): ``mlp`` on every patch of a smaller image
(sin-cos positions recomputed) or of larger patches (the patch kernel PI-resized, FlexiViT's
rule), against connectors compressing the full grid to the same count.

Budgets are visual tokens handed to the LM. A family whose knob cannot hit a budget exactly runs
at its nearest reachable count (within a factor ``--max_ratio``) and the tables record the
actual count; a budget it cannot approach is listed as unreachable, with what it can reach. A
``blind`` baseline (the same stage-0 LM, fine-tuned with a visual token carrying no image) measures what the questions
alone give away. The two families with a hidden width of their own (``qformer`` 256,
``c_abstractor`` 256 by default) run at the tower's width instead, so that no connector is wider
than what it reads (``--native_widths`` keeps the defaults).

Writes to ``--out``: ``cells.jsonl`` (each finished job, all its seeds, as it finishes: a rerun
with the same settings skips it, so a sweep can span several sittings; ``seeds.jsonl`` keeps each
finished seed of the jobs still running, which a rerun does not train again; a rerun with more
``--seeds`` trains only the new ones), ``tuning.jsonl`` (and ``tuning_seeds.jsonl``, each finished
tuning seed, as ``seeds.jsonl``), ``runs.csv`` (one row per run and seed: lr, warmup, steps,
tokens, parameters, FLOPs, ms per example, per-kind accuracy), ``curves.json`` (validation
accuracy per check of every run), ``token_budget.md`` (the tables, with 95% CIs over seeds and
paired tests, and the claims' tests), ``accuracy_vs_budget.png``, ``accuracy_vs_cost.png``,
``learning_curves.png``, ``encoder_vs_connector.png`` and ``setup.json`` (tower, data, model,
training and tuning settings).
``--interim`` trains nothing and writes the same files to ``OUT/interim/`` from the seeds finished so
far (it encodes the features to check the settings, about two minutes for the default sweep).
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import time

import jax
import numpy as np

from experiments.common import feature_vlm
from experiments.token_budget import jobs as cell_jobs
from experiments.token_budget import plots, report, signing, tables, tune
from experiments.token_budget.args import parse_args
from experiments.token_budget.features import encode_features
from vitmm import xla_flags
from vitmm.models import connectors
from vitmm.study import outputs, store

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLIND, KINDS = report.BLIND, report.KINDS


def plan_jobs(args, grid, in_dim: int, lm_width: int, enc: dict) -> tuple[list, dict, dict]:
    """The rows of the tables ``(family, requested budget, variant, setting, tokens, note)``, the
    jobs ``{(family, tokens, variant): {"connector": cfg, "view": name}}`` (two budgets at one
    reachable count share a job) and the rows that reuse another row's runs, ``{row key: {**job,
    "runs_of": job key}}``: a family sized to the parameter budget whose nearest size is its
    default (the same connector, so the same runs). Variants: ``""`` (each family's default size,
    the main table), ``"params ≈ P"`` (sized to P connector parameters) and the encoder-side ones
    (``mlp`` on all patches of a smaller image or larger patches)."""
    plan = [] if args.no_blind else [(BLIND, 0, "", 1, 1, "no image")]
    jobs, same = {}, {}
    for family in args.families:
        for b in args.budgets:
            setting, tokens, note = connectors.resolve(family, b, grid, args.max_ratio)
            plan.append((family, b, "", setting, tokens, note))
    for family, _, variant, setting, tokens, _ in plan:
        if setting is not None:
            jobs.setdefault((family, tokens, variant), main_job(family, setting, in_dim, args.native_widths))
    if args.param_budget:
        variant = f"params ≈ {args.param_budget:,}"
        for family in args.families:
            setting, tokens, note = connectors.resolve(family, args.param_tokens, grid, args.max_ratio)
            if setting is None or family not in connectors.SIZE_KNOBS:
                continue
            cfg, count = connectors.size_to({"name": family, "budget": setting}, args.param_budget, in_dim, lm_width,
                                            grid)
            plan.append((family, args.param_tokens, variant, setting, tokens, note))
            default = jobs.get((family, tokens, ""))
            # Only the size knob differs and counts grow with it: an equal count is the default's own size.
            if default and connectors.num_params(default["connector"], in_dim, lm_width, grid) == count:
                same[(family, tokens, variant)] = {"connector": cfg, "view": "", "runs_of": (family, tokens, "")}
            else:
                jobs[(family, tokens, variant)] = {"connector": cfg, "view": ""}
    if enc and "mlp" not in args.families:
        args.parser.error("the encoder-side rows (--encoder_budgets) use the mlp connector at its tuned settings; add "
                          "mlp to --families or pass --encoder_budgets ''.")
    for tokens, views in enc.items():
        for variant, (view, *_rest) in views.items():
            plan.append(("mlp", tokens, variant, "all", tokens, ""))
            jobs[("mlp", tokens, variant)] = {"connector": {"name": "mlp", "budget": "all"}, "view": "@" + view}
    return plan, jobs, same


TOWER_WIDTH = {"qformer": "width", "c_abstractor": "hidden"}  # families with a hidden width of their own


def main_job(family: str, setting, in_dim: int, native_widths: bool) -> dict:
    """A main-table job: the family's connector (blind: pool's, on blank features) at its knob's
    setting; ``TOWER_WIDTH``'s families at the tower's width ``in_dim``, or with ``native_widths``
    at their own, a departure from the default plan that signs the job's rows and snapshots
    (``"signed"``: ``signing``)."""
    cfg = {"name": "pool" if family == BLIND else family, "budget": setting}
    if family not in TOWER_WIDTH:
        return {"connector": cfg, "view": ""}
    if native_widths:
        return {"connector": cfg, "view": "", "signed": {"connector": cfg}}
    return {"connector": {**cfg, TOWER_WIDTH[family]: in_dim}, "view": ""}


def longest_first(jobs, mflops: dict, tuned: dict, seeds_left: dict) -> list:
    """The jobs by expected seconds, longest first, so that the sweep does not end on one worker
    running a slow job while the other waits. Expected seconds: the job's forward MFLOPs per example
    (``mflops[key]``, connector + LM) times its family's seconds per MFLOP in its tuning runs
    (``tuned``; FLOPs alone miss how slow some layers run on a CPU), times the seeds it has left to run. The
    blind job goes first: every other row is compared with it, so ``--interim`` tables have their
    baseline from the start, and as the cheapest job it would not balance the end anyway."""
    rate = {}
    for (family, tokens, _, _), by_seed in tuned.items():
        if (family, tokens, "") in mflops:
            rate.setdefault(family, []).extend(r["wall_s"] / mflops[(family, tokens, "")]
                                               for r in by_seed.values() if "wall_s" in r)
    known = [x for xs in rate.values() for x in xs]
    default = float(np.median(known)) if known else 1.0
    return sorted(jobs, key=lambda key: (key[0] != BLIND, -mflops[key] * float(np.mean(rate.get(key[0]) or [default]))
                                         * seeds_left.get(key, 1)))


def tune_families(args, jobs: dict, run_cells, out: pathlib.Path, signature) -> tuple[dict, dict]:
    """``(tuning results, {label: (lr, warmup)})`` (``tune.label``: per family, or per family and token
    count with ``--tune_each_budget``): on validation, at the token count nearest ``--tune_budget`` (or
    at each of the grid's), over the first ``--tune_seeds`` seeds (their mean decides), the lr grid at
    the first warmup (a best rate at an edge of the grid tries the next one past it), then the other
    warmups at the best lr; or the rates ``--chosen`` names, or (one lr, one warmup) no tuning at all."""
    run_steps = args.stage1_steps + args.steps
    families = {family for family, _, variant in jobs if variant == ""}
    if args.tune_each_budget:
        points = sorted({(family, tokens) for family, tokens, variant in jobs if variant == ""})
    else:
        tune_at = {}
        for family, tokens, variant in jobs:
            if variant == "" and (family not in tune_at or abs(math.log(tokens / args.tune_budget))
                                  < abs(math.log(tune_at[family] / args.tune_budget))):
                tune_at[family] = tokens
        points = sorted(tune_at.items())
    tuned, tuning = {}, args.chosen is None and (len(args.tune_lrs) > 1 or len(args.tune_warmups) > 1)
    if args.chosen is not None:
        return tuned, {f: args.chosen[f] for f in families}
    if not tuning:
        return tuned, {f: (args.tune_lrs[0], args.tune_warmups[0]) for f in families}
    seeds = args.seeds[:args.tune_seeds]
    lrs = {point: list(args.tune_lrs) for point in points}
    while True:  # the grid, then one more rate past an edge that wins, until none does
        keys = [(f, t, x, args.tune_warmups[0]) for (f, t), grid in lrs.items() for x in grid]
        tuned = run_cells(cell_jobs.tune_job, sorted(keys, key=lambda k: -k[1]), out / "tuning.jsonl", signature,
                          "tuning (lr)", seeds, run_steps)
        extra = tune.extend_grid(tuned, lrs, args.tune_lrs, args.tune_extend, args.min_delta)
        if not extra:
            break
        print(f"best rate at an edge of the grid: trying {extra}")
        for point, x in extra.items():
            lrs[point].append(x)
    best = tune.choose(tuned, args.tune_each_budget)
    keys = [(f, t, best[tune.label(f, t, args.tune_each_budget)][0], w) for f, t in points
            for w in args.tune_warmups[1:]]
    if keys:
        tuned.update(run_cells(cell_jobs.tune_job, sorted(keys, key=lambda k: -k[1]), out / "tuning.jsonl",
                               signature, "tuning (warmup)", seeds, run_steps))
    return tuned, tune.choose(tuned, args.tune_each_budget)


def kept_tuning(args, holds=None):
    """``--interim``'s ``run_cells`` for tuning: the tuning points' kept results (``tuning.jsonl``
    and ``tuning_seeds.jsonl``, on the tuning seeds), nothing trained, so that ``tune_families``
    replays the full run's choice step by step (its grid, its extensions, its warmups) and never
    reads a run outside it; a run the full sweep would still train stops ``--interim``."""
    def run_cells(fn, keys, path, signature, desc, seeds, steps_per_seed):
        kept = store.seed_results([path, path.with_name("tuning_seeds.jsonl")], signature, holds)
        found = {k: {s: kept[k][s] for s in seeds} for k in keys if set(seeds) <= set(kept.get(k, {}))}
        missing = [k for k in keys if k not in found]
        if missing:
            args.parser.error(f"--interim: {desc} has {len(missing)} runs to go (e.g. {missing[0]}), so the main stage "
                              f"has no runs yet; the finished ones are in {path} (without OUT/setup.json, --interim "
                              f"needs the sweep's own flags again, e.g. --smoke).")
        return found
    return run_cells


def result_rows(args, plan: list, same: dict, results: dict, chosen: dict, costs: dict) -> tuple[list, dict]:
    """One row per table row and seed (unreachable and pending rows too) and the learning curves."""
    rows = []
    for family, requested, variant, setting, tokens, note in plan:
        base = {"family": family, "budget": requested, "variant": variant, "tokens": tokens, "note": note}
        if setting is None:
            rows.append({**base, "seed": "", "status": "unreachable"})
            continue
        key = same.get((family, tokens, variant), {}).get("runs_of", (family, tokens, variant))
        if not results.get(key):  # --interim: a cell with no finished seed yet
            rows.append({**base, "note": "no seed finished yet", "seed": "", "status": "pending"})
        for seed in [seed for seed in args.seeds if seed in results.get(key, {})]:
            res = {k: v for k, v in results[key][seed].items() if k != "curve"}
            res["late_gain"] = report.late_gain(results[key][seed]["curve"])
            res["peak_step"] = report.peak_step(results[key][seed]["curve"])
            lr, warmup = tune.rate(chosen, family, tokens)
            rows.append({**base, "seed": seed, "status": "ok", "lr": lr, "warmup": warmup, **costs[key], **res})
    curves = {f"{f}|{t}|{v}|{seed}": res["curve"] for (f, t, v), by_seed in results.items()
              for seed, res in by_seed.items()}
    return rows, curves


def write_report(out: pathlib.Path) -> pathlib.Path:
    """``--report``: ``token_budget.md`` again from the finished sweep's ``runs.csv`` and ``setup.json``
    (nothing trained or encoded): a report whose wording or tests changed, on the committed runs."""
    missing = [name for name in ("runs.csv", "setup.json") if not (out / name).is_file()]
    if missing:
        raise SystemExit(f"--report: {out} has no {' or '.join(missing)}; a sweep that has finished writes them.")
    rows = report.read_runs(out / "runs.csv")
    setup = json.loads((out / "setup.json").read_text())
    (out / "token_budget.md").write_text(tables.to_markdown(report.summarise(rows), setup))
    print(f"wrote {out}/token_budget.md from runs.csv and setup.json")
    return out / "token_budget.md"


def shared_settings(args, f, lm_cfg: dict, signed_plan: dict) -> dict:
    """What every run of this sweep shares (``signing.shared``; each row adds its own rate): a
    finished run is reused only under the same. Stage 0 trains at ``--stage0_lr`` whatever ``--lr``."""
    return signing.shared(tower=f.fingerprint, data=f.data, lm=lm_cfg, plan=signed_plan, stage0_lr=args.stage0_lr,
                          stage0_steps=args.stage0_steps, stage1_steps=args.stage1_steps,
                          splits=tuple(len(f.splits[name]["ids"]) for name in ("train", "val", "test")),
                          max_len=f.max_len, tokenizer=args.tokenizer)


def main(argv=None) -> pathlib.Path:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    if args.report:
        return write_report(out)
    out.mkdir(parents=True, exist_ok=True)
    f = encode_features(args, out)
    train, val, test = f.splits["train"], f.splits["val"], f.splits["test"]
    in_dim = train["patches"].shape[-1]

    lm_cfg = dict(vocab_size=f.tokenizer.vocab_size, **args.lm)
    plan, jobs, same = plan_jobs(args, f.grid, in_dim, lm_cfg["width"], f.encoder)
    print(f"{len(jobs)} jobs × {len(args.seeds)} seeds, {'≤ ' if args.patience else ''}{args.steps} joint steps "
          f"each; unreachable: {[(fam, b) for fam, b, _, s, _, _ in plan if s is None]}")
    train_plan = {k: getattr(args, k) for k in ("batch_size", "eval_every", "patience", "min_delta", "curve_questions")}
    train_plan["max_steps"] = args.steps
    if args.schedule != "constant":  # results from before the option existed ran at a constant rate
        train_plan["schedule"] = args.schedule
    # Left out of the signature: a result stands under a higher floor when its run trained past it.
    signed_plan, holds = dict(train_plan), feature_vlm.holds_under_min_steps(args.min_steps if args.patience else None)
    train_plan["min_steps"] = args.min_steps
    settings = shared_settings(args, f, lm_cfg, signed_plan)
    views = {"": {"grid": f.grid}, **{k: {"grid": v} for k, v in train.items() if k.startswith("grid@")}}
    context = feature_vlm.JobContext(
        tower_cfg=f.tower_cfg, lm_cfg=lm_cfg, in_dim=in_dim, max_len=f.max_len, seeds=args.seeds, stage0={},
        stage1_steps=args.stage1_steps, jobs=jobs, tune_seeds=args.seeds[:args.tune_seeds],
        views={k.removeprefix("grid"): v for k, v in views.items()},
        snapshots=(str(out / "snapshots"), store.signature({**settings, "plan": train_plan})),  # a killed run resumes
        plan={**train_plan, "eval_batch": args.eval_batch})  # a setting of speed, left out of the signatures
    arrays = {name: {k: v for k, v in split.items() if not k.startswith("grid")} for name, split in f.splits.items()}
    stage0_loss = {}

    def ensure_stage0():  # trained the first time some run needs it
        for seed in args.seeds if args.stage0_steps > 0 and not context["stage0"] else ():
            t0 = time.perf_counter()
            context["stage0"][seed], stage0_loss[seed] = feature_vlm.stage0(
                context, lm_cfg, train["ids"], f.tokenizer.pad_id, args.stage0_steps, args.batch_size, args.stage0_lr,
                seed)
            print(f"stage 0, seed {seed}: {args.stage0_steps} LM steps on the questions' text, final loss "
                  f"{stage0_loss[seed]:.3f} ({time.perf_counter() - t0:.0f} s)")

    def run_cells(fn, keys, path, signature, desc, seeds, steps_per_seed):
        return store.run_cells(path, signature, keys, fn, arrays, context, args.workers, desc,
                               len(seeds) * steps_per_seed, seeds, before=ensure_stage0, holds=holds)

    # The tuning seeds' list left out, as the main seeds': more train only the new ones (a result ``holds``
    # rejects, e.g. under a raised --min_steps, is trained again, as in run_cells).
    tune_sig = functools.partial(signing.tuning_signature, settings, args.seeds[0], jobs)
    context["tune_log"] = (str(out / "tuning_seeds.jsonl"), tune_sig)  # each tuning seed as it ends
    context["tune_done"] = store.seed_results([out / "tuning.jsonl", out / "tuning_seeds.jsonl"], tune_sig, holds)
    tuned, chosen = tune_families(args, jobs, kept_tuning(args, holds) if args.interim else run_cells, out, tune_sig)
    context["chosen"] = chosen
    print(f"(lr, warmup) per {'family and token count' if args.tune_each_budget else 'family'} (validation, seeds "
          f"{args.seeds[:args.tune_seeds]}, {len(tuned)} tuning points): {chosen}")

    # Each finished seed of an unfinished job too, so that a stopped sweep loses one seed's run.
    cells_sig, context["seeds_done"] = signing.main_stage_signer(
        [out / "cells.jsonl", out / "seeds.jsonl"], settings, chosen, {**jobs, **same}, rewrite=not args.interim,
        holds=holds)
    context["seed_log"] = (str(out / "seeds.jsonl"), cells_sig)
    costs = {key: cell_jobs.costs(None if key[0] == BLIND else job["connector"], lm_cfg, in_dim,
                                  context["views"][job["view"]]["grid"], key[1], f.max_len - 1)
             for key, job in jobs.items()}
    if args.interim:
        results = {key: by_seed for key, by_seed in context["seeds_done"].items() if key in jobs}
        print(f"interim: the seeds finished so far of {len(results)} of the {len(jobs)} jobs")
        out = out / "interim"
        out.mkdir(exist_ok=True)
    else:
        order = longest_first(jobs, {k: c["connector_mflops"] + c["lm_mflops"] for k, c in costs.items()}, tuned,
                              {k: len(set(args.seeds) - set(context["seeds_done"].get(k, {}))) for k in jobs})
        results = run_cells(cell_jobs.job, order, out / "cells.jsonl", cells_sig, "token budget", args.seeds,
                            args.stage1_steps + args.steps)
    rows, curves = result_rows(args, plan, same, results, chosen, costs)

    shown = f.tower_dir.resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown  # no machine paths in results
    if not stage0_loss and (out / "setup.json").is_file():  # every cell was reused: so is stage 0's record
        stage0_loss = json.loads((out / "setup.json").read_text()).get("stage0_final_loss", {})
    tuning = {}  # {"family@tokens": {"lr/warmup": validation accuracy, the tuning seeds' mean}}
    for (family, tokens, x, w), res in sorted(tuned.items()):
        tuning.setdefault(f"{family}@{tokens}", {})[f"{x:g}/{w}"] = float(
            np.mean([res[s]["accuracy"] for s in args.seeds[:args.tune_seeds]]))
    setup = {"tower": str(shown), "tower_fingerprint": f.fingerprint, "tower_config": f.tower_cfg, "data": f.data,
             "image_size": f.image_size, "grid": list(f.grid), "lm": args.lm, "plan": train_plan,
             "stage0_lr": args.stage0_lr,
             "tune_lrs": args.tune_lrs, "tune_warmups": args.tune_warmups, "tune_budget": args.tune_budget,
             "tune_seed": args.seeds[0], "chosen": {fam: list(v) for fam, v in chosen.items()},
             "chosen_given": args.chosen is not None, "tuning": tuning,
             "stage0_steps": args.stage0_steps, "stage0_final_loss": stage0_loss, "stage1_steps": args.stage1_steps,
             "seeds": args.seeds, "param_budget": args.param_budget, "param_tokens": args.param_tokens,
             "connectors": {"|".join(map(str, k)): v for k, v in {**jobs, **same}.items()}, "tokenizer": args.tokenizer,
             "vocab_size": f.tokenizer.vocab_size, "max_len": f.max_len, "train_images": len(train["patches"]),
             "train_questions": len(train["ids"]), "val_questions": len(val["ids"]),
             "test_questions": len(test["ids"]), "workers": args.workers,
             "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"), "command": outputs.command()}
    if args.tune_each_budget or args.tune_seeds > 1:  # (absent: tuned at tune_budget on tune_seed alone)
        setup.update(tune_each_budget=args.tune_each_budget, tune_seeds=args.seeds[:args.tune_seeds])
    if args.interim:
        setup["interim"] = dict(runs=sum(len(set(by_seed) & set(args.seeds)) for by_seed in results.values()),
                                of=len(jobs) * len(args.seeds))
    timed = [r["wall_s"] for cells in (tuned, results) for by_seed in cells.values() for r in by_seed.values()
             if "wall_s" in r]
    setup.update(worker_hours=round(sum(timed) / 3600, 2), runs_timed=len(timed))
    summary = report.summarise(rows)
    outputs.write_rows(rows, out / "runs.csv")
    (out / "curves.json").write_text(json.dumps(curves) + "\n")
    (out / "token_budget.md").write_text(tables.to_markdown(summary, setup))
    (out / "setup.json").write_text(json.dumps(setup, indent=1, default=str) + "\n")
    plots.plot(summary, out, curves)
    print((out / "token_budget.md").read_text())
    print(f"wrote {out}/runs.csv, curves.json, token_budget.md, *.png, setup.json")
    return out


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
