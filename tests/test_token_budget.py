"""The token-budget experiment: budget resolution, and a smoke sweep that writes every output."""

import csv
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from vitmm.models import connectors

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tb():
    spec = importlib.util.spec_from_file_location("token_budget", ROOT / "experiments/token_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tower_is_trained_only_when_its_workdir_has_no_checkpoint(tb, tmp_path, monkeypatch):
    from vitmm.train import trainer

    calls = []
    monkeypatch.setattr(trainer, "train", lambda config, workdir: calls.append((config, workdir)))
    tb.ensure_tower(tmp_path / "w", smoke=True, data_dir=str(tmp_path / "tfds"))
    (config, workdir), = calls  # configs/clip_scenes.py:smoke on the given data_dir
    assert workdir == tmp_path / "w" and config.total_steps == 4 and config.input.image_size == 32
    assert config.input.data_dir == str(tmp_path / "tfds")
    (tmp_path / "w" / "checkpoints" / "4").mkdir(parents=True)
    tb.ensure_tower(tmp_path / "w", smoke=True)
    assert len(calls) == 1


def test_smoke_sweep_writes_tables_and_plots(tmp_path, clip_smoke_run):
    """A whole sweep end to end on the session's smoke CLIP (features, two worker processes,
    outputs; training the tower when a workdir has none is the same ``trainer.train``)."""
    out = tmp_path / "tb"
    # The workers pick their own thread settings; only the tests' compile level is passed on.
    env = dict(os.environ, XLA_FLAGS=os.environ.get("VITMM_TEST_XLA_FLAGS", ""))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments/token_budget.py"), "--smoke", "--workers", "2", "--out", str(out),
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
    assert by_key[("linear", "4")]["status"] == "unreachable"
    assert by_key[("patch_merger", "9")]["tokens"] == "16" and "nearest to 9" in by_key[("patch_merger", "9")]["note"]
    assert by_key[("blind", "0")]["status"] == "ok"
    for r in rows:
        if r["status"] != "ok" or r["family"] == "blind":
            continue
        cfg = {"name": r["family"], "budget": int(r["tokens"])}
        assert 0.0 <= float(r["accuracy"]) <= 1.0
        assert float(r["train_ex_s"]) > 0 and float(r["infer_ex_s"]) > 0
        assert int(r["connector_params"]) > 0 and float(r["lm_mflops"]) > 0
        if r["family"] == "pool":  # pool's budget→stride: the row's count is what the model produces
            assert connectors.num_visual_tokens(cfg, grid) == int(r["tokens"])
    # LM cost grows with the visual tokens it reads.
    pool = {int(r["tokens"]): float(r["lm_mflops"]) for r in rows if r["family"] == "pool" and r["status"] == "ok"}
    assert pool[4] < pool[16]
    table = (out / "token_budget.md").read_text()
    assert "| linear | 4 | unreachable" in table and "| patch_merger | 9 | 16 (nearest to 9) |" in table
    assert "Spread across connectors at equal token counts" in table and "| pool | 4: " in table
    assert "| vs blind |" in table and "paired by seed" in table
    for name in ("accuracy_vs_budget.png", "accuracy_vs_cost.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Tuning: each family's learning rate is its best of the grid on validation, used for its rows.
    tuning = (out / "tuning.jsonl").read_text().splitlines()
    families = {r["family"] for r in rows if r["status"] == "ok"}
    assert len(tuning) == len(families) * len(setup["tune_lrs"]) == 8
    assert set(setup["chosen_lr"]) == families and setup["test_questions"] > 0
    for r in rows:
        if r["status"] == "ok":
            assert float(r["lr"]) == setup["chosen_lr"][r["family"]] in setup["tune_lrs"]
    for family, lr in setup["chosen_lr"].items():
        grid_scores = next(v for k, v in setup["tuning"].items() if k.startswith(f"{family}@"))
        assert grid_scores[str(lr)] == max(grid_scores.values())

    # Resume: each finished cell is on disk; a rerun after losing one (an interrupted sweep)
    # trains only that cell, seeded the same, and the other rows come back unchanged.
    cells = (out / "cells.jsonl").read_text().splitlines()
    assert len(cells) == len({(r["family"], r["tokens"]) for r in rows if r["status"] == "ok"})
    (out / "cells.jsonl").write_text("\n".join(cells[:-1]) + "\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments/token_budget.py"), "--smoke", "--workers", "2", "--out", str(out),
         "--tower", str(clip_smoke_run.workdir), "--data_dir", clip_smoke_run.data_dir],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{len(cells) - 1} cells already done" in proc.stdout and "1 to run" in proc.stdout
    assert "tuning:" not in proc.stdout and len((out / "tuning.jsonl").read_text().splitlines()) == 8
    again = list(csv.DictReader(open(out / "runs.csv")))
    accuracy = lambda rs: [(r["family"], r["tokens"], r["seed"], r.get("accuracy")) for r in rs]  # noqa: E731
    assert accuracy(again) == accuracy(rows)


def test_stage0_pretraining_learns_the_questions_text(tb):
    """Stage 0 trains the LM on text alone: on a tiny fixed corpus its loss falls far below the
    uniform guess, its parameters come back as numpy, and the same seed gives the same LM."""
    import jax
    import numpy as np

    ids = np.array([[1, 5, 6, 7, 2, 0], [1, 5, 8, 9, 2, 0], [1, 6, 6, 7, 9, 2]], np.int32)
    lm_cfg = dict(vocab_size=12, width=16, depth=1, num_heads=2)
    params, loss = tb.run_lib.pretrain_lm(lm_cfg, ids, pad_id=0, steps=60, batch_size=8, lr=1e-2, seed=0)
    assert loss < 0.5 * np.log(12)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
    again, _ = tb.run_lib.pretrain_lm(lm_cfg, ids, pad_id=0, steps=60, batch_size=8, lr=1e-2, seed=0)
    jax.tree.map(np.testing.assert_array_equal, params, again)


def test_stage1_trains_the_connector_alone_from_the_stage0_lm(tb):
    """Stage 1 updates the connector and leaves the (stage-0) LM exactly as it was; the joint
    step then trains both."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    lm_cfg = dict(vocab_size=12, width=16, depth=1, num_heads=2)
    ids = np.array([[1, 5, 6, 7, 2, 0], [1, 5, 8, 9, 2, 0]], np.int32)
    stage0, _ = tb.run_lib.pretrain_lm(lm_cfg, ids, pad_id=0, steps=3, batch_size=2, lr=1e-2, seed=0)
    tower = dict(width=8, depth=1, mlp_dim=16, num_heads=2, patch_size=8)
    run = tb.run_lib.Run(tower, {"name": "linear"}, lm_cfg, (2, 2), 8, 6, steps=2, lr=1e-2, stage0={0: stage0},
                 stage1_steps=3)
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
    summary = {s["family"]: s for s in tb.report.summarise(rows)}
    pool = np.array([0.50, 0.55, 0.49])
    assert summary["pool"]["accuracy_ci"] == pytest.approx(stats.t.ppf(0.975, 2) * pool.std(ddof=1) / np.sqrt(3))
    diff, p = summary["pool"]["vs_blind"]
    assert diff == pytest.approx(pool.mean() - 0.41)
    assert p == pytest.approx(stats.ttest_rel(pool, [0.40, 0.42, 0.41]).pvalue)
    assert summary["blind"]["vs_blind"] is None
    spread = next(line for line in tb.report.spread_lines(list(summary.values())) if line.startswith("| 16 |"))
    assert spread.startswith("| 16 | 2 | pool 51.3 | linear 46.7 | 4.7 |")
    assert f"| {stats.ttest_rel(pool, [0.45, 0.47, 0.48]).pvalue:.2g} |" in spread
