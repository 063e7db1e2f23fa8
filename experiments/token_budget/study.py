"""The token-budget study on any inputs: connectors × visual-token budgets × seeds where every run
is a ``vitmm.train`` run of a VLM config, so the tower, the LM, the data and the evaluator are the
config's (a converted or trained tower, an LM from scratch or converted from HF/GGUF, frozen or with
LoRA, scenes or LLaVA/webdataset/parquet data, the ``qa`` evaluator, the held-out loss, or any
lmms-eval task run through ``vitmm.serve``).

    python -m experiments.token_budget --config experiments/token_budget/configs/smollm2_frozen.py
    python -m experiments.token_budget --config experiments/token_budget/configs/llava.py \\
        --set train_args=steps=2000 --set "overrides={'input.data_path': 'data.json', ...}"
    python -m experiments.token_budget --config FILE --interim   # the report of the runs finished so far

One file is one study (``experiments/token_budget/configs/``; its docstring lists the keys). Each
family's learning rate is the best of ``tune.lrs`` at ``tune.budget`` tokens and the first seed
on ``tune.overrides``' split (ties: the smaller rate); then every family × budget × seed runs at
its rate on ``test_overrides``' split, and a ``blind`` row per seed (``blind_args``: the config's
no-image baseline, pool at the largest budget, pool's rate) unless ``blind_args`` is empty. A
requested budget is turned into each family's knob by ``connectors.resolve`` on the tower's grid
(a family that cannot come within ``max_ratio`` of it is listed as unreachable).

Each finished run is kept in ``OUT/cells.jsonl`` (tuning: ``OUT/tuning.jsonl``) under the
signature of the study's settings (``vitmm.study.store``): rerunning the same command skips it (a
cell's run only at its family's current rate; tuning and the report read only the study's budget,
rates, cells and seeds), more seeds train only the new ones, and a run killed mid-way resumes from
its last checkpoint in ``WORKDIRS/<run>``, whose checkpoints are deleted once its row is saved
(unless ``keep_checkpoints``). ``OUT/tower.json`` pins the tower: a study there with another tower
is refused, and so is tuning on the test split (``tune.overrides`` naming the same split as
``test_overrides``) unless ``--tune_on_test``. Writes ``runs.csv`` (per run: the metric and its
per-kind parts, the visual tokens, the connector's parameters and compiled FLOPs, the LM's forward
FLOPs, milliseconds per training example, peak host memory, wall time), ``REPORT.md`` (``report``:
the tuning grid, means ± 95% CIs over seeds with tests paired by seed against blind (without blind:
every pair of families), costs, for exact-match metrics with question kinds the token-budget sweep's
spread and claim tests, and a Verdicts table of all its tests corrected together (Holm; a metric
where lower is better: the rows' tests Holm-adjusted among themselves, no Verdicts table)) and
``setup.json``.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import pathlib
import shutil
import time

import numpy as np

from experiments.common import train_run
from experiments.token_budget import study_args
from experiments.token_budget.study_report import BLIND, report
from vitmm import config_args
from vitmm.study import outputs, store

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ the study
def load(path: str, overrides: dict | None = None):
    """The study config ``path[:arg]`` with ``overrides`` (``{key: value}``, ``study_args.apply``) applied."""
    path, _, arg = str(path).partition(":")
    try:
        config = config_args.load(path, arg or None)
    except ValueError as err:  # a bad config arg
        study_args.fail(str(err))
    return study_args.apply(config, overrides or {}, pathlib.Path(path).name)


def train_config(study, args: str, overrides: dict):
    """The ``vitmm.train`` config one run of the study trains (its file, args and overrides)."""
    path = ROOT / study.train_config if not pathlib.Path(study.train_config).is_absolute() else study.train_config
    return config_args.load(path, args, **overrides)


def tower_grid(config, need_lm: bool = True) -> tuple[tuple[int, int], dict, dict | None]:
    """``(grid, tower settings, LM settings)`` of a VLM run's config (read from ``init.vision`` and
    ``init.lm`` where they point at checkpoints, as the trainer does); without ``need_lm`` (a
    report of finished runs) the LM's folder is not read and its settings are None."""
    from vitmm.models.vit import ViT
    from vitmm.train import vlm_start

    lm_dir = config.init.get("lm")
    if not need_lm and lm_dir and not (pathlib.Path(lm_dir) / "checkpoints").is_dir():
        config = config.copy_and_resolve_references()
        with config.unlocked():
            config.init.lm = None
        vision, _ = vlm_start.vlm_parts(config)
        return tuple(ViT(**vision).grid((config.input.image_size,) * 2)), vision, None
    vision, lm_cfg = vlm_start.vlm_parts(config)
    size = config.input.image_size
    return tuple(ViT(**vision).grid((size, size))), vision, lm_cfg


