"""The token-budget experiment: budget resolution, and a smoke sweep that writes every output."""

import argparse
import csv
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from experiments.common import feature_vlm
from experiments.common import tower as tower_lib
from experiments.token_budget import jobs as cell_jobs
from experiments.token_budget import plots, report, sweep, tables, tune
from experiments.token_budget.views import encoder_views
from vitmm.models import connectors
from vitmm.study import stats as study_stats
from vitmm.study import store

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def tb():
    return sweep


def test_tower_is_trained_unless_its_workdir_has_the_final_checkpoint(tb, tmp_path, monkeypatch):
    from vitmm.train import trainer

    calls = []
    monkeypatch.setattr(trainer, "train", lambda config, workdir: calls.append((config, workdir)))
    from vitmm import checkpoint as ckpt_lib

    monkeypatch.setattr(ckpt_lib, "load_config", lambda workdir: {"total_steps": 4})
    tower_lib.ensure_tower(tmp_path / "w", smoke=True, data_dir=str(tmp_path / "tfds"))
    (config, workdir), = calls  # configs/clip_scenes.py:smoke on the given data_dir
    assert workdir == tmp_path / "w" and config.total_steps == 4 and config.input.image_size == 32
    assert config.input.data_dir == str(tmp_path / "tfds")
    (tmp_path / "w" / "checkpoints" / "2").mkdir(parents=True)  # stopped half-way: trained on (it resumes)
    tower_lib.ensure_tower(tmp_path / "w", smoke=True)
    assert len(calls) == 2
    (tmp_path / "w" / "checkpoints" / "4").mkdir(parents=True)
    tower_lib.ensure_tower(tmp_path / "w", smoke=True)
    assert len(calls) == 2


def test_the_pinned_tower_is_the_trained_image_tower_and_counts_as_finished(tb, tmp_path, clip_smoke_run,
                                                                           monkeypatch):
    """OUT/tower, which the results carry: the image tower's exact parameters and the run's
    config at its final step, read by ``--tower`` and never trained again."""
    import numpy as np

    from vitmm import checkpoint as ckpt_lib
    from vitmm.train import trainer

    workdir, out = clip_smoke_run.workdir, tmp_path / "tower"
    tower_lib.pin_tower(workdir, out)
    pinned, trained = ckpt_lib.load_params(out), ckpt_lib.load_params(workdir)
    assert list(pinned) == ["img"] and store.fingerprint(pinned["img"]) == store.fingerprint(trained["img"])
    np.testing.assert_array_equal(pinned["img"]["embedding"]["kernel"], trained["img"]["embedding"]["kernel"])
    assert ckpt_lib.load_config(out) == ckpt_lib.load_config(workdir)
    monkeypatch.setattr(trainer, "train", lambda *a: pytest.fail("a pinned tower was trained again"))
    tower_lib.ensure_tower(out, smoke=True)


