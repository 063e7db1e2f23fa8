"""The square-vs-NaFlex-vs-AnyRes experiment: its AnyRes features equal the library's AnyRes VLM,
its token counts are the paths' own, and a smoke run writes every output and resumes."""

import csv
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.models import anyres
from vitmm.models.vit import ViT
from vitmm.models.vlm import VLM

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def nt():
    from experiments.native import tokens

    return tokens


@pytest.fixture(scope="session")
def nf(nt):
    return nt.features_lib


TOWER = dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=8, class_token=False, pool="gap",
             posemb="sincos2d")


def test_feature_vlm_on_laid_out_features_equals_the_anyres_vlm(nt, nf):
    """Tower features of AnyRes's views laid out by the experiment (newline slots flagged, a
    batch left-padded and masked) give the text logits of ``VLM(anyres=…)`` on the images."""
    settings = nf.anyres_settings(16, 8)  # tiles of 2x2 patches (16 px)
    lm_cfg = dict(vocab_size=30, width=32, depth=1, num_heads=2)
    model = VLM(TOWER, {"name": "mlp"}, lm_cfg, anyres=settings)
    feature_model = nt.FeatureVLM(TOWER, {"name": "mlp"}, lm_cfg, anyres=settings)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 30, size=(2, 6)), jnp.int32)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 20, 44, 3)), ids[:1])
    rng = np.random.default_rng(1)
    images = [jnp.asarray(rng.uniform(-1, 1, size=(1, h, w, 3)), jnp.float32) for h, w in ((20, 44), (50, 18))]
    laid, want = [], []
    for b, image in enumerate(images):
        views = anyres.views(image, settings["pinpoints"], settings["tile"])[0]
        tiles = model.apply(variables, views, method=lambda m, x: m.features(x)[0])
        laid.append(nf.anyres_layout(np.asarray(tiles), image.shape[1:3], settings))
        n = model.apply(variables, image.shape[1:3], method=VLM.num_visual_tokens)
        assert len(laid[-1][0]) == n
        want.append(model.apply(variables, image, ids[b:b + 1])[0, n:])
    batch = nf.left_pad(laid, max(len(f) for f, _ in laid))
    m = batch["patches"].shape[1]
    got = feature_model.apply(variables, None, ids, features=(batch["patches"], batch["newline"], (1, m)),
                              visual_mask=batch["visual_mask"])
    for b in range(2):
        np.testing.assert_allclose(got[b, m:], want[b], atol=2e-5, rtol=1e-5)


def test_anyres_views_cut_tiles_as_the_library_and_count_its_tokens(nf):
    settings = nf.anyres_settings(16, 8)
    tile = settings["tile"]
    image = np.random.default_rng(0).integers(0, 256, size=(16, 48, 3), dtype=np.uint8)  # fits (16, 48) exactly
    views = nf.anyres_views(image, settings)
    want = anyres.views(jnp.asarray(image, jnp.float32)[None] / 127.5 - 1, settings["pinpoints"], tile)[0]
    assert views.shape == want.shape == (4, tile, tile, 3)
    np.testing.assert_allclose(views[1:], want[1:], atol=1e-5)  # no resize: the tiles are exact crops
    rng = np.random.default_rng(2)
    for _ in range(20):
        hw = tuple(int(x) for x in rng.integers(8, 120, size=2))
        n = len(nf.anyres_views(np.zeros((*hw, 3), np.uint8), settings))
        g = math.isqrt(16 // 4)
        feats, flags = nf.anyres_layout(np.zeros((n, g * g, 5), np.float32), hw, settings)
        assert len(feats) == anyres.num_tokens(hw, settings["pinpoints"], tile, (g, g)), hw
        tiles_r, tiles_c = anyres.plan(hw, settings["pinpoints"], tile)["tiles"]
        rows, _ = anyres.unpadded(hw, (tiles_r * g, tiles_c * g))
        assert flags.sum() == rows.stop - rows.start and flags[-1] and not flags[:g * g].any(), hw


def test_budgets_must_be_four_squares(nf):
    for bad in (8, 12, 2):
        with pytest.raises(SystemExit, match=f"{bad} is not 4·k²"):
            nf.check_budget(bad)
    nf.check_budget(36)


def test_a_later_sitting_reads_the_encoded_features_from_the_cache(nt, nf, tmp_path, monkeypatch):
    def features(path, budget, fn, params, images, patch):  # stands in for the tower: a view's own numbers
        return [(np.full((budget - i, 3), 10 * i + len(path), np.float32), np.arange(budget - i) % 5 == 0)
                for i in range(len(images))]

    def no_encoding(*a, **k):
        raise AssertionError("encoded again")

    args = nt.parse_args(["--smoke", "--train_images", "4", "--val_images", "2", "--test_images", "2"])
    monkeypatch.setattr(nf, "path_features", features)
    first, _, _ = nf.make_splits(args, ViT(**TOWER), None, tmp_path, "tower-a")
    assert len(list(tmp_path.glob("*.npz"))) == len(nf.PATHS) * len(args.budgets)
    monkeypatch.setattr(nf, "path_features", no_encoding)
    again, _, _ = nf.make_splits(args, ViT(**TOWER), None, tmp_path, "tower-a")
    assert first.keys() == again.keys()
    for split in first:
        assert first[split].keys() == again[split].keys()
        for k, v in first[split].items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(again[split][k]), err_msg=f"{split} {k}")
    with pytest.raises(AssertionError, match="encoded again"):  # another tower: its own features
        nf.make_splits(args, ViT(**TOWER), None, tmp_path, "tower-b")