def plan(study, grid) -> tuple[list[dict], list[tuple]]:
    """The cells ``{family, budget, setting, tokens, note}`` (each requested budget of each family,
    the setting its knob takes to come nearest; setting None: unreachable) and the rows the
    tables list as unreachable."""
    from vitmm.models import connectors

    cells, unreachable = [], []
    for family in study.families:
        for budget in study.budgets:
            setting, tokens, note = connectors.resolve(family, budget, grid, study.max_ratio)
            if setting is None:
                unreachable.append((family, budget, note))
            else:
                cells.append(dict(family=family, budget=budget, setting=setting, tokens=tokens, note=note))
    return cells, unreachable


def _args(study, connector: str, setting, blind: bool = False) -> str:
    """The train config's args for one run: the study's, the connector, its knob, the steps, and
    the blind and smoke args where they apply."""
    parts = [study.train_args, f"connector={connector}", f"budget={setting}", f"steps={study.steps}",
             study.blind_args if blind else "", study.smoke_args if study.smoke else ""]
    return ",".join(p for p in parts if p)


def dotted(tree) -> dict:
    """``{"a.b": value}`` from a nested ConfigDict or dict (the trainer's ``--config.a.b=value``);
    None values are left out (the train config's own value stands)."""
    tree = tree.to_dict() if hasattr(tree, "to_dict") else dict(tree)
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in dotted(value).items()})
        elif value is not None:
            flat[key] = value
    return flat


def run_overrides(study, lr: float, seed: int, split: dict) -> dict:
    return {**dotted(study.overrides), "optim.lr": lr, "seed": seed, **split}


# ------------------------------------------------------------------------------------ one run
def run(study, name: str, args: str, overrides: dict, workdirs: pathlib.Path) -> dict:
    """One ``python -m vitmm.train`` run (resumed from its checkpoint when it was stopped), and
    its row: the final evaluation's ``study.metric`` and the metrics under ``study.kinds``, the
    training speed, the last training loss, wall time and the process's peak memory."""
    workdir = workdirs / name
    summary, lines = train_run.train(f"{study.train_config}:{args}", workdir,
                                     [f"--config.{k}={v}" for k, v in overrides.items()], name)
    evals = [x for x in lines if study.metric in x]
    last = evals[-1] if evals else {}
    if study.lmms_eval.tasks:  # the trained run through vitmm.serve, scored by lmms-eval
        from vitmm import lmms_task

        lm = study.lmms_eval
        last = {**last, **lmms_task.evaluate(workdir, workdir / "lmms_eval", lm.tasks, lm.include_path or None,
                                             lm.python, lm.model_args)}
    if study.metric not in last:
        raise SystemExit(f"{workdir} has no {study.metric!r}: set the study's metric to one its evaluators write "
                         f"({sorted({k for x in [*lines, last] for k in x if '/' in k})[:8]}).")
    row = dict(run=name, lm=study.lm_label, **summary)
    if study.examples_key:
        row["qa_examples"] = int(last.get(study.examples_key, 0))
    row["accuracy"] = round(last[study.metric], 4)
    for kind in study.kinds:
        row[f"acc_{kind}"] = round(last.get(f"{study.kinds_prefix}{kind}", float("nan")), 4)
    return row


def drop_checkpoints(study, name: str, workdirs: pathlib.Path) -> None:
    """Deletes a run's checkpoints once its row is saved (not before: a study killed between the two
    would find a workdir without checkpoints, which the trainer refuses to train over)."""
    if not study.keep_checkpoints:
        shutil.rmtree(workdirs / name / "checkpoints", ignore_errors=True)