@pytest.mark.slow  # ~60 s of two cores: its pieces (budgets, tuning, tables, claims, resume) are tested alone below
def test_smoke_sweep_writes_tables_and_plots(tb, tmp_path, clip_smoke_run, capsys):
    """A whole sweep end to end on the session's smoke CLIP (features, two worker processes,
    outputs; training the tower when a workdir has none is the same ``trainer.train``)."""
    out = tmp_path / "tb"
    # The workers pick their own thread settings; only the tests' compile level is passed on.
    env = dict(os.environ, XLA_FLAGS=os.environ.get("VITMM_TEST_XLA_FLAGS", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.token_budget", "--smoke", "--workers", "2", "--out", str(out),
         "--tower", str(clip_smoke_run.workdir), "--data_dir", clip_smoke_run.data_dir],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "runs.csv")))
    setup = json.loads((out / "setup.json").read_text())
    grid = tuple(setup["grid"])
    assert grid == (4, 4)
    seeds = {r["seed"] for r in rows if r["status"] == "ok"}
    assert seeds == {"0", "1"}
    by_key = {(r["family"], r["budget"]): r for r in rows}
    by_key = {(r["family"], r["budget"]): r for r in rows if r["variant"] == ""}
    assert by_key[("mlp", "4")]["status"] == "unreachable"
    assert by_key[("patch_merger", "9")]["tokens"] == "16" and "nearest to 9" in by_key[("patch_merger", "9")]["note"]
    assert by_key[("blind", "0")]["status"] == "ok"
    plan = setup["plan"]
    for r in rows:
        if r["status"] != "ok":
            continue
        assert 0.0 <= float(r["accuracy"]) <= 1.0
        assert float(r["train_ms"]) > 0 and float(r["infer_ms"]) > 0 and float(r["lm_mflops"]) > 0
        # Early stopping: the tested parameters are those of a validation check, within the cap.
        assert 0 <= int(r["best_step"]) <= int(r["steps_trained"]) <= plan["max_steps"]
        assert int(r["best_step"]) % plan["eval_every"] == 0 or int(r["best_step"]) == int(r["steps_trained"])
        if r["family"] == "blind":
            continue
        assert int(r["connector_params"]) > 0
        if r["family"] == "pool" and r["variant"] == "":  # pool's budget→stride: the row's count is what it produces
            assert connectors.num_visual_tokens({"name": "pool", "budget": int(r["tokens"])}, grid) == int(r["tokens"])
    # LM cost grows with the visual tokens it reads.
    pool = {int(r["tokens"]): float(r["lm_mflops"]) for r in rows if r["family"] == "pool" and r["status"] == "ok"}
    assert pool[4] < pool[16]
    # Equal parameters: every family with a size knob at the same count, within 15%.
    sized = [r for r in rows if r["variant"].startswith("params")]
    assert {r["family"] for r in sized} == {"pool", "patch_merger"}  # mlp cannot reach 4 tokens
    assert all(abs(int(r["connector_params"]) / setup["param_budget"] - 1) < 0.15 for r in sized)
    # Encoder side: mlp on all patches of a 16-px image or of 16-px patches reaches the same 4 tokens.
    enc = {r["variant"]: r for r in rows if r["variant"].startswith(("image", "patch"))}
    assert set(enc) == {"image 16 px", "patch 16"} and all(r["tokens"] == "4" for r in enc.values())
    curves = json.loads((out / "curves.json").read_text())
    assert len(curves) == len({(r["family"], r["tokens"], r["variant"]) for r in rows if r["status"] == "ok"}) * 2
    for curve in curves.values():
        assert curve[0][0] == 0 and all(0 <= a <= 1 for _, a in curve)
    table = (out / "token_budget.md").read_text()
    assert "| mlp | 4 | unreachable" in table and "| patch_merger | 9 | 16 (nearest to 9) |" in table
    assert "Spread across connectors at equal token counts" in table and "| pool | 4: " in table
    assert "| vs blind |" in table and "paired by seed" in table
    assert "At equal parameters" in table and "| 4 | encoder: image 16 px |" in table
    assert "More tokens help fine detail more" in table and "| chosen lr/warmup |" in table
    assert "| learn color_at | learn shape_at | learn relative | late best | last quarter |" in table
    assert "over the 2 families that ran at every budget (pool, patch_merger) × requested budgets 4, 9, all" in table
    # Every run's seconds add up to the sweep's cost, tuning included; every run trains the whole horizon.
    rows_ok = [r for r in rows if r["status"] == "ok"]  # budgets that reach the same count share a run
    assert setup["runs_timed"] == len({(r["family"], r["tokens"], r["variant"], r["seed"]) for r in rows_ok}) + 8
    assert 0 < setup["worker_hours"] and "worker-hours" in table
    assert f"{plan['max_steps']} joint steps of 16 questions (warmup, then a cosine decay to 0)" in table
    assert all(int(r["steps_trained"]) == plan["max_steps"] for r in rows_ok)  # a fixed horizon: no early stop
    assert all(-1 <= float(r["late_gain"]) <= 1 for r in rows_ok)
    for name in ("accuracy_vs_budget.png", "accuracy_vs_cost.png", "learning_curves.png", "encoder_vs_connector.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Tuning: the lr grid at the first warmup, then the other warmups at the best lr; each family's
    # (lr, warmup) is its best on validation and is used for all its rows.
    tuning = (out / "tuning.jsonl").read_text().splitlines()
    families = {r["family"] for r in rows if r["status"] == "ok" and r["variant"] == ""}
    assert len(tuning) == len(families) * (len(setup["tune_lrs"]) + len(setup["tune_warmups"]) - 1) == 8
    assert set(setup["chosen"]) == families and setup["test_questions"] > 0
    for r in rows:
        if r["status"] == "ok":
            assert [float(r["lr"]), int(r["warmup"])] == setup["chosen"][r["family"]]
    for family, (lr, warmup) in setup["chosen"].items():
        scores = next(v for k, v in setup["tuning"].items() if k.startswith(f"{family}@"))
        assert scores[f"{lr:g}/{warmup}"] == max(scores.values())

    # Resume: each finished cell is on disk; a rerun after losing one (an interrupted sweep, its
    # seeds lost too) trains only that cell, which, seeded the same, gives the same rows again.
    cells = (out / "cells.jsonl").read_text().splitlines()
    assert len(cells) == len({(r["family"], r["tokens"], r["variant"]) for r in rows if r["status"] == "ok"})
    # The lost cell is one that two requested budgets share (patch_merger at 9 gets 16): named once.
    kept = [c for c in cells if json.loads(c)["key"] != ["patch_merger", 16, ""]]
    assert len(kept) == len(cells) - 1
    (out / "cells.jsonl").write_text("\n".join(kept) + "\n")
    lost = ["patch_merger", 16, ""]
    seed_log = [x for x in (out / "seeds.jsonl").read_text().splitlines() if json.loads(x)["key"] != lost]
    (out / "seeds.jsonl").write_text("\n".join(seed_log) + "\n")
    # --interim meanwhile: the tables of what has finished, the lost cell listed with no seed, nothing trained.
    ok_runs = len({(r["family"], r["tokens"], r["variant"], r["seed"]) for r in rows_ok})
    tb.main(["--smoke", "--interim", "--out", str(out), "--tower", str(clip_smoke_run.workdir), "--data_dir",
             clip_smoke_run.data_dir])
    interim = (out / "interim/token_budget.md").read_text()
    assert f"**Interim: {ok_runs - 2} of {ok_runs} main-stage runs finished**" in interim
    lost_name = f"{lost[0]}@{lost[1]}" + (f" ({lost[2]})" if lost[2] else "")
    assert f"no seed finished yet: {lost_name}." in interim and (out / "interim/accuracy_vs_budget.png").is_file()
    assert "of 2 seeds)" not in interim  # every other cell has both seeds
    assert (out / "cells.jsonl").read_text().splitlines() == kept and not (out / "interim/cells.jsonl").exists()
    capsys.readouterr()
    tb.main(["--smoke", "--workers", "1", "--out", str(out), "--tower", str(clip_smoke_run.workdir), "--data_dir",
             clip_smoke_run.data_dir])  # in this process: the features and stage 0 as compiled for --interim
    stdout = capsys.readouterr().out
    assert f"{len(cells) - 1} cells already done" in stdout and "1 to run" in stdout
    assert "tuning (lr): 4 cells already done" in stdout and "tuning (warmup): 4 cells" in stdout
    assert stdout.count("; 0 to run") == 2 and len((out / "tuning.jsonl").read_text().splitlines()) == 8
    again = list(csv.DictReader(open(out / "runs.csv")))
    accuracy = lambda rs: [(r["family"], r["tokens"], r["variant"], r["seed"], r.get("accuracy")) for r in rs]  # noqa: E731
    assert accuracy(again) == accuracy(rows)


@pytest.mark.slow  # ~15 s more of the sweep; the horizon report's pairing and tests: test_the_horizon_check_pairs_*
def test_the_longer_horizon_reruns_a_cell_of_a_finished_sweep(tb, tmp_path, clip_smoke_run):
    """The longer-horizon check: pool's cell again at twice the steps, the same stage 0 per seed and
    the sweep's chosen lr/warmup, compared paired by seed."""
    from experiments.token_budget import horizon

    out = tmp_path / "tb"
    tb.main(["--smoke", "--workers", "1", "--out", str(out), "--tower", str(clip_smoke_run.workdir), "--data_dir",
             clip_smoke_run.data_dir, "--families", "pool", "--budgets", "4", "--param_budget", "0",
             "--encoder_budgets", ""])
    setup = json.loads((out / "setup.json").read_text())
    plan = setup["plan"]
    long_out = horizon.main(["--main", str(out), "--out", str(tmp_path / "long"), "--families", "pool", "--budget",
                             "4", "--seeds", "0,1", "--workers", "1", "--smoke", "--tower",
                             str(clip_smoke_run.workdir), "--data_dir", clip_smoke_run.data_dir])
    long_rows = list(csv.DictReader(open(long_out / "runs.csv")))
    assert {(r["family"], r["tokens"], r["seed"]) for r in long_rows} == {("pool", "4", "0"), ("pool", "4", "1")}
    assert all(int(r["steps_trained"]) == 2 * plan["max_steps"] for r in long_rows)
    long_setup = json.loads((long_out / "setup.json").read_text())
    assert long_setup["chosen"] == {"pool": setup["chosen"]["pool"]} and long_setup["chosen_given"]
    assert horizon.differences(setup, long_setup) == []
    md = (long_out / "horizon.md").read_text()
    assert f"| all at {plan['max_steps']:,} | all at {2 * plan['max_steps']:,} |" in md and "| pool | 4 | 2 |" in md


@pytest.mark.slow  # 30-36 s; test_the_image_reaches_the_lm_and_beats_blind_where_only_it_answers checks the same in 3
def test_the_image_reaches_the_lm(tmp_path):
    """With a tower whose features tell images apart, a connector beats blind: it fits the training
    questions better and answers an image-dependent kind better on the test questions. The
    session's 4-step smoke CLIP cannot show this (its patch features vary across images by 5% of
    their size; the demo tower's by 93%), so this sweep reads the tower the token-budget results
    pin (``results/token_budget/tower``, the demo's) on a 256-image build of its 64-px scenes and
    runs pool at 4 tokens and blind at a 2-layer LM's scale for 200 steps (at 200 steps pool's
    training loss sat 0.11 under blind's and it gained 34 points on colour-at-location; at 400,
    0.20 and 60)."""
    sweep.main(["--smoke", "--workers", "1", "--out", str(tmp_path / "tb"), "--tower",
                str(ROOT / "results/token_budget/tower"), "--data", "scenes/easy_64_256_64_64_s0", "--data_dir",
                str(tmp_path / "tfds"), "--families", "pool", "--budgets", "4", "--steps", "200", "--eval_every", "50",
                "--patience", "100", "--lr", "1e-3", "--param_budget", "0", "--encoder_budgets", "", "--seeds", "0",
                "--lm_width", "64", "--lm_depth", "2", "--batch_size", "32"])
    rows = {r["family"]: r for r in csv.DictReader(open(tmp_path / "tb/runs.csv"))}
    pool, blind = rows["pool"], rows["blind"]
    assert float(pool["final_loss"]) < float(blind["final_loss"]) - 0.05, (pool["final_loss"], blind["final_loss"])
    gains = {k: float(pool[f"acc_{k}"]) - float(blind[f"acc_{k}"]) for k in ("exists", "count", "color_at",
                                                                              "shape_at", "relative")}
    assert max(gains.values()) >= 0.15, gains


def test_stage0_pretraining_learns_the_questions_text(tb):
    """Stage 0 trains the LM on text alone: on a tiny fixed corpus its loss falls far below the
    uniform guess, its parameters come back as numpy, and the same seed gives the same LM."""
    import jax
    import numpy as np

    ids = np.array([[1, 5, 6, 7, 2, 0], [1, 5, 8, 9, 2, 0], [1, 6, 6, 7, 9, 2]], np.int32)
    lm_cfg = dict(vocab_size=12, width=16, depth=1, num_heads=2)
    params, loss = feature_vlm.pretrain_lm(lm_cfg, ids, pad_id=0, steps=60, batch_size=8, lr=1e-2, seed=0)
    assert loss < 0.5 * np.log(12)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
    again, _ = feature_vlm.pretrain_lm(lm_cfg, ids, pad_id=0, steps=60, batch_size=8, lr=1e-2, seed=0)
    jax.tree.map(np.testing.assert_array_equal, params, again)


def test_a_restarted_sweep_reads_stage0_instead_of_training_it_again(tb, tmp_path, monkeypatch):
    import jax
    import numpy as np

    ids = np.array([[1, 5, 6, 7, 2, 0], [1, 5, 8, 9, 2, 0]], np.int32)
    lm_cfg = dict(vocab_size=12, width=16, depth=1, num_heads=2)
    context = {"snapshots": (str(tmp_path), "settings")}
    first = feature_vlm.stage0(context, lm_cfg, ids, 0, 3, 2, 1e-2, seed=1)
    monkeypatch.setattr(feature_vlm, "pretrain_lm", lambda *a, **k: pytest.fail("stage 0 trained again"))
    again = feature_vlm.stage0(context, lm_cfg, ids, 0, 3, 2, 1e-2, seed=1)
    jax.tree.map(np.testing.assert_array_equal, first[0], again[0])
    assert first[1] == again[1]
    with pytest.raises(pytest.fail.Exception, match="trained again"):  # another seed (or settings) is its own
        feature_vlm.stage0(context, lm_cfg, ids, 0, 3, 2, 1e-2, seed=2)


def test_stage1_trains_the_connector_alone_from_the_stage0_lm(tb):
    """Stage 1 updates the connector and leaves the (stage-0) LM exactly as it was; the joint
    step then trains both."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    lm_cfg = dict(vocab_size=12, width=16, depth=1, num_heads=2)
    ids = np.array([[1, 5, 6, 7, 2, 0], [1, 5, 8, 9, 2, 0]], np.int32)
    stage0, _ = feature_vlm.pretrain_lm(lm_cfg, ids, pad_id=0, steps=3, batch_size=2, lr=1e-2, seed=0)
    tower = dict(width=8, depth=1, mlp_dim=16, num_heads=2, patch_size=8)
    run = feature_vlm.FeatureTrainer(tower, {"name": "linear"}, lm_cfg, (2, 2), 8, 6, steps=2, lr=1e-2,
                                     stage0={0: stage0}, stage1_steps=3)
    params, _ = run.init(0)
    jax.tree.map(np.testing.assert_array_equal, params["language"], stage0)
    patches = jax.random.normal(jax.random.key(0), (2, 4, 8))
    mask = jnp.asarray((ids > 0) & (np.arange(6) >= 3), jnp.float32)
    before = jax.tree.map(np.asarray, params)
    after, state = params, run.stage1_tx.init(params)
    for _ in range(2):  # the schedule's first step has learning rate 0
        after, state, _ = run.stage1_step(after, state, patches, jnp.asarray(ids), mask)
    jax.tree.map(np.testing.assert_array_equal, after["language"], before["language"])
    assert not np.allclose(after["project"]["proj"]["kernel"], before["project"]["proj"]["kernel"])
    joint, state = after, run.tx.init(after)
    for _ in range(2):
        joint, state, _ = run.step(joint, state, patches, jnp.asarray(ids), mask)
    assert not np.allclose(joint["language"]["token_embedding"]["embedding"], stage0["token_embedding"]["embedding"])


def test_tables_show_95_percent_intervals_and_seed_paired_tests_against_blind(tb):
    import numpy as np
    from scipy import stats

    kinds = {f"acc_{k}": 0.5 for k in tb.KINDS}
    rows = [{"family": f, "budget": b, "tokens": t, "note": "", "lr": 1e-3, "seed": seed, "status": "ok",
             "accuracy": acc, "train_ex_s": 1.0, "infer_ex_s": 1.0, **kinds}
            for f, b, t, accs in (("blind", 0, 1, (0.40, 0.42, 0.41)), ("pool", 16, 16, (0.50, 0.55, 0.49)),
                                  ("linear", 16, 16, (0.45, 0.47, 0.48)))
            for seed, acc in enumerate(accs)]
    summary = {s["family"]: s for s in report.summarise(rows)}
    pool = np.array([0.50, 0.55, 0.49])
    assert summary["pool"]["accuracy_ci"] == pytest.approx(stats.t.ppf(0.975, 2) * pool.std(ddof=1) / np.sqrt(3))
    diff, p = summary["pool"]["vs_blind"]
    assert diff == pytest.approx(pool.mean() - 0.41)
    assert p == pytest.approx(stats.ttest_rel(pool, [0.40, 0.42, 0.41]).pvalue)
    assert summary["blind"]["vs_blind"] is None
    spread = next(line for line in tables.spread_lines(list(summary.values())) if line.startswith("| 16 |"))
    assert spread.startswith("| 16 | 2 | pool 51.3 | linear 46.7 | 4.7 |")
    assert f"| {stats.ttest_rel(pool, [0.45, 0.47, 0.48]).pvalue:.2g} |" in spread
    # One seed (an --interim cell) has no interval: its mean is shown alone, not "± nan".
    one = report.summarise(rows[3:4])[0]
    assert tables.mean_ci(one, "accuracy") == "50.0" and tables.mean_ci(summary["pool"], "accuracy") == (
        f"51.3 ± {100 * summary['pool']['accuracy_ci']:.1f}")


def _tiny_run(tb, lr, max_steps, stage1_steps=0):
    import numpy as np

    lm_cfg = dict(vocab_size=12, width=16, depth=1, num_heads=2)
    tower = dict(width=8, depth=1, mlp_dim=16, num_heads=2, patch_size=8)
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.ones((40, 1)), rng.integers(3, 12, (40, 4)), np.full((40, 1), 2)], 1).astype(np.int32)
    split = {"patches": rng.normal(size=(10, 4, 8)).astype(np.float32), "image": np.arange(40) % 10, "ids": ids,
             "answer_mask": (np.arange(6) >= 4)[None].repeat(40, 0).astype(np.float32), "kind": np.arange(40) % 5}
    run = feature_vlm.FeatureTrainer(tower, {"name": "linear"}, lm_cfg, (2, 2), 8, 6, steps=max_steps, lr=lr,
                         stage1_steps=stage1_steps)
    return run, split


def test_scoring_in_small_padded_batches_gives_the_same_result(tb):
    """``eval_batch`` (the smoke presets take 64) is a setting of speed: 40 questions in batches of
    7, the last padded with 2, score exactly as in one batch of 500, per kind and on a subset."""
    import numpy as np

    run, split = _tiny_run(tb, lr=3e-2, max_steps=30)
    split["in_first"] = np.arange(40) < 13
    params, opt_state = run.init(0)
    rng = np.random.default_rng(0)
    for _ in range(30):  # some questions right, some wrong: a lost or miscounted padding would show
        params, opt_state, _ = run.step(params, opt_state, *feature_vlm._batch(split, rng.integers(40, size=8)))
    whole = feature_vlm.evaluate(run, params, split)
    assert 0 < whole["accuracy"] < 1 and 0 < whole["acc_first"] < 1, whole
    assert feature_vlm.evaluate(run, params, split, eval_batch=7) == whole
    assert feature_vlm.evaluate(run, params, split, limit=11, eval_batch=4) == feature_vlm.evaluate(
        run, params, split, limit=11)


def test_training_stops_when_validation_accuracy_stops_rising_and_tests_the_best_check(tb):
    """With a learning rate of 0 nothing improves: the run stops after `patience` checks, and the
    tested parameters are the initial ones (the best check, step 0)."""
    run, split = _tiny_run(tb, lr=0.0, max_steps=100)
    plan = dict(max_steps=100, batch_size=4, eval_every=5, patience=3, min_delta=0.01, curve_questions=20)
    result = feature_vlm.train_and_eval(run, 0, split, split, split, plan)
    assert result["steps_trained"] == 15 and result["best_step"] == 0
    assert [s for s, _ in result["curve"]] == [0, 5, 10, 15]
    params, _ = run.init(0)
    assert result["accuracy"] == feature_vlm.evaluate(run, params, split)["accuracy"]
    # Not before min_steps: the same run waits until step 25 (a plateau early on is not the end).
    floored = feature_vlm.train_and_eval(run, 0, split, split, split, dict(plan, min_steps=23))
    assert floored["steps_trained"] == 25 and floored["best_step"] == 0 and floored["min_steps"] == 23
    # A run that keeps improving goes to the cap; it is scored at its best check.
    run, split = _tiny_run(tb, lr=3e-2, max_steps=30)
    result = feature_vlm.train_and_eval(run, 0, split, split, split, dict(plan, max_steps=30, min_delta=-1.0))
    assert result["steps_trained"] == 30 and result["best_step"] == 30 and result["curve"][-1][0] == 30


def test_a_run_killed_mid_way_resumes_from_its_snapshot_to_the_uninterrupted_result(tb, tmp_path):
    """A sweep stopped in the middle of a long run keeps what the run had done: it resumes from the
    snapshot of its last evaluation (parameters, Adam moments, best check, curve, losses and the
    data order) and ends exactly where a run that was never stopped ends."""
    run, split = _tiny_run(tb, lr=3e-2, max_steps=30, stage1_steps=3)
    plan = dict(max_steps=30, batch_size=4, eval_every=5, patience=10, min_delta=0.0, curve_questions=20)
    straight = feature_vlm.train_and_eval(run, 0, split, split, split, plan)

    class Kill(Exception):
        pass

    class Progress:
        def __init__(self, kill_at=None):
            self.steps, self.kill_at = 0, kill_at

        def update(self, k):
            self.steps += k
            if self.kill_at is not None and self.steps >= self.kill_at:
                raise Kill

    snap = tmp_path / "snapshots" / "run.pkl"
    with pytest.raises(Kill):  # 3 stage-1 steps + 17 joint steps: the last snapshot is step 15's
        feature_vlm.train_and_eval(run, 0, split, split, split, plan, progress=Progress(kill_at=3 + 17),
                                  snapshot=snap, snapshot_every_s=0.0)
    assert snap.is_file() and [p.name for p in snap.parent.iterdir()] == ["run.pkl"]  # no temporary left
    progress = Progress()
    resumed = feature_vlm.train_and_eval(run, 0, split, split, split, plan, progress=progress, snapshot=snap,
                                        snapshot_every_s=0.0)
    assert resumed.pop("wall_s") > 0 and straight.pop("wall_s") > 0  # seconds: the only difference
    assert resumed == straight and straight["steps_trained"] == 30
    assert progress.steps == 3 + 30 and not snap.exists()  # the bar counts the resumed steps; the file is gone
    # The snapshot's name is the run's identity under the sweep's settings; none without a folder.
    c = {"snapshots": (str(tmp_path), "sig")}
    names = {feature_vlm.snapshot_path(c, ("mlp", 4, ""), s, 1e-3, 25) for s in (0, 1)}
    assert len(names) == 2 and feature_vlm.snapshot_path({}, ("mlp", 4, ""), 0, 1e-3, 25) is None


def test_a_stored_run_stands_under_a_higher_min_steps_only_if_it_trained_past_it(tb, tmp_path):
    """Raising --min_steps keeps the finished runs the new floor would not change (those that
    trained at least that long, the stop rule never having fired sooner) and reruns the others."""
    holds = feature_vlm.holds_under_min_steps(5000)
    assert holds({"steps_trained": 5000}) and holds({"steps_trained": 9750, "min_steps": 0})
    assert not holds({"steps_trained": 4750}) and not holds({"steps_trained": 1750, "min_steps": 1000})
    assert holds({"steps_trained": 5250, "min_steps": 5000}) and holds({"steps_trained": 6000, "min_steps": 5000})
    assert not holds({"steps_trained": 9000, "min_steps": 6000})  # a higher floor may have run on past the stop
    path = tmp_path / "tuning.jsonl"
    store.save_cell(path, "sig", ("ldp", 16, 3e-4, 25), {0: {"steps_trained": 3250}})
    store.save_cell(path, "sig", ("ldp", 16, 1e-3, 25), {0: {"steps_trained": 6000}})
    keys = [("ldp", 16, 3e-4, 25), ("ldp", 16, 1e-3, 25)]
    assert list(store.finished(path, "sig", keys, [0], holds)) == keys[1:]
    assert list(store.finished(path, "sig", keys, [0])) == keys
    # Without early stopping (patience 0, in the signature) the floor is never read: any result holds.
    assert feature_vlm.holds_under_min_steps(None)({"steps_trained": 8000, "min_steps": 5000})








def test_a_run_whose_loss_is_not_finite_stops_naming_the_first_bad_step(tb):
    """Losses reach the host once per evaluation (no sync per step); a NaN is still reported at
    the step it appeared: a NaN learning rate leaves step 1's loss finite and makes step 2's NaN."""
    run, split = _tiny_run(tb, lr=float("nan"), max_steps=10)
    plan = dict(max_steps=10, batch_size=4, eval_every=5, patience=3, min_delta=0.01, curve_questions=20)
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 2 \(.*linear.*, seed 0\)"):
        feature_vlm.train_and_eval(run, 0, split, split, split, plan)


def test_choose_takes_the_best_validation_accuracy_then_the_smaller_lr_and_warmup(tb):
    tuned = {("pool", 16, 1e-3, 25): {0: {"accuracy": 0.6}}, ("pool", 16, 3e-3, 25): {0: {"accuracy": 0.7}},
             ("pool", 16, 3e-3, 250): {0: {"accuracy": 0.7}}, ("mlp", 64, 1e-2, 25): {0: {"accuracy": 0.5}},
             ("mlp", 64, 3e-3, 250): {0: {"accuracy": 0.5}}}
    assert tune.choose(tuned) == {"pool": (3e-3, 25), "mlp": (3e-3, 250)}


def test_encoder_views_reach_the_budget_by_a_smaller_image_or_larger_patches(tb):
    import jax
    import numpy as np

    from vitmm.models.vit import ViT

    cfg = dict(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=8, posemb="learn", pool="gap", class_token=False)
    params = ViT(**cfg).init(jax.random.key(0), np.zeros((1, 64, 64, 3), np.float32))["params"]
    views = encoder_views(cfg, params, 64, (8, 8), [16, 4, 9])
    assert sorted(views) == [4, 16]  # 9 tokens: no integer scale of an 8×8 grid
    for tokens, named in views.items():
        assert sorted(named) == sorted([f"image {({16: 32, 4: 16})[tokens]} px",
                                        f"patch {({16: 16, 4: 32})[tokens]}"])
        for _, tower, p, size in named.values():
            _, out = tower.apply({"params": p}, np.zeros((2, size, size, 3), np.float32))
            assert out["patch_tokens"].shape == (2, tokens, 16)  # the learned table resampled to the grid


def test_the_encoder_table_counts_each_views_tower_flops_as_xla_does(tb):
    """The encoder-side table's tower column, read from a row's variant name, is within 3% of XLA's
    count of that view's own forward (the analytic count leaves out norms and activations), at the
    sweep's tower size: the full grid, a smaller image and larger patches."""
    import jax
    import numpy as np

    from vitmm.models.vit import ViT

    cfg = dict(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="gap", class_token=False,
               posemb="sincos2d")
    setup = dict(tower_config=cfg, image_size=64)
    params = ViT(**cfg).init(jax.random.key(0), np.zeros((1, 64, 64, 3), np.float32))["params"]
    views = {"": ("full", ViT(**cfg), params, 64)}
    for named in encoder_views(cfg, params, 64, (8, 8), [16, 4]).values():
        views.update(named)
    assert len(views) == 5
    counted = {}
    for variant, (_, tower, p, size) in views.items():
        x = np.zeros((1, size, size, 3), np.float32)
        cost = jax.jit(lambda p, x, tower=tower: tower.apply({"params": p}, x)).lower(p, x).compile().cost_analysis()
        xla = (cost[0] if isinstance(cost, list) else cost)["flops"] / 1e6
        counted[variant] = tables.tower_mflops(setup, variant)
        assert abs(counted[variant] / xla - 1) < 0.03, (variant, counted[variant], xla)
    assert counted[""] > 3.5 * max(v for k, v in counted.items() if k)  # a quarter of the tokens or fewer


def test_claim_tests_on_known_numbers(tb):
    """Honeybee's grouped comparison and the fine-detail gain, on rows whose answers are known."""
    import numpy as np
    from scipy import stats

    def row(family, tokens, seed, spatial, global_):
        kinds = {f"acc_{k}": (spatial if k in report.SPATIAL else global_) for k in tb.KINDS}
        return {"family": family, "budget": tokens, "tokens": tokens, "note": "", "lr": 1e-3, "warmup": 25,
                "seed": seed, "status": "ok", "accuracy": 0.5, **kinds}

    loc = {4: [0.50, 0.52, 0.55], 16: [0.70, 0.71, 0.76]}  # pool: spatial accuracy per seed
    query = {4: [0.40, 0.45, 0.44], 16: [0.50, 0.52, 0.50]}  # perceiver
    rows = [row("pool", t, k, loc[t][k], 0.6) for t in (4, 16) for k in range(3)]
    lift = np.array([0.01, 0.012, 0.014])  # perceiver's global kinds gain this per seed at 16 tokens
    rows += [row("perceiver", t, k, query[t][k], 0.6 + lift[k] * (t == 16)) for t in (4, 16) for k in range(3)]
    summary = report.summarise(rows)
    diff = np.array(loc[16]) - np.array(query[16])
    mean, ci, p = report.group_test(summary, 16, report.SPATIAL)
    assert mean == pytest.approx(diff.mean()) and p == pytest.approx(stats.ttest_1samp(diff, 0).pvalue)
    assert report.group_test(summary, 16, report.GLOBAL)[0] == pytest.approx(-0.012)
    # Per seed: mean over the two families of (spatial gain − global gain), 4 → 16 tokens.
    detail = ((np.array(loc[16]) - loc[4]) + (np.array(query[16]) - query[4] - lift)) / 2
    mean, _, p = report.detail_test(summary)
    assert mean == pytest.approx(detail.mean()) and p == pytest.approx(stats.ttest_1samp(detail, 0).pvalue)
    lines = "\n".join(tables.claim_lines(summary))
    assert "Honeybee, 16 tokens, spatial kinds" in lines and f"{100 * diff.mean():+.1f}" in lines
    assert "locality-preserving (pool) − learned-query (perceiver) = " in lines  # the families tested, no others
    # Each line shows its unadjusted p, and no second, partial correction: the report's Verdicts table
    # gives the one adjusted p of each test.
    p = report.group_test(summary, 16, report.SPATIAL)[2]
    line = next(x for x in lines.splitlines() if "16 tokens, spatial" in x)
    assert line.endswith(f"(p={p:.2g})") and "Holm" not in line
    # Kind by kind, to read the groups: each spatial kind here carries the whole spatial difference.
    row16 = next(x for x in lines.splitlines() if x.startswith("| 16 | "))
    p16 = stats.ttest_1samp(diff, 0).pvalue
    cell = f"{100 * diff.mean():+.1f} ± {100 * study_stats.ci95(diff):.1f} (p={p16:.2g})"
    assert row16.count(cell) == len(report.SPATIAL) and "| -1.2 ± " in row16


def test_seed_outcomes_count_the_seeds_that_learn_a_kind_and_late_best_checks(tb):
    """A kind learned by some seeds only: counted per cell against blind's mean + the margin; the
    last quarter's validation gain read off each seed's curve."""
    import numpy as np

    curve = [[0, 0.3], [250, 0.5], [500, 0.6], [750, 0.62], [1000, 0.65]]
    assert report.late_gain(curve) == pytest.approx(0.65 - 0.62)  # 750 = 75% of 1000
    assert report.late_gain([[0, 0.3], [300, 0.5], [600, 0.6], [900, 0.7]]) == pytest.approx(0.7 - 0.6)

    def row(family, seed, color_at, best_step=500, late=0.01):
        kinds = {f"acc_{k}": 0.5 for k in tb.KINDS} | {"acc_color_at": color_at}
        return {"family": family, "budget": 16, "tokens": 16, "note": "", "lr": 1e-3, "warmup": 25, "seed": seed,
                "status": "ok", "accuracy": 0.5, "best_step": best_step, "steps_trained": 1000, "late_gain": late,
                **kinds}

    rows = [row("blind", k, c) for k, c in enumerate((0.17, 0.19, 0.18))]  # blind mean 18% → bar 28%
    rows += [row("c_abstractor", k, c, b) for k, (c, b) in enumerate(((0.62, 1000), (0.279, 750), (0.29, 800)))]
    rows += [row("perceiver", k, c, late=g) for k, (c, g) in enumerate(((0.75, 0.02), (0.74, 0.04), (0.18, 0.0)))]
    rows += [dict(r, budget="all") for r in rows if r["family"] == "perceiver"]  # two budgets, one count: one run
    got = report.learned(report.summarise(rows))
    assert len(got["cells"]) == 2  # a run is counted once, whichever budgets reached its token count
    assert got["bar"]["color_at"] == pytest.approx(0.28) and got["bar"]["shape_at"] == pytest.approx(0.60)
    counts = {s["family"]: n for s, n in got["cells"]}
    assert counts == {"c_abstractor": {"color_at": 2, "shape_at": 0, "relative": 0},
                      "perceiver": {"color_at": 2, "shape_at": 0, "relative": 0}}
    lines = tables.seed_lines(report.summarise(rows))
    assert "| c_abstractor | 16 | 3 | 2 | 0 | 0 | 2 | +1.0 ± 0.0 |" in lines  # best at 800 and 1000 > 750
    gains = np.array([0.02, 0.04, 0.0])
    assert f"| perceiver | 16 | 3 | 2 | 0 | 0 | 0 | +2.0 ± {100 * study_stats.ci95(gains):.1f} |" in lines
    assert lines[-1].endswith("locality-preserving: color_at 2/3, shape_at 0/3, relative 0/3; learned-query: "
                              "color_at 2/3, shape_at 0/3, relative 0/3.")
    assert tables.seed_lines(report.summarise(rows[3:])) == []  # no blind yet: no bar to count against


def test_a_run_is_late_by_its_highest_check_not_by_the_checkpoint_it_is_tested_at(tb, tmp_path):
    """``best_step`` moves only on a gain of ``min_delta`` (0.005); a run still making smaller new highs
    in its last quarter is rising all the same. Rows stored before the column read it from curves.json."""
    import json

    from vitmm.study import outputs

    creeping = [[0, 0.3], [250, 0.6], [500, 0.6], [750, 0.603], [1000, 0.604]]  # best_step stays 250
    assert report.peak_step(creeping) == 1000
    assert report.peak_step([[0, 0.3], [250, 0.6], [500, 0.6], [1000, 0.55]]) == 250  # the earliest of equal highs
    base = {"family": "pool", "budget": 16, "tokens": 16, "variant": "", "note": "", "status": "ok",
            "best_step": 250, "steps_trained": 1000, "accuracy": 0.6}
    outputs.write_rows([dict(base, seed=0), dict(base, seed=1), dict(base, family="blind", tokens=1, seed=0)],
                       tmp_path / "runs.csv")
    (tmp_path / "curves.json").write_text(json.dumps({"pool|16||0": creeping, "pool|16||1": creeping[:3]}))
    rows = report.read_runs(tmp_path / "runs.csv")
    assert [r.get("peak_step") for r in rows] == [1000, 250, None]
    assert [report.late(r) for r in rows] == [True, False, False]  # no curve: its best_step, 250 of 1000
    assert report.summarise(rows[:2])[0]["late_best"] == 1


def test_the_horizon_check_pairs_each_seed_with_its_shorter_run():
    """horizon.md on known rows: gains paired by seed, seeds that learn colour-at-location at each
    horizon against the sweep's blind; a setting that differs is named, so nothing unpaired is compared."""
    import numpy as np
    from scipy import stats

    from experiments.token_budget import horizon

    def row(family, seed, acc, color_at, best=4000, steps=8000):
        return {"family": family, "tokens": "16", "variant": "", "seed": str(seed), "status": "ok",
                "accuracy": str(acc), "acc_color_at": str(color_at), "acc_shape_at": "0.7", "best_step": str(best),
                "steps_trained": str(steps)}

    short = [row("pool", k, a, c, b) for k, (a, c, b) in enumerate(((0.80, 0.70, 7000), (0.76, 0.18, 6250),
                                                                     (0.79, 0.60, 5750)))]  # late: > 6,000 of 8,000
    short += [row("blind", k, 0.45, 0.18) for k in range(3)] + [row("pool", 3, 0.5, 0.5)]  # seed 3: not rerun
    long = [row("pool", k, a, c, b, 16000) for k, (a, c, b) in enumerate(((0.82, 0.72, 15000), (0.81, 0.65, 9000),
                                                                           (0.80, 0.61, 12000)))]
    lines = horizon.compare(short, long, (8000, 16000))
    gain = np.array([0.02, 0.05, 0.01])
    p = stats.ttest_1samp(gain, 0).pvalue
    pool = next(line for line in lines if line.startswith("| pool |"))
    assert pool.startswith(f"| pool | 16 | 3 | 78.3 ± {study_stats.ci95(100 * np.array([.80, .76, .79])):.1f} | "
                           f"81.0 ± {study_stats.ci95(100 * np.array([.82, .81, .80])):.1f} | "
                           f"+2.7 ± {100 * study_stats.ci95(gain):.1f} | {p:.2g} |")
    assert pool.endswith("| +0.0 ± 0.0 | 2 → 3 | 2 → 1 |")  # colour_at bar: 18 + 10 points; best check late
    long[1]["peak_step"] = 14000  # its highest check after the one it is tested at (9,000)
    assert next(line for line in horizon.compare(short, long, (8000, 16000))
                if line.startswith("| pool |")).endswith("| 2 → 2 |")
    setup = {"tower_fingerprint": "a", "data": "d", "lm": {}, "stage0_final_loss": {"0": 1.0, "4": 2.0},
             "plan": {"batch_size": 32, "max_steps": 8000}}
    assert horizon.differences(setup, dict(setup, plan={"batch_size": 32, "max_steps": 16000})) == []
    assert horizon.differences(setup, dict(setup, stage0_final_loss={"0": 1.5}, plan={"batch_size": 16})) == [
        "stage0_final_loss[0]", "plan.batch_size"]


def test_the_horizon_tests_gaps_among_gap_families_only_and_every_gain():
    """Four families at both horizons: every family's gain is tested, the gaps (at each horizon, and their
    change) only between ``gap_families``: 4 gains + 3 pairs x 3 = 13 tests, not 4 + 6 x 3 = 22."""
    from experiments.token_budget import horizon

    def row(family, seed, acc, steps):
        return {"family": family, "tokens": "16", "variant": "", "seed": str(seed), "status": "ok",
                "accuracy": str(acc), "acc_color_at": "0.5", "acc_shape_at": "0.7", "best_step": "100",
                "steps_trained": str(steps)}

    families = ("pool", "perceiver", "qformer", "c_abstractor")
    short = [row(f, k, 0.6 + 0.01 * i + 0.003 * k * k, 8000) for i, f in enumerate(families) for k in range(3)]
    long = [row(f, k, 0.62 + 0.02 * i + 0.001 * k * i, 16000) for i, f in enumerate(families) for k in range(3)]
    names = [t.name for t in horizon.horizon_tests(short, long, (8000, 16000))]
    assert len(names) == 13 and not [n for n in names if "c_abstractor −" in n or "− c_abstractor" in n]
    assert "c_abstractor@16: 16,000 − 8,000 steps" in names and "pool − qformer at 16,000 steps" in names
    assert len(horizon.horizon_tests(short, long, (8000, 16000), families)) == 22
    verdict = next(line for line in horizon.compare(short, long, (8000, 16000)) if line.startswith("**Verdicts"))
    assert "between pool, perceiver, qformer (`--gap_families`; the others: gains alone)" in verdict


def test_chosen_settings_replace_tuning_and_must_cover_every_family(tb, capsys):
    args = tb.parse_args(["--families", "pool,qformer", "--chosen", "pool=3e-4/25,qformer=1e-4/250,blind=1e-3/25"])
    assert args.chosen == {"pool": (3e-4, 25), "qformer": (1e-4, 250), "blind": (1e-3, 25)}
    for chosen, says in (("pool=3e-4/25,qformer=1e-4/250", "no lr/warmup for ['blind']"),
                         ("pool=3e-4", "cannot read 'pool=3e-4'")):
        with pytest.raises(SystemExit):
            tb.parse_args(["--families", "pool,qformer", "--chosen", chosen])
        assert says in capsys.readouterr().err




def test_the_lr_grid_grows_past_an_edge_only_while_the_edge_wins(tb):
    """A family best at the grid's smallest rate tries the next smaller one (the grid's ratio), at
    most ``max_extra`` past the base grid; an interior best, or an edge that wins by less than
    ``min_gain`` (blind: its rate hardly matters), adds nothing."""
    base = [1e-4, 3e-4, 1e-3, 3e-3]

    def tuned(family, accs):
        return {(family, 16, lr, 25): {0: {"accuracy": a}} for lr, a in accs.items()}

    low, high = ("low", 16), ("high", 16)
    grid = {(f, 16): list(base) for f in ("low", "high", "mid", "flat")}
    results = {**tuned("low", {1e-4: 0.9, 3e-4: 0.85, 1e-3: 0.8, 3e-3: 0.7}),
               **tuned("high", {1e-4: 0.6, 3e-4: 0.7, 1e-3: 0.8, 3e-3: 0.85}),
               **tuned("mid", {1e-4: 0.6, 3e-4: 0.9, 1e-3: 0.8, 3e-3: 0.7}),
               **tuned("flat", {1e-4: 0.446, 3e-4: 0.445, 1e-3: 0.446, 3e-3: 0.444})}
    assert tune.extend_grid(results, grid, base, 2, 0.005) == {low: 3e-5, high: 1e-2}
    grid[low].append(3e-5)
    results.update(tuned("low", {3e-5: 0.95}))
    assert tune.extend_grid(results, {low: grid[low]}, base, 2, 0.005) == {low: 1e-5}
    grid[low].append(1e-5)
    results.update(tuned("low", {1e-5: 0.97}))
    assert tune.extend_grid(results, {low: grid[low]}, base, 2, 0.005) == {}  # two past the grid: enough
    assert tune.extend_grid(results, {high: grid[high]}, base, 0, 0.005) == {}


def test_each_budget_tuned_on_its_own_over_two_seeds(tb):
    """``--tune_each_budget --tune_seeds 2``: a choice per family and token count on the mean of the
    seeds, a grid extended per token count, and each run's rate found by its family and tokens (an
    encoder-side row's at the nearest tuned count)."""
    accuracy = {("pool", 4): {1e-4: 0.4, 3e-4: 0.5}, ("pool", 16): {1e-4: 0.6, 3e-4: 0.5},
                ("blind", 1): {1e-4: 0.3, 3e-4: 0.3}}
    calls = []

    def run_cells(fn, keys, path, signature, desc, seeds, steps):  # seed 1 a little worse: the mean decides
        calls.append((desc, sorted(keys), list(seeds)))
        return {k: {s: {"accuracy": accuracy[k[:2]].get(k[2], 0.55) - 0.01 * s} for s in seeds} for k in keys}

    args = argparse.Namespace(stage1_steps=0, steps=10, tune_budget=16, chosen=None, tune_lrs=[1e-4, 3e-4],
                              tune_warmups=[25], interim=False, tune_extend=1, min_delta=0.005, seeds=[0, 1, 2],
                              tune_each_budget=True, tune_seeds=2)
    jobs = {("pool", 4, ""): {}, ("pool", 16, ""): {}, ("pool", 16, "patch 32"): {}, ("blind", 1, ""): {}}
    tuned, chosen = sweep.tune_families(args, jobs, run_cells, pathlib.Path("unused"), "sig")
    assert [seeds for _, _, seeds in calls] == [[0, 1], [0, 1]]
    # each edge that won, one step past it (the store skips what the first call ran)
    assert sorted(set(calls[1][1]) - set(calls[0][1])) == [("pool", 4, 1e-3, 25), ("pool", 16, 3e-5, 25)]
    assert chosen == {"pool@4": (1e-3, 25), "pool@16": (1e-4, 25), "blind@1": (1e-4, 25)}
    assert tune.rate(chosen, "pool", 16) == (1e-4, 25) and tune.rate(chosen, "pool", 8) == (1e-3, 25)
    assert tune.rate({"pool": (3e-4, 250)}, "pool", 64) == (3e-4, 250)
    args.tune_each_budget, args.tune_seeds, calls[:] = False, 1, []
    _, chosen = sweep.tune_families(args, jobs, run_cells, pathlib.Path("unused"), "sig")
    assert chosen == {"pool": (1e-4, 25), "blind": (1e-4, 25)} and calls[0][2] == [0]


def test_interim_chooses_as_the_full_run_from_this_sweeps_points_and_tuning_seeds(tb, tmp_path, capsys):
    """Other tuning stored under the same settings (another token count, more seeds, a pilot at a
    rate and warmup outside the grid) must not move the interim choice away from the one the
    finished sweep makes; a run the full sweep would still train (a grid extended past a winning
    edge) means tuning has not finished."""
    from vitmm.study import store

    path = tmp_path / "tuning.jsonl"
    store.save_cell(path, "sig", ("pool", 16, 1e-4, 25), {0: {"accuracy": 0.6}, 1: {"accuracy": 0.1}})
    store.save_cell(path, "sig", ("pool", 16, 3e-4, 25), {0: {"accuracy": 0.5}, 1: {"accuracy": 0.5}})
    store.save_cell(path, "sig", ("pool", 4, 1e-3, 25), {0: {"accuracy": 0.9}})  # tuned at 4 tokens before
    store.save_cell(path, "sig", ("pool", 16, 3e-3, 250), {0: {"accuracy": 0.95}})  # a pilot outside the grid
    parser = argparse.ArgumentParser()
    args = argparse.Namespace(stage1_steps=0, steps=10, tune_budget=16, chosen=None, tune_lrs=[1e-4, 3e-4],
                              tune_warmups=[25], interim=True, tune_extend=0, min_delta=0.005, seeds=[0, 1],
                              tune_each_budget=False, tune_seeds=1, parser=parser)
    jobs = {("pool", 4, ""): {}, ("pool", 16, ""): {}}
    tuned, chosen = sweep.tune_families(args, jobs, sweep.kept_tuning(args), tmp_path, "sig")
    assert chosen == {"pool": (1e-4, 25)}  # seed 0 at 16 tokens; not seed 1's mean, the 4-token run or the pilot
    assert sorted(tuned) == [("pool", 16, 1e-4, 25), ("pool", 16, 3e-4, 25)] and all(
        list(v) == [0] for v in tuned.values())
    args.tune_extend = 1  # the full run would try 3e-5 next: not run yet
    with pytest.raises(SystemExit):
        sweep.tune_families(args, jobs, sweep.kept_tuning(args), tmp_path, "sig")
    assert "--interim: tuning (lr) has 1 runs to go (e.g. ('pool', 16, 3e-05, 25))" in capsys.readouterr().err


def test_a_tuning_point_trains_only_the_seeds_not_tuned_before(monkeypatch):
    from experiments.token_budget import jobs as cell_jobs

    trained = []
    monkeypatch.setattr(cell_jobs, "_run", lambda c, key, lr, warmup: "run")
    monkeypatch.setattr(cell_jobs, "snapshot_path", lambda *a: None)
    monkeypatch.setattr(cell_jobs, "train_and_eval",
                        lambda run, seed, *a, **k: trained.append(seed) or {"accuracy": 0.1 * seed})
    context = {"jobs": {("pool", 16, ""): {"view": "square"}}, "plan": {}, "tune_seeds": [0, 1],
               "tune_done": {("pool", 16, 1e-3, 25): {0: {"accuracy": 0.7}}}}
    got = cell_jobs.tune_job(["pool", 16, 1e-3, 25], {"train": None, "val": None}, context, None)  # a list, as stored
    assert trained == [1] and got == {0: {"accuracy": 0.7}, 1: {"accuracy": 0.1}}


def test_budget_or_connector_anova_matches_a_least_squares_fit(tb):
    """The two-way analysis of variance (families × budgets, seeds as blocks) on a balanced grid
    with a known budget effect: its F-tests equal the extra-sum-of-squares F of nested
    least-squares fits (an independent computation), its shares sum to one, the budget dominates,
    and a family missing a budget is left out of the grid."""
    import numpy as np
    from scipy import stats

    rng = np.random.default_rng(0)
    families, budgets, seeds = ["pool", "ldp", "perceiver"], ["4", "16", "all"], range(5)
    effect_b, effect_f = {"4": 0.0, "16": 0.10, "all": 0.15}, {"pool": 0.02, "ldp": 0.0, "perceiver": -0.01}
    acc = {(f, b, k): 0.5 + effect_b[b] + effect_f[f] + 0.01 * k + 0.02 * rng.normal()
           for f in families for b in budgets for k in seeds}
    kinds = {f"acc_{k}": 0.5 for k in tb.KINDS}
    rows = [{"family": f, "budget": b, "tokens": {"4": 4, "16": 16, "all": 64}[b], "note": "", "lr": 1e-3, "warmup": 25,
             "seed": k, "status": "ok", "accuracy": a, **kinds} for (f, b, k), a in acc.items()]
    rows += [{**rows[0], "family": "mlp", "budget": "all", "tokens": 64, "seed": k} for k in seeds]  # one budget only
    test = report.factor_test(report.summarise(rows))
    assert test["families"] == families and test["budgets"] == budgets and test["seeds"] == list(seeds)
    src = test["sources"]
    assert sum(s["eta2"] for s in src.values()) == pytest.approx(1.0)
    assert src["budget"]["eta2"] > 0.8 > 0.05 > src["family"]["eta2"] and src["budget"]["p"] < 1e-10

    # Reference: y ~ dummies, the F of dropping each factor from the full additive-plus-interaction model.
    y = np.array([100 * acc[(f, b, k)] for f in families for b in budgets for k in seeds])
    cols = {"f": [(f,) for f in families for b in budgets for k in seeds],
            "b": [(b,) for f in families for b in budgets for k in seeds],
            "fb": [(f, b) for f in families for b in budgets for k in seeds],
            "s": [(k,) for f in families for b in budgets for k in seeds]}

    def rss(terms):
        x = [np.ones(len(y))]
        for term in terms:
            levels = sorted(set(cols[term]), key=str)
            x += [np.array([v == level for v in cols[term]], float) for level in levels[1:]]
        x = np.stack(x, 1)
        resid = y - x @ np.linalg.lstsq(x, y, rcond=None)[0]
        return resid @ resid, np.linalg.matrix_rank(x)

    full, rank_full = rss(["f", "b", "fb", "s"])
    df_e = len(y) - rank_full
    assert src["residual"]["ss"] == pytest.approx(full) and src["residual"]["df"] == df_e
    for name, drop in (("budget", ["f", "s"]), ("family", ["b", "s"]), ("seed", ["f", "b"])):
        reduced, rank = rss(drop)  # balanced: a main effect's SS is the same with or without the interaction
        additive, rank_add = rss(["f", "b", "s"])
        f_ref = (reduced - additive) / (rank_add - rank) / (full / df_e)
        assert src[name]["f"] == pytest.approx(f_ref, rel=1e-9)
        assert src[name]["p"] == pytest.approx(stats.f.sf(f_ref, rank_add - rank, df_e), rel=1e-9)
    additive, rank_add = rss(["f", "b", "s"])
    f_int = (additive - full) / (rank_full - rank_add) / (full / df_e)
    assert src["family × budget"]["f"] == pytest.approx(f_int, rel=1e-9)
    assert "Budget or connector (MM1, TokenPacker)" in "\n".join(tables.factor_lines(report.summarise(rows)))
    claim = next(line for line in tables.claim_lines(report.summarise(rows)) if "MM1" in line)
    assert f"budget {100 * src['budget']['eta2']:.1f}%" in claim


def test_learning_curves_average_the_seeds_that_reached_each_check(tb):
    steps, mean, count = plots.mean_curve([[[0, 0.4], [250, 0.6], [500, 0.7]], [[0, 0.5], [250, 0.8]]])
    assert steps == [0, 250, 500] and mean == pytest.approx([0.45, 0.7, 0.7]) and count == [2, 2, 1]


def test_the_image_reaches_the_lm_and_beats_blind_where_only_it_answers(tb):
    """The sweep's own run (``Run`` + ``train_and_eval``) on features that carry the answer (one of
    four colours, every patch showing it, plus noise): a connector answers nearly all, blind —
    the same LM with the image blanked — about a quarter. The smoke sweep is too short to show
    the gap on scenes (there both sit near the questions' prior); this is the check that the
    image is not lost on the way to the LM."""
    import numpy as np

    rng = np.random.default_rng(0)

    def split(n):
        colour = rng.integers(4, size=n)
        patches = np.eye(8, dtype=np.float32)[colour][:, None, :] + 0.3 * rng.normal(size=(n, 4, 8)).astype(np.float32)
        ids = np.zeros((n, 6), np.int32)
        ids[:, :4] = np.stack([np.full(n, 1), np.full(n, 3), 4 + colour, np.full(n, 2)], axis=1)  # BOS q answer EOS
        mask = np.zeros((n, 6), np.float32)
        mask[:, 2:4] = 1
        return dict(patches=patches, image=np.arange(n), ids=ids, answer_mask=mask, kind=np.full(n, 2))

    train, val, test = split(512), split(64), split(256)
    lm_cfg = dict(vocab_size=10, width=32, depth=1, num_heads=2)
    tower = dict(width=8, depth=1, mlp_dim=16, num_heads=2, patch_size=8)
    plan = dict(max_steps=150, batch_size=32, eval_every=50, patience=3, min_delta=0.005, curve_questions=64)
    scores = {}
    for name, blind in (("mlp", False), ("blind", True)):
        run = feature_vlm.FeatureTrainer(tower, {"name": "mlp"}, lm_cfg, (2, 2), 8, 6, steps=150, lr=3e-3, blind=blind,
                             warmup=10)
        scores[name] = feature_vlm.train_and_eval(run, 0, train, val, test, plan)["accuracy"]
    assert scores["mlp"] >= 0.9 and scores["blind"] <= 0.4 and scores["mlp"] - scores["blind"] >= 0.5, scores


def test_a_job_keeps_each_finished_seed_and_skips_those_already_kept(tb, tmp_path):
    """A sweep stopped mid-job loses one seed's run, not the job: each finished seed goes to the
    seed log as it ends, and a rerun takes the seeds found there instead of training them."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = 64
    arrays = {name: dict(patches=rng.normal(size=(n, 4, 8)).astype(np.float32), image=np.arange(n),
                         ids=np.tile(np.array([1, 3, 4, 2, 0, 0], np.int32), (n, 1)),
                         answer_mask=np.tile(np.array([0, 0, 1, 1, 0, 0], np.float32), (n, 1)), kind=np.zeros(n, int))
              for name in ("train", "val", "test")}
    key, log = ("mlp", 4, ""), tmp_path / "seeds.jsonl"
    kept = {"accuracy": -1.0}  # a sentinel no run produces
    context = dict(tower_cfg=dict(width=8, depth=1, mlp_dim=16, num_heads=2, patch_size=8),
                   lm_cfg=dict(vocab_size=10, width=16, depth=1, num_heads=2), in_dim=8, max_len=6,
                   plan=dict(max_steps=4, batch_size=8, eval_every=2, patience=2, min_delta=0.005, curve_questions=16),
                   seeds=[0, 1], jobs={key: {"connector": {"name": "mlp"}, "view": ""}}, views={"": {"grid": (2, 2)}},
                   chosen={"mlp": (1e-3, 1)}, seed_log=(str(log), "sig"), seeds_done={key: {0: kept}})

    class Progress:
        steps = 0

        def update(self, k):
            self.steps += k

    progress = Progress()
    out = cell_jobs.job(key, arrays, context, progress)
    assert out[0] == kept and 0 <= out[1]["accuracy"] <= 1 and progress.steps == 2 * 4 and out[1]["wall_s"] > 0
    logged = store.load_cells(log, "sig")  # only the seed trained here
    assert list(logged) == [key] and list(logged[key]) == [1]
    assert logged[key][1]["accuracy"] == out[1]["accuracy"] and logged[key][1]["curve"] == out[1]["curve"]




def test_the_tuning_table_shows_every_run_and_marks_the_chosen_setting(tb):
    setup = {"tune_warmups": [25, 250], "tune_seed": 0, "val_questions": 6454,
             "tuning": {"pool@16": {"0.0001/25": 0.793, "0.0003/25": 0.857, "0.001/25": 0.855, "0.0003/250": 0.861},
                        "mlp@64": {"0.001/25": 0.859, "0.003/25": 0.836, "0.01/25": 0.8, "0.001/250": 0.85,
                                   "0.003/250": 0.81}},  # a pilot's run at another rate
             "chosen": {"pool": [0.0003, 250], "mlp": [0.001, 25]}}
    lines = tables.tuning_lines(setup)
    assert lines[2] == ("| family @ tokens | lr 0.0001 | lr 0.0003 | lr 0.001 | lr 0.003 | lr 0.01 | "
                        "warmup 250 (at the best lr) | chosen lr/warmup | other runs |")
    assert "| pool@16 | 79.3 | 85.7 | 85.5 |  |  | **86.1** | 0.0003/250 |  |" in lines
    assert "| mlp@64 |  |  | **85.9** | 83.6 | 80.0 | 85.0 | 0.001/25 | 0.003/250: 81.0 |" in lines
    assert tables.tuning_lines({"tune_warmups": [25]}) == []


def test_jobs_run_longest_first_by_flops_times_their_familys_measured_speed(tb):
    jobs = {("pool", 64, ""): {}, ("pool", 16, ""): {}, ("c_abstractor", 16, ""): {}, ("c_abstractor", 4, ""): {},
            ("mlp", 16, "patch 16"): {}}
    mflops = {("pool", 64, ""): 21.0, ("pool", 16, ""): 7.0, ("c_abstractor", 16, ""): 26.0,
              ("c_abstractor", 4, ""): 20.0, ("mlp", 16, "patch 16"): 8.0}
    # pool: 140 s at 7 MFLOP (20 s/MFLOP); c_abstractor: 2,080 s at 26 (80 s/MFLOP); mlp untuned: the median, 50.
    tuned = {("pool", 16, 1e-3, 25): {0: {"wall_s": 140.0}}, ("c_abstractor", 16, 1e-3, 25): {0: {"wall_s": 2080.0}},
             ("c_abstractor", 16, 3e-3, 25): {0: {"accuracy": 0.5}}}  # a result without seconds counts for nothing
    order = tb.longest_first(jobs, mflops, tuned, {k: 5 for k in jobs})
    assert order == [("c_abstractor", 16, ""), ("c_abstractor", 4, ""), ("pool", 64, ""), ("mlp", 16, "patch 16"),
                     ("pool", 16, "")]
    # A job with one seed left (2,080 s) moves behind pool at 64 tokens (2,100 s); without tuning, FLOPs decide.
    order = tb.longest_first(jobs, mflops, tuned, {**{k: 5 for k in jobs}, ("c_abstractor", 16, ""): 1})
    assert order[0] == ("c_abstractor", 4, "") and order.index(("c_abstractor", 16, "")) == 2
    assert tb.longest_first(jobs, mflops, {}, {})[:2] == [("c_abstractor", 16, ""), ("pool", 64, "")]
    # Blind, the baseline of every row, first (and the cheapest job: 1 MFLOP).
    order = tb.longest_first({**jobs, ("blind", 1, ""): {}}, {**mflops, ("blind", 1, ""): 1.0}, tuned, {})
    assert order[0] == ("blind", 1, "") and order[1:] == tb.longest_first(jobs, mflops, tuned, {})


def test_a_family_has_one_colour_in_every_plot(tb):
    """The plots colour a family the same whichever families a sweep ran, the ten apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = plots.colours(plt, [*plots.ORDER, "my_connector"])
    assert len(set(every.values())) == len(every) == 11
    some = plots.colours(plt, ["qformer", "my_connector", "pool"])
    assert some == {f: every[f] for f in some}


def test_a_family_whose_nearest_size_is_its_default_reuses_the_default_runs(tb):
    """Sizing to a parameter budget plans a job per family, except where the nearest size is the
    family's default: then the row reads the default job's runs instead of training the same
    connector again (Perceiver at 16 tokens on an 8 × 8 grid is depth 2 either way)."""
    grid, in_dim, width = (8, 8), 128, 64
    default = connectors.num_params({"name": "perceiver", "budget": 16}, in_dim, width, grid)
    args = tb.parse_args(["--families", "perceiver,pool", "--budgets", "16", "--param_budget", str(default),
                          "--param_tokens", "16", "--encoder_budgets", ""])
    plan, jobs, same = tb.plan_jobs(args, grid, in_dim, width, {})
    variant = f"params ≈ {default:,}"
    assert ("perceiver", 16, variant, 16, 16, "") in plan and ("perceiver", 16, variant) not in jobs
    assert same[("perceiver", 16, variant)]["runs_of"] == ("perceiver", 16, "")
    assert same[("perceiver", 16, variant)]["connector"]["depth"] == 2
    pool = jobs[("pool", 16, variant)]["connector"]  # pool's default (no hidden layer) is far smaller: sized
    assert pool["hidden"] > 0 and ("pool", 16, variant) not in same
    assert sorted(jobs) == sorted([("blind", 1, ""), ("perceiver", 16, ""), ("pool", 16, ""), ("pool", 16, variant)])


def test_the_equal_parameter_table_pairs_each_sized_row_with_its_default_size(tb):
    """A family sized to the parameter budget is compared, paired by seed, with its default-size row;
    a family whose nearest size is its default (Perceiver at 16 tokens: depth 2 either way) is named
    as such rather than shown as a zero difference with p = 1."""
    from scipy import stats

    kinds = {f"acc_{k}": 0.5 for k in tb.KINDS}
    runs = (("pool", "", 10_000, (0.50, 0.55, 0.49)), ("pool", "params ≈ 100,000", 99_000, (0.60, 0.62, 0.61)),
            ("perceiver", "", 111_552, (0.70, 0.71, 0.69)), ("perceiver", "params ≈ 100,000", 111_552,
                                                              (0.70, 0.71, 0.69)))
    rows = [{"family": f, "budget": 16, "tokens": 16, "variant": v, "note": "", "lr": 1e-3, "warmup": 25,
             "seed": seed, "status": "ok", "accuracy": acc, "connector_params": n, **kinds}
            for f, v, n, accs in runs for seed, acc in enumerate(accs)]
    sized = {"pool": {"name": "pool", "hidden": 520}, "perceiver": {"name": "perceiver", "depth": 2}}
    setup = {"param_tokens": 16, "connectors": {f"{f}|16|params ≈ 100,000": {"connector": c} for f, c in sized.items()}}
    lines = tables.param_lines(report.summarise(rows), setup)
    pool = next(line for line in lines if line.startswith("| pool |"))
    p = stats.ttest_rel([0.60, 0.62, 0.61], [0.50, 0.55, 0.49]).pvalue
    assert pool.startswith("| pool | 16 | hidden=520 | 99,000 | 61.0 ± ") and f"| +9.7 (p={p:.2g}) |" in pool
    assert "| perceiver | 16 | depth=2 | 111,552 | 70.0 ± " in lines[-3] and "| its default size |" in lines[-3]
    assert lines[-1].startswith("Spread at equal parameters: perceiver 70.0 − pool 61.0 = 9.0 points")


def cited_numbers(text: str) -> list[str]:
    """The numbers a text states, as written (signs kept; "−" read as "-"; no digits inside words)."""
    text = text.replace("−", "-")
    return [m.rstrip(",") for m in re.findall(r"(?<![\w.,])[-+]?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?", text)]


def test_cited_numbers_reads_signs_exponents_and_thousands_but_not_names():
    text = "SmolLM2 at 4,327,744 params: +4.1 (p=2.6e-05), −3.5 and 0.3%; seeds 0-2 on 8×8 (MM1)"
    assert cited_numbers(text) == ["4,327,744", "+4.1", "2.6e-05", "-3.5", "0.3", "0", "2", "8", "8"]


def test_every_number_in_the_token_budget_discussion_is_in_a_committed_table():
    """The README's discussion of version 2 (and its line in the Results table) cites only numbers
    printed by the experiments' reports: the main stage, the longer horizon, the frozen-SmolLM2
    subset, the test split's overlap with training, the hard sweep, its probe and the layouts' table. A number typed by
    hand, rounded differently or left over from an earlier run fails here."""
    out = ROOT / "results/token_budget"
    sources = [out / "token_budget.md", out / "horizon/horizon.md", ROOT / "results/vlm_smollm2/frozen/frozen.md",
               out / "layout_overlap.md", out / "hard/token_budget.md", out / "layouts.md", out / "hard/probe.md"]
    printed = cited_numbers("\n".join(p.read_text() for p in sources if p.exists()))
    printed = set(printed) | {n.lstrip("+-") for n in printed}  # "loses 5.1" cites a "-5.1"
    readme = (out / "README.md").read_text()
    discussion = re.search(r"^## What the numbers say\n(.*?)^## ", readme, re.S | re.M).group(1)
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| token-budget sweep v2"))
    cited = cited_numbers(discussion) + cited_numbers(row.split("|")[2])
    assert len(cited) > 100
    missing = [n for n in cited if n not in printed]
    assert not missing, f"numbers in the discussion that no committed table prints: {missing}"


def test_the_horizon_verdicts_test_the_gains_the_table_shows():
    """A cell's gain in the Verdicts table is the table's (the seeds that cell ran at both horizons),
    not a gain over only the seeds every cell ran; a gap between two families pairs the seeds both ran."""
    from experiments.token_budget import horizon

    def row(family, seed, acc, steps):
        return {"family": family, "tokens": "16", "variant": "", "seed": str(seed), "status": "ok",
                "accuracy": str(acc), "acc_color_at": "0.5", "acc_shape_at": "0.7", "best_step": "100",
                "steps_trained": str(steps)}

    pool = {0: (0.80, 0.82), 1: (0.76, 0.81), 2: (0.79, 0.80)}
    short = [row("pool", k, a, 8000) for k, (a, _) in pool.items()] + [row("qformer", k, 0.7, 8000) for k in (0, 1)]
    long = [row("pool", k, b, 16000) for k, (_, b) in pool.items()] + [row("qformer", k, 0.72 + k / 100, 16000)
                                                                      for k in (0, 1)]
    tests = {t.name: t for t in horizon.horizon_tests(short, long, (8000, 16000))}
    table = next(line for line in horizon.compare(short, long, (8000, 16000)) if line.startswith("| pool |"))
    gain = tests["pool@16: 16,000 − 8,000 steps"]
    assert table.startswith("| pool | 16 | 3 |") and f"| {gain.estimate:+.1f} ± {gain.ci:.1f} | {gain.p:.2g} |" in table
    assert gain.estimate == pytest.approx(100 * (0.02 + 0.05 + 0.01) / 3)
    assert tests["pool − qformer at 8,000 steps"].estimate == pytest.approx(100 * (0.10 + 0.06) / 2)
