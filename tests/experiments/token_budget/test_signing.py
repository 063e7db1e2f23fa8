"""What the token-budget sweep's rows and snapshots are signed with (``signing``): each main-stage
job by its own rate (and its connector where it departs from the default plan), and the committed
rows, signed by every family's rate, moved to that."""

import functools
import json
import pathlib
import shutil

from experiments.common import feature_vlm
from experiments.token_budget import jobs as cell_jobs
from experiments.token_budget import signing, sweep
from vitmm.study import store

ROOT = pathlib.Path(__file__).resolve().parents[3]
SETTINGS = signing.shared(tower="t", data="scenes/easy_64", lm={"width": 64}, plan={"max_steps": 8}, stage0_lr=3e-3,
                          stage0_steps=10, stage1_steps=2, splits=(100, 10, 10), max_len=13, tokenizer="words")


def _plan(*options):
    args = sweep.parse_args(["--budgets", "16", "--param_budget", "0", "--encoder_budgets", "", *options])
    return sweep.plan_jobs(args, (8, 8), 128, 64, {})[1]


def test_a_cell_is_signed_by_its_own_rate_so_other_families_and_blind_do_not_retrain_it():
    """Adding or dropping families, ``--no_blind`` or another family's new rate leaves a cell's
    signature as it was; its own rate, or a connector at another width, changes it."""
    every = _plan("--families", "pool,qformer,perceiver")
    chosen = {"pool": (3e-4, 25), "qformer": (1e-4, 25), "perceiver": (1e-3, 25), "blind": (1e-3, 25)}
    pool = ("pool", 16, "")
    sig = signing.cell_signature(SETTINGS, chosen, every, pool)
    subset = _plan("--families", "pool", "--no_blind")
    assert signing.cell_signature(SETTINGS, {"pool": (3e-4, 25)}, subset, pool) == sig
    assert signing.cell_signature(SETTINGS, {**chosen, "qformer": (3e-4, 25)}, every, pool) == sig
    assert signing.cell_signature(SETTINGS, {**chosen, "pool": (3e-4, 250)}, every, pool) != sig
    assert signing.cell_signature(SETTINGS, chosen, subset, ("qformer", 16, "")) is None  # not this sweep's job
    native = _plan("--families", "pool,qformer,perceiver", "--native_widths")
    assert native[pool] == every[pool] and signing.cell_signature(SETTINGS, chosen, native, pool) == sig
    qformer = ("qformer", 16, "")
    assert every[qformer]["connector"] == {"name": "qformer", "budget": 16, "width": 128}
    assert native[qformer] == {"connector": {"name": "qformer", "budget": 16}, "view": "",
                               "signed": {"connector": {"name": "qformer", "budget": 16}}}
    assert (signing.cell_signature(SETTINGS, chosen, native, qformer)
            != signing.cell_signature(SETTINGS, chosen, every, qformer))
    tuning = ("qformer", 16, 1e-4, 25)
    assert signing.tuning_signature(SETTINGS, 0, every, tuning) == store.signature({**SETTINGS, "tune_seed": 0})
    assert signing.tuning_signature(SETTINGS, 0, native, tuning) != signing.tuning_signature(SETTINGS, 0, every, tuning)


def test_snapshot_names_of_the_default_plan_are_as_before_and_other_widths_get_their_own(tmp_path):
    """A running sweep's mid-run snapshots are named by (settings, key, seed, lr, warmup) as before,
    so they still resume; a connector at its native width never resumes a tower-width run's."""
    every, native = _plan("--families", "qformer"), _plan("--families", "qformer", "--native_widths")
    key = ("qformer", 16, "")

    def name(jobs, *identity):
        context = {"snapshots": (str(tmp_path), "sig"), "jobs": jobs}
        return feature_vlm.snapshot_path(context, *identity, *cell_jobs._departs(context, key))

    assert name(every, key, 0, 1e-4, 25) == tmp_path / f"{store.signature(['sig', key, 0, 1e-4, 25])}.pkl"
    assert name(every, "tuning", (*key[:2], 1e-4, 25), 0) == tmp_path / (
        store.signature(["sig", "tuning", (*key[:2], 1e-4, 25), 0]) + ".pkl")
    assert name(native, key, 0, 1e-4, 25) != name(every, key, 0, 1e-4, 25)