def with_costs(rows: list[dict], settings: dict, grid, vision: dict, lm_cfg: dict | None, text_len: int) -> list[dict]:
    """``rows`` with each cell's cost: milliseconds per training example (the trainer's logged
    speed), the connector's parameters and FLOPs (XLA's count of the lowered program; blind: pool's, on blank
    images) and the LM's forward FLOPs per example at its visual tokens and ``text_len`` text
    positions (left out without the LM's settings: a report made where its folder is absent)."""
    from experiments.token_budget.jobs import costs

    cache, out = {}, []
    for r in rows:
        extra = {"ms_per_example": round(1e3 / float(r["img_per_s"]), 2) if float(r.get("img_per_s") or 0) else None}
        if lm_cfg is not None:
            family, tokens = r["family"], int(r["tokens"])
            if (family, tokens) not in cache:
                connector = {"name": "pool" if family == BLIND else family, "budget": settings[(family, tokens)]}
                cache[(family, tokens)] = costs(connector, lm_cfg, vision["width"], grid, tokens, text_len)
            extra.update(cache[(family, tokens)])
        out.append({**r, **extra})
    return out


# ------------------------------------------------------------------------------------ the report
def choose_lrs(tuned: list[dict], families, higher: bool) -> dict:
    """``{family: lr}``: the best tuning score per family (ties: the smaller rate)."""
    best = {}
    for r in tuned:
        score = float(r["accuracy"]) if higher else -float(r["accuracy"])
        key = (score, -float(r["lr"]))
        if r["family"] in families and key > best.get(r["family"], ((-np.inf, 0), 0))[0]:
            best[r["family"]] = (key, float(r["lr"]))
    return {f: lr for f, (_, lr) in best.items()}


def refuse_tuning_on_test(study, tune_split: dict, test_split: dict) -> None:
    """Stops a study whose tuning would read the split its families are compared on: the same
    ``split_key`` value (both unset, e.g. the LLaVA config's defaults, included) or, without a split
    key, the same overrides."""
    key = study.split_key
    if (tune_split.get(key) == test_split.get(key)) if key else tune_split == test_split:
        shown = f"{key}={test_split.get(key)!r}" if key else f"overrides {test_split}"
        raise SystemExit(f"tune.overrides and test_overrides name the same split ({shown}): the rates would be tuned "
                         f"on the questions the families are compared on; set tune.overrides to a validation split "
                         f"(--set tune.overrides.{key or 'KEY'}=...) or pass --tune_on_test to tune there knowingly.")


# ------------------------------------------------------------------------------------ the sweep
def write_report(study, out: pathlib.Path) -> pathlib.Path:
    """``--report``: the study's Markdown again from its ``runs.csv`` (tuning runs are those named
    ``tune_*``) and ``setup.json`` (the chosen rates, the token grid): a report whose wording or tests
    changed, on the committed runs."""
    missing = [name for name in ("runs.csv", "setup.json") if not (out / name).is_file()]
    if missing:
        raise SystemExit(f"--report: {out} has no {' or '.join(missing)}; a study that has finished writes them.")
    with open(out / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    setup = json.loads((out / "setup.json").read_text())
    tuned = [r for r in rows if r["run"].startswith("tune_")]
    _, unreachable = plan(study, tuple(setup["grid"]))
    (out / study.report).write_text(report(study, tuned, [r for r in rows if r not in tuned], setup["chosen"],
                                           unreachable))
    print(f"wrote {out / study.report} from runs.csv and setup.json")
    return out / study.report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the study's config file[:arg]")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a study config value (a Python literal, or a string), e.g. --set seeds=(0,1); under "
                             "overrides, tune.overrides and test_overrides: any key of the train config")
    parser.add_argument("--out", default=None, help="the results folder (default: the study's out)")
    parser.add_argument("--workdirs", default=None, help="the runs' workdirs (default: the study's workdirs)")
    parser.add_argument("--interim", action="store_true",
                        help="train nothing: the report of the runs finished so far in OUT/interim/ (the study's "
                             "settings from OUT/setup.json once a sitting has finished; before: repeat --set)")
    parser.add_argument("--tune_on_test", action="store_true",
                        help="allow tune.overrides to name the test split (the rates then chosen on the questions "
                             "the families are compared on)")
    parser.add_argument("--report", action="store_true",
                        help="train nothing, read no model: OUT/REPORT.md again from a finished study's runs.csv "
                             "and setup.json")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    return args, overrides