@pytest.mark.slow  # ~30 s: its cells are the feature VLM tested above, more seeds training only the new ones is
# tests/study/test_store.py's, the report is the committed one's test below
def test_smoke_run_writes_outputs_and_resumes(nt, tmp_path, clip_smoke_run):
    """The study's protocol (a cosine decay over the steps; one rate, so no tuning: the grid and its
    extension are the token-budget sweep's, ``tune.extend_grid``) at smoke size: every cell, resumed
    with more seeds."""
    out = tmp_path / "nt"
    argv = ["--smoke", "--out", str(out), "--tower", str(clip_smoke_run.workdir), "--schedule", "cosine",
            "--patience", "0"]
    nt.main([*argv, "--seeds", "0"])
    rows = list(csv.DictReader(open(out / "runs.csv")))
    setup = json.loads((out / "setup.json").read_text())
    assert setup["schedule"] == "cosine" and all(int(r["steps_trained"]) == setup["steps"] for r in rows)
    budgets = setup["budgets"]
    cells = {(r["path"], int(r["budget"])) for r in rows}
    assert cells == {(p, b) for p in nt.PATHS for b in budgets} | {("blind", budgets[-1])}
    assert {r["seed"] for r in rows} == {"0"}
    for r in rows:
        b, mean, top = int(r["budget"]), float(r["tokens_mean"]), int(r["tokens_max"])
        assert 0.0 <= float(r["accuracy"]) <= 1.0 and float(r["train_ms"]) > 0
        if r["path"] == "square":
            assert mean == top == b
        elif r["path"] == "naflex":
            assert top <= b
        elif r["path"] == "anyres":
            assert top <= b + 3 * math.isqrt(b // 4)
    lines = (out / "cells.jsonl").read_text().splitlines()
    assert len(lines) == len(cells)
    kept = (out / "seeds.jsonl").read_text()
    nt.main([*argv, "--seeds", "0,1", "--interim"])  # trains nothing: seed 1 of every cell still to go
    assert (out / "cells.jsonl").read_text().splitlines() == lines and (out / "seeds.jsonl").read_text() == kept
    interim = (out / "interim/native_tokens.md").read_text()
    assert f"**Interim**: {len(cells)} of {2 * len(cells)} runs finished." in interim
    assert len(list((out / "snapshots").iterdir())) == 1  # stage 0's LM; each run's snapshot gone with its row kept
    # More seeds: only the new seed is trained (one seed-log line per cell), the others come back unchanged.
    seed_log = (out / "seeds.jsonl").read_text().splitlines()
    nt.main([*argv, "--seeds", "0,1"])
    assert len((out / "seeds.jsonl").read_text().splitlines()) == len(seed_log) + len(cells)
    more = list(csv.DictReader(open(out / "runs.csv")))
    assert {r["seed"] for r in more} == {"0", "1"}
    table = (out / "native_tokens.md").read_text()  # two seeds: the paired differences
    assert "| naflex − square | all |" in table and (out / "native_tokens.png").stat().st_size > 0
    assert "joint steps, the rate decayed to zero (cosine)" in table
    accuracy = lambda rs: sorted((r["path"], r["budget"], r["seed"], r["accuracy"]) for r in rs if r["seed"] != "1")  # noqa: E731
    assert accuracy(more) == accuracy(rows)


def test_the_committed_report_is_written_again_from_its_runs_with_every_test_corrected(tmp_path):
    """``--report`` rewrites ``native_tokens.md`` from ``runs.csv`` and ``setup.json``: the committed
    report, Verdicts table included (its 30 paired tests corrected together), byte for byte."""
    import shutil

    from experiments.native import tokens

    committed = ROOT / "results/native/tokens_6000"
    for name in ("runs.csv", "setup.json"):
        shutil.copy(committed / name, tmp_path / name)
    written = tokens.main(["--report", "--out", str(tmp_path)])
    assert written.read_text() == (committed / "native_tokens.md").read_text()
    assert "All 30 tests of this report corrected together (Holm)" in written.read_text()


def test_the_wide_threshold_signs_the_runs_and_runs_at_the_default_keep_their_signature(nt):
    """Every stored run carries ``acc_wide`` at the sweep's ``--wide``: a rerun at another threshold
    must not reuse them; a run at 2.0 (all made before the threshold was signed) keeps its key."""
    from vitmm.study import store

    sign = lambda argv: store.signature(nt.run_settings(nt.parse_args(argv), "t", {}, 8)[1])  # noqa: E731
    assert sign([]) == sign(["--wide", "2.0"])
    assert "wide" not in nt.run_settings(nt.parse_args([]), "t", {}, 8)[1]  # the committed rows' signature
    assert len({sign([]), sign(["--wide", "1.5"]), sign(["--wide", "3.0"])}) == 3


def test_the_tower_defaults_to_the_one_pinned_in_the_output_folder(nt, tmp_path, monkeypatch):
    """Without ``--tower`` the study resumes on the tower pinned in ``--out`` (``OUT/tower``), as
    the token-budget study does, not on ``workdirs/clip_scenes``."""
    from experiments.common import tower as tower_lib

    (tmp_path / "tower/checkpoints").mkdir(parents=True)
    monkeypatch.setattr(tower_lib, "ensure_tower", lambda *a: pytest.fail("trained or read another tower"))
    monkeypatch.setattr(tower_lib, "pin_tower", lambda *a: pytest.fail("pinned another tower"))
    seen = {}

    def stop(folder):
        seen["tower"] = pathlib.Path(folder)
        raise SystemExit

    monkeypatch.setattr(nt.ckpt_lib, "load_config", stop)
    with pytest.raises(SystemExit):
        nt.main(["--out", str(tmp_path)])
    assert seen["tower"] == tmp_path / "tower"


def test_interim_reads_the_finished_seeds_and_stops_while_the_tuning_runs(nt, tmp_path):
    """``--interim`` trains nothing: with a tuning run still to go it stops and names one; with the
    tuning done, each cell shows the seeds it holds (of the seeds asked for) and a cell without any
    is left out, its name in the report's Interim sentence."""
    from experiments.native import tokens_report
    from vitmm.study import store

    keys = [("square", 16, 1e-3), ("square", 16, 3e-3)]
    store.save_cell(tmp_path / "tuning.jsonl", "sig", keys[0], {0: {"accuracy": 0.5}})
    with pytest.raises(SystemExit, match=r"the tuning has 1 of its 2 runs to go \(e.g. \('square', 16, 0.003\)\)"):
        nt.kept_runs(tmp_path / "tuning.jsonl", "sig", keys, "tuning", [0], {})
    assert nt.kept_runs(tmp_path / "tuning.jsonl", "sig", keys[:1], "tuning", [0], {}) == {keys[0]: {0: {
        "accuracy": 0.5}}}
    done = {("square", 16): {0: {"accuracy": 0.5}, 1: {"accuracy": 0.6}, 7: {"accuracy": 0.9}}}
    assert nt.kept_runs(tmp_path / "cells.jsonl", "sig", [("square", 16), ("naflex", 16)], "cells", [0, 1],
                        {"seeds_done": done}) == {("square", 16): {0: {"accuracy": 0.5}, 1: {"accuracy": 0.6}}}
    setup = {"interim": {"runs": 2, "of": 4, "pending": ["naflex@16"]}}
    assert tokens_report._interim(setup) == " **Interim**: 2 of 4 runs finished; no seed finished yet: naflex@16."
    assert tokens_report._interim({}) == ""
