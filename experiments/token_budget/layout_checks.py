"""What ``layouts`` refuses before it compares sweeps: a folder that is not a finished sweep (no
``runs.csv`` or ``setup.json``, or an ``--interim`` one with pending cells), a layout or folder named
twice, and sweeps made under different settings.

Sweeps of different layouts differ by design in their data (and so in their question counts, vocabulary
and longest question), in the tower trained on that data, in the rates tuning chose there, and in
which rows they ran (families, token counts, seeds, equal-parameter and encoder-side rows: the cut
keeps what they share). Everything else that shapes a run must match (``SAME``): the LM, the training
plan, stage 0 and stage 1, the tokenizer, the tuning protocol (whether the rates were tuned on the
layout or given with ``--chosen``, and how) and the image size and patch grid the tower gives the
connectors.
"""

from __future__ import annotations

import json
import pathlib

from experiments.token_budget import report

# setup.json's keys that must match across the compared sweeps (sweep.py writes them); a dict is
# compared key by key, so a refusal names e.g. ``plan.max_steps``. ``tune_each_budget`` and
# ``tune_seeds`` are written only when not the default (absent in both: the same protocol);
# ``chosen_given``: the rates were given with ``--chosen``, not tuned on the layout's own validation split.
SAME = ("lm", "plan", "stage0_steps", "stage0_lr", "stage1_steps", "tokenizer", "chosen_given", "tune_lrs",
        "tune_warmups", "tune_budget", "tune_seed", "tune_each_budget", "tune_seeds", "image_size", "grid")


def load(folder: pathlib.Path) -> tuple[list[dict], dict]:
    """A finished sweep's ``runs.csv`` rows and ``setup.json``; SystemExit (one line) for anything else."""
    if not (folder / "runs.csv").is_file():
        raise SystemExit(f"{folder} has no runs.csv: a sweep writes it when every job has finished.")
    if not (folder / "setup.json").is_file():
        raise SystemExit(f"{folder} has no setup.json: a finished sweep writes it beside runs.csv, and layouts "
                         "needs it to check that the sweeps were made under the same settings.")
    setup = json.loads((folder / "setup.json").read_text())
    rows = report.read_runs(folder / "runs.csv")
    pending = sum(r["status"] == "pending" for r in rows)
    if "interim" in setup or pending:
        done = setup.get("interim", {})
        runs = f"{done['runs']} of {done['of']} runs" if "runs" in done else f"{pending} cells pending"
        raise SystemExit(f"{folder} is an interim sweep ({runs}): layouts compares finished sweeps.")
    return rows, setup


def distinct(pairs: list[list[str]]) -> str | None:
    """Why ``LAYOUT=FOLDER`` pairs cannot be compared as given (a name or folder twice), or None."""
    names = [name for name, _ in pairs]
    folders = [pathlib.Path(folder).resolve() for _, folder in pairs]
    twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if twice:
        return f"name each layout once: {', '.join(twice)} given more than once."
    same = [str(f) for f in dict.fromkeys(folders) if folders.count(f) > 1]
    return f"give each sweep once: {', '.join(same)} named by more than one layout." if same else None


def _settings(setup: dict) -> dict:
    """``SAME``'s keys of a setup, dicts flattened one level (``plan.max_steps``)."""
    out = {}
    for key in SAME:
        value = setup.get(key)
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def check_same(setups: dict[str, dict]) -> None:
    """SystemExit naming the first setting in which a sweep differs from the first one, and both values."""
    (first, base), *rest = setups.items()
    a = _settings(base)
    for name, setup in rest:
        b = _settings(setup)
        for key in dict.fromkeys([*a, *b]):
            if a.get(key) != b.get(key):
                raise SystemExit(f"{first} and {name} differ in {key}: {a.get(key)} vs {b.get(key)}; layouts "
                                 "compares sweeps made with the same LM, plan, stages, tokenizer, tuning and grid "
                                 "(only the data, the tower and the chosen rates may differ).")