def main(argv=None) -> pathlib.Path:
    args, overrides = parse_args(argv)
    study = load(args.config, overrides)
    out = pathlib.Path(args.out or ROOT / study.out)
    workdirs = pathlib.Path(args.workdirs or ROOT / study.workdirs)
    higher = study.higher_is_better
    saved = study_args.saved(out, overrides) if args.interim or args.report else None  # read-only: as it ran
    study = saved or study
    if args.report:
        return write_report(study, out)
    if args.interim and saved is None and not any((out / f).is_file() for f in ("tuning.jsonl", "cells.jsonl")):
        study_args.fail(f"--interim: {out} has no setup.json yet (a study writes it when it finishes) and no finished "
                        f"runs: repeat the study's --set flags (and --out) with --interim.")
    study_args.check(study, train_config(study, _args(study, study.families[0], study.budgets[0]), {}), args.config)
    test_split, tune_split = dotted(study.test_overrides), dotted(study.tune.overrides)
    if len(study.tune.lrs) > 1 and not args.tune_on_test and not args.interim:
        refuse_tuning_on_test(study, tune_split, test_split)

    base = train_config(study, _args(study, study.families[0], study.budgets[0]), dotted(study.overrides))
    grid, vision, lm_cfg = tower_grid(base, need_lm=not args.interim)
    cells, unreachable = plan(study, grid)
    if not cells:
        raise SystemExit(f"No family reaches any of the budgets {tuple(study.budgets)} on the {grid} grid: "
                         + "; ".join(f"{f}@{b}: {n}" for f, b, n in unreachable))
    text_len = int(base.model.get("max_len", 0))
    settings = dict(train_config=study.train_config, train_args=study.train_args, blind_args=study.blind_args,
                    overrides=dotted(study.overrides), metric=study.metric, steps=study.steps, smoke=study.smoke)
    if study.lmms_eval.tasks:  # only then, so that the signatures of studies without it stay as they were
        settings["lmms_eval"] = dict(tasks=study.lmms_eval.tasks, include_path=study.lmms_eval.include_path,
                                     model_args=study.lmms_eval.model_args)
    test_sig = store.signature({**settings, "split": test_split})
    tune_sig = store.signature({**settings, "split": tune_split})
    if not args.interim:
        out.mkdir(parents=True, exist_ok=True)
        if base.init.get("vision"):
            from vitmm import checkpoint as ckpt_lib

            tower = pathlib.Path(base.init.vision)
            store.check_tower(out, tower, ckpt_lib.load_params(tower))

    def cell_row(cell: dict, seed: int, lr: float, name: str, split: dict, blind: bool = False) -> dict:
        connector = "pool" if blind else cell["family"]
        row = run(study, name, _args(study, connector, cell["setting"], blind), run_overrides(study, lr, seed, split),
                  workdirs)
        row.update(family=BLIND if blind else cell["family"], budget=cell["budget"], tokens=cell["tokens"], seed=seed,
                   lr=lr, split=split.get(study.split_key, ""), status="ok", variant="")
        return row

    def kept(path: pathlib.Path, sig: str) -> dict:
        return store.seed_results([path], sig)

    # Tuning: every family at tune.budget with every rate, the first seed.
    tuned_rows, chosen = [], {f: study.tune.lrs[0] for f in study.families}
    tune_cells = [c for c in cells if c["budget"] == study.tune.budget]
    if len(study.tune.lrs) > 1:
        done, seed = kept(out / "tuning.jsonl", tune_sig), study.seeds[0]
        for cell in tune_cells:
            for lr in study.tune.lrs:
                key = (cell["family"], cell["budget"], lr)
                if seed not in done.get(key, {}) and not args.interim:
                    row = cell_row(cell, seed, lr, f"tune_{cell['family']}_{cell['budget']}_lr{lr:g}", tune_split)
                    store.save_cell(out / "tuning.jsonl", tune_sig, key, {seed: row})
                    drop_checkpoints(study, row["run"], workdirs)
                    done.setdefault(key, {})[seed] = row
        # Only this tuning's runs: tune.budget, tune.lrs and the first seed (not an earlier grid's or seed's).
        tuned_rows = [done[key][seed] for key in ((c["family"], c["budget"], lr) for c in tune_cells
                                                  for lr in study.tune.lrs) if seed in done.get(key, {})]
        complete = len(tuned_rows) == len(tune_cells) * len(study.tune.lrs)
        chosen = choose_lrs(tuned_rows, study.families, higher) if complete else {}
        if not complete and not args.interim:
            raise SystemExit("tuning did not finish every family and rate")
    print(f"learning rate per family: {chosen}", flush=True)

    # The grid, largest budgets first, then blind per seed: each run at its family's rate (a row kept at
    # another rate, e.g. before tune.lrs changed, is not this cell's) and only the study's cells and seeds.
    done = kept(out / "cells.jsonl", test_sig)
    todo = [(cell, seed) for seed in study.seeds for cell in sorted(cells, key=lambda c: -c["budget"])
            if cell["family"] in chosen]
    largest = max((c for c in cells if c["family"] == "pool"), key=lambda c: c["budget"], default=None)
    if study.blind_args:
        from vitmm.models import connectors

        budget = max(study.budgets)
        setting, tokens, note = connectors.resolve("pool", budget, grid, study.max_ratio)
        largest = dict(family=BLIND, budget=budget, setting=setting, tokens=tokens, note=note)
    rows = []
    for cell, seed in todo + ([(largest, seed) for seed in study.seeds] if study.blind_args and chosen else []):
        blind = cell["family"] == BLIND
        key = (cell["family"], cell["budget"])
        lr = chosen.get("pool", chosen[study.families[0]]) if blind else chosen[cell["family"]]
        row = done.get(key, {}).get(seed)
        if (row is None or float(row["lr"]) != lr) and not args.interim:
            name = f"blind_{cell['budget']}_s{seed}" if blind else f"{cell['family']}_{cell['budget']}_s{seed}"
            name += "" if row is None else f"_lr{lr:g}"  # not the workdir of the run at the other rate
            row = cell_row(cell, seed, lr, name, test_split, blind)
            store.save_cell(out / "cells.jsonl", test_sig, key, {seed: row})
            drop_checkpoints(study, name, workdirs)
        if row is not None and float(row["lr"]) == lr:
            rows.append(row)
    knobs = {(c["family"], c["tokens"]): c["setting"] for c in cells}
    if study.blind_args and largest is not None:
        knobs[(BLIND, largest["tokens"])] = largest["setting"]
    rows = with_costs(rows, knobs, grid, vision, lm_cfg, text_len)
    tuned_rows = with_costs(tuned_rows, knobs, grid, vision, lm_cfg, text_len)

    if args.interim and saved is None and not tuned_rows + rows:
        study_args.fail(f"--interim: {out} has no setup.json yet (a study writes it when it finishes) and no finished "
                        f"runs under these settings: repeat the study's --set flags (and --out) with --interim.")
    target = out / "interim" if args.interim else out
    target.mkdir(parents=True, exist_ok=True)
    if tuned_rows or rows:
        outputs.write_rows(tuned_rows + rows, target / "runs.csv")
    (target / study.report).write_text(report(study, tuned_rows, rows, chosen, unreachable))
    setup = dict(study=study.to_dict(), grid=list(grid), chosen=chosen, settings=settings,
                 date=time.strftime("%Y-%m-%d"), command=outputs.command(argv))
    (target / "setup.json").write_text(json.dumps(setup, indent=1, default=str) + "\n")
    print(f"wrote {target / study.report} from {len(rows)} runs ({len(tuned_rows)} tuning)")
    return target
