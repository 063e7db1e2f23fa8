"""What the token-budget sweep's rows are signed with, so that a rerun reuses exactly the runs made
with its settings: the settings every run shares (``shared``) and each row's own. A main-stage job's
rows hold its family's (lr, warmup), not every family's choice, so adding or dropping families,
``--no_blind`` or a subset of families reuses every finished cell whose own rate is unchanged; a
tuning point's rows hold the first seed. A job whose connector departs from the default plan
(``--native_widths``) is signed with its connector config too, here and in its mid-run snapshots'
names (``jobs``); the default plan's signatures and snapshot names are as they were.

Rows made when one signature held every family's rate (``legacy``) are re-signed by the sweep's
next sitting (``main_stage_signer``), and those of a finished sweep from its ``setup.json`` by

    python -m experiments.token_budget.signing results/token_budget results/token_budget/horizon
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

from experiments.token_budget import tune
from vitmm.study import store

LEGACY_NOTE = "signed by every family's rate (before each cell had its own signature)"


def shared(*, tower: str, data: str, lm: dict, plan: dict, stage0_lr: float, stage0_steps: int, stage1_steps: int,
           splits: tuple[int, int, int], max_len: int, tokenizer: str) -> dict:
    """The settings every run of a sweep shares: the tower's fingerprint, the data, the LM (with
    its vocabulary), the training plan as signed, stage 0 and 1, the questions per split (train,
    val, test), the sequence length and the tokenizer."""
    train, val, test = splits
    return dict(tower=tower, data=data, lm=lm, plan=plan, stage0_lr=stage0_lr, stage0_steps=stage0_steps,
                stage1_steps=stage1_steps, train=train, val=val, test=test, max_len=max_len, tokenizer=tokenizer)


def from_setup(setup: dict) -> dict:
    """``shared`` as a finished sweep's ``setup.json`` records it."""
    return shared(tower=setup["tower_fingerprint"], data=setup["data"], lm=dict(vocab_size=setup["vocab_size"],
                                                                                 **setup["lm"]),
                  plan={k: v for k, v in setup["plan"].items() if k != "min_steps"},  # a floor, left out (``holds``)
                  stage0_lr=setup["stage0_lr"], stage0_steps=setup["stage0_steps"], stage1_steps=setup["stage1_steps"],
                  splits=(setup["train_questions"], setup["val_questions"], setup["test_questions"]),
                  max_len=setup["max_len"], tokenizer=setup["tokenizer"])


def cell_signature(settings: dict, chosen: dict, jobs: dict, key) -> str | None:
    """A main-stage job's rows: the shared settings, the (lr, warmup) its family runs at and, where
    its connector departs from the default plan, that connector (None: a job this sweep has not)."""
    job = jobs.get(tuple(key))
    if job is None:
        return None
    family, tokens, _ = key
    return store.signature({**settings, "rate": list(tune.rate(chosen, family, tokens)), **job.get("signed", {})})


def tuning_signature(settings: dict, tune_seed: int, jobs: dict, key) -> str:
    """A tuning point's rows ``(family, tokens, lr, warmup)``: the shared settings, the first seed
    and, where the family's connector departs from the default plan, that connector."""
    job = jobs.get((key[0], key[1], ""), {})
    return store.signature({**settings, "tune_seed": tune_seed, **job.get("signed", {})})


def legacy(settings: dict, chosen: dict) -> str:
    """The one signature of every main-stage row before each job had its own: every family's rate."""
    return store.signature({**settings, "chosen": chosen})


def main_stage_signer(paths, settings: dict, chosen: dict, jobs: dict, rewrite: bool, holds=None):
    """``(signer, every finished seed {key: {seed: result}})`` of the main stage, whose rows are in
    ``paths``. Rows signed the ``legacy`` way under these settings and rates are re-signed first
    (``rewrite``), or, for ``--interim`` beside a sitting that may still sign them that way, read
    as they are and nothing is written."""
    signer = functools.partial(cell_signature, settings, chosen, jobs)
    old = legacy(settings, chosen)
    if rewrite and (moved := store.resign(paths, old, signer)):
        print(f"re-signed {moved} rows {LEGACY_NOTE}")
    found = {} if rewrite else store.seed_results(paths, old, holds)
    for key, by_seed in store.seed_results(paths, signer, holds).items():
        found.setdefault(key, {}).update(by_seed)
    return signer, found


def resign_finished(out: pathlib.Path) -> int:
    """Re-signs the ``legacy`` rows of the finished sweep in ``out`` (its ``cells.jsonl`` and
    ``seeds.jsonl``) from its ``setup.json``; returns how many rows changed."""
    setup = json.loads((out / "setup.json").read_text())
    settings = from_setup(setup)
    signer = functools.partial(cell_signature, settings, setup["chosen"], jobs_of(setup))
    return store.resign([out / "cells.jsonl", out / "seeds.jsonl"], legacy(settings, setup["chosen"]), signer)


def jobs_of(setup: dict) -> dict:
    """A finished sweep's jobs ``{(family, tokens, variant): job}`` from its ``setup.json``, with the
    rows that read another's runs (their runs of their own, from before, are signed too)."""
    jobs = {}
    for name, job in setup["connectors"].items():
        family, tokens, variant = name.split("|", 2)
        jobs[(family, int(tokens), variant)] = job
    return jobs


def main(argv=None) -> None:
    folders = [pathlib.Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not folders:
        raise SystemExit("name the finished sweeps' folders, e.g. python -m experiments.token_budget.signing "
                         "results/token_budget results/token_budget/horizon")
    for out in folders:
        if not (out / "setup.json").is_file():
            raise SystemExit(f"{out} has no setup.json: a sweep still running re-signs its own rows at its next "
                             "sitting (run its command again); name finished sweeps' folders here.")
        print(f"{out}: re-signed {resign_finished(out)} rows {LEGACY_NOTE}")


if __name__ == "__main__":
    main()