def test_rows_signed_by_every_familys_rate_are_re_signed_at_the_next_sitting_or_read_by_interim(tmp_path):
    chosen = {"pool": (3e-4, 25), "blind": (1e-3, 25)}
    jobs = _plan("--families", "pool")
    paths = [tmp_path / "cells.jsonl", tmp_path / "seeds.jsonl"]
    store.save_cell(paths[1], signing.legacy(SETTINGS, chosen), ("pool", 16, ""), {0: {"accuracy": 0.8}})
    store.save_cell(paths[1], signing.legacy(SETTINGS, {**chosen, "pool": (1e-3, 25)}), ("pool", 16, ""),
                    {1: {"accuracy": 0.1}})  # another rate's run: not this cell's
    before = paths[1].read_text()
    signer, found = signing.main_stage_signer(paths, SETTINGS, chosen, jobs, rewrite=False)
    assert found == {("pool", 16, ""): {0: {"accuracy": 0.8}}} and paths[1].read_text() == before
    signer, found = signing.main_stage_signer(paths, SETTINGS, chosen, jobs, rewrite=True)
    assert found == {("pool", 16, ""): {0: {"accuracy": 0.8}}} and not paths[0].exists()
    assert [json.loads(line)["signature"] for line in paths[1].read_text().splitlines()] == [
        signer(("pool", 16, "")), json.loads(before.splitlines()[1])["signature"]]


def test_the_committed_sweeps_rows_are_re_signed_from_their_setup(tmp_path):
    """The migration of a finished sweep (the committed results were migrated by it on 2026-12-07):
    the main stage's and the longer horizon's rows, signed back to every family's rate, move to their
    job's own signature, the committed one (a second run finds nothing to move), and each job finds
    all its seeds under it."""
    for name, jobs, runs in (("", 39, 195), ("horizon", 3, 9)):  # (38 jobs and the Perceiver row run before it
        # was known to be its default's)
        out = tmp_path / (name or "main")
        out.mkdir()
        setup = json.loads((ROOT / "results/token_budget" / name / "setup.json").read_text())
        legacy = signing.legacy(signing.from_setup(setup), setup["chosen"])
        shutil.copy(ROOT / "results/token_budget" / name / "setup.json", out / "setup.json")
        committed = {}
        for file in ("cells.jsonl", "seeds.jsonl"):  # the rows of the families its setup.json chose rates for (a
            # later sitting's rows, e.g. horizon's other families while they run, wait for their own setup.json)
            committed[file] = "".join(line + "\n" for line in (ROOT / "results/token_budget" / name / file).read_text()
                                      .splitlines() if json.loads(line)["key"][0] in setup["chosen"])
            rows = [{**json.loads(line), "signature": legacy} for line in committed[file].splitlines()]
            (out / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
        rows = sum(len(text.splitlines()) for text in committed.values())
        assert signing.resign_finished(out) == rows and signing.resign_finished(out) == 0
        for file, text in committed.items():
            assert [json.loads(x) for x in (out / file).read_text().splitlines()] == \
                [json.loads(x) for x in text.splitlines()]
        every_key = functools.partial(signing.cell_signature, signing.from_setup(setup), setup["chosen"],
                                      signing.jobs_of(setup))
        found = store.seed_results([out / "cells.jsonl", out / "seeds.jsonl"], every_key)
        seeds = setup["seeds"]
        assert len(found) == jobs and sum(len(by_seed) for by_seed in found.values()) == runs
        assert all(sorted(by_seed) == seeds for by_seed in found.values())


def test_lr_without_tuning_leaves_stage0_and_the_signatures_at_the_presets_rate():
    """``--lr`` sets the connector and joint phases' rate only: stage 0's LM is the tuned sweeps'
    (``--stage0_lr``, the preset's 3e-3), so the shared settings, and the signatures of results made
    before the option existed, are unchanged."""
    from types import SimpleNamespace

    f = SimpleNamespace(fingerprint="t", data="scenes/easy_64", max_len=13,
                        splits={name: {"ids": [0] * n} for name, n in (("train", 100), ("val", 10), ("test", 10))})

    def settings(*options):
        return sweep.shared_settings(sweep.parse_args(list(options)), f, {"width": 64}, {"max_steps": 8})

    no_tuning = sweep.parse_args(["--lr", "3e-4"])
    assert no_tuning.tune_lrs == [3e-4] and no_tuning.tune_warmups == [25] and no_tuning.stage0_lr == 3e-3
    assert settings("--lr", "3e-4") == settings() and settings()["stage0_lr"] == 3e-3
    assert settings("--stage0_lr", "1e-3")["stage0_lr"] == 1e-3
