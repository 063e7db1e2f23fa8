"""The lessons' experiments (``experiments/lessons/``): their pieces, and smoke runs that
write every output."""

import contextlib
import csv
import io
import pathlib
import types

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def lesson():
    """``lesson("positions")``: ``experiments.lessons.positions``."""
    import importlib

    return lambda name: importlib.import_module(f"experiments.lessons.{name}")


def _smoke(lesson, name: str, out, *extra) -> types.SimpleNamespace:
    """Runs ``python -m experiments.lessons NAME --smoke --out OUT`` in this process (its ``main``; the
    suite's compile level and cache), with what it printed as ``.stdout``."""
    module = lesson(name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main(["--smoke", "--workers", "1", "--out", str(out), *extra])  # worker pools: the token-budget smoke
    return types.SimpleNamespace(stdout=printed.getvalue())


@pytest.fixture(scope="session")
def positions(lesson):
    return lesson("positions")


def test_single_shape_sets_carry_shape_and_region_labels(lesson):
    common = lesson("common")
    data = common.single_shape_set("medium", 32, "test", 20)
    assert data["images"].shape == (20, 32, 32, 3) and data["images"].dtype == np.uint8
    assert data["num_classes"] == {"shape": 4, "region": 9, "color": 6} and data["color"].max() < 6
    assert data["shape"].max() < 4 and data["region"].max() < 9 and len(set(data["region"])) > 3


def test_shuffle_patches_moves_whole_patches(positions):
    images = np.arange(2 * 16 * 16 * 3).reshape(2, 16, 16, 3)
    perm = np.array([3, 0, 2, 1])
    moved = positions.shuffle_patches(images, 8, perm)
    np.testing.assert_array_equal(moved[:, :8, :8], images[:, 8:, 8:])  # slot 0 holds patch 3 (bottom right)
    np.testing.assert_array_equal(moved[:, :8, 8:], images[:, :8, :8])  # slot 1 holds patch 0
    np.testing.assert_array_equal(positions.shuffle_patches(moved, 8, np.argsort(perm)), images)


@pytest.mark.slow  # permutation invariance without positions is tests/models/test_vit.py's; this is the script (~20 s)
def test_positions_smoke_writes_tables_and_shows_equivariance_without_positions(positions, tmp_path, lesson):
    out = tmp_path / "pos"
    proc = _smoke(lesson, "positions", out)
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert len(rows) == 2 * 4 * 2  # tasks × position kinds × seeds
    for r in rows:
        assert all(0 <= float(r[k]) <= 1 for k in r if k.startswith("acc_"))
        error = float(r["equivariance_error"])
        # Without positions the encoder is permutation-equivariant over patches (float rounding
        # only); every kind of position breaks it.
        assert (error < 1e-5) if r["posemb"] == "none" else (error > 1e-3), r
    table = (out / "positions.md").read_text()
    assert "**Task `region`**" in table and "| rope2d |" in table and "learn − sincos2d" in table
    assert (out / "positions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = _smoke(lesson, "positions", out)  # again: every cell is reused
    assert "8 cells already done" in proc.stdout
    assert list(csv.DictReader(open(out / "runs.csv"))) == rows


def test_linear_probe_separates_separable_features_and_not_noise(lesson):
    common = lesson("common")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 400)
    centres = rng.normal(size=(4, 16)) * 3
    x = centres[y] + rng.normal(size=(400, 16))
    result = common.linear_probe(x[:300], y[:300], x[300:], y[300:], 4, fit_size=240)
    assert result["train_accuracy"] > 0.95 and result["accuracy"] > 0.9 and result["l2"] in (1e-4, 1e-3, 1e-2, 1e-1)
    noise = common.linear_probe(rng.normal(size=(300, 16)), y[:300], rng.normal(size=(100, 16)), y[300:], 4,
                                fit_size=240)
    assert noise["accuracy"] < 0.45  # chance is 0.25


@pytest.mark.slow  # the poolings are tests/models/test_vit.py's, the probe is tested above; this is the script (~14 s)
def test_pooling_smoke_writes_both_tables(tmp_path, clip_smoke_run, lesson):
    out = tmp_path / "pool"
    _smoke(lesson, "pooling", out, "--tower", str(clip_smoke_run.workdir))
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert len(rows) == (2 * 3 + 2) * 2  # (tasks × poolings + two towers) × seeds
    assert {r["model"] for r in rows if r["part"] == "probe"} == {"pretrained", "untrained"}
    assert all(0 <= float(r["accuracy"]) <= 1 for r in rows)
    table = (out / "pooling.md").read_text()
    assert "| CLS token (`tok`) |" in table and "| MAP head (`map`) |" in table and "| untrained |" in table
    assert (out / "pooling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # (reuse: the positions test)


@pytest.mark.slow  # registers are tests/models/test_vit.py's; this is the script's measurements (~13 s)
def test_registers_smoke_measures_norms_and_cls_attention(tmp_path, lesson):
    out = tmp_path / "reg"
    _smoke(lesson, "registers", out)
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert sorted({int(r["registers"]) for r in rows}) == [0, 1, 4, 8] and len(rows) == 8
    for r in rows:
        registers = int(r["registers"])
        # The CLS query's weights cover CLS, the registers and the 16 patches of a 32-px image.
        assert float(r["cls_entropy_uniform"]) == pytest.approx(np.log(1 + registers + 16), rel=1e-6)
        assert 0 < float(r["cls_entropy"]) <= float(r["cls_entropy_uniform"]) + 1e-6
        assert (float(r["register_mass"]) == 0) == (registers == 0)
        assert 0 <= float(r["outlier_share"]) <= 1 and float(r["max_over_median"]) >= 1
    assert "| 8 |" in (out / "registers.md").read_text()
    assert (out / "norms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_patch_size_cost_follows_the_token_count_and_the_lessons_example(lesson):
    ps = lesson("patch_size")
    assert ps.score_ratio(224, 448, 16) == pytest.approx((785 / 197) ** 2)
    assert round(ps.score_ratio(224, 448, 16), 1) == 15.9
    cfg = dict(width=16, depth=1, num_heads=2, mlp_dim=32)
    small, big = (ps.compile_config(cfg, 8, res, 2) for res in (32, 64))
    # XLA counts the compiled forward: 4× the tokens is at least 4× the FLOPs, and more memory.
    assert big["xla_gflops"] >= 4 * small["xla_gflops"] * 0.99 and big["temp_mib"] > small["temp_mib"]


@pytest.mark.slow  # the cost rule is checked above on compiled programs; this is the script's tables (~8 s)
def test_patch_size_smoke_writes_cost_and_accuracy(tmp_path, lesson):
    out = tmp_path / "ps"
    _smoke(lesson, "patch_size", out)
    cost = {(int(r["patch"]), int(r["res"])): r for r in csv.DictReader(open(out / "cost.csv"))}
    assert set(cost) == {(8, 32), (16, 32), (8, 64), (16, 64)}
    assert float(cost[(16, 64)]["token_ratio"]) == 1.0 and float(cost[(8, 64)]["score_ratio"]) == 16.0
    assert all(float(r["train_s"]) > 0 and float(r["analytic_gflops"]) > 0 for r in cost.values())
    assert len(list(csv.DictReader(open(out / "accuracy.csv")))) == 4
    assert "15.88× the score matrix" in (out / "patch_size.md").read_text()


@pytest.mark.slow  # conv == unfold is tests/models/test_patch_embed.py's; this is the script's timing tables (~8 s)
def test_patch_step_smoke_times_both_embeddings_that_agree(tmp_path, lesson):
    out = tmp_path / "pst"
    _smoke(lesson, "patch_step", out)
    rows = list(csv.DictReader(open(out / "patch_step.csv")))
    assert {(r["impl"], r["batch"]) for r in rows} == {(i, b) for i in ("conv", "unfold") for b in ("1", "2")}
    for r in rows:
        assert 0 < float(r["patch_s"]) and 0 < float(r["patch_share"]) and float(r["analytic_share"]) < 0.1
    import json

    assert json.loads((out / "setup.json").read_text())["max_abs_difference"] < 1e-4
    assert (out / "patch_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_channels_inputs(lesson):
    ch = lesson("channels")
    rgb = np.array([[[[255, 0, 0], [0, 0, 255]]]], np.uint8)  # a red and a blue pixel
    np.testing.assert_array_equal(ch.to_channels(rgb, 1)[..., 0], [[[76, 29]]])  # 0.299·255, 0.114·255
    eight = ch.to_channels(rgb, 8)
    assert eight.shape == (1, 1, 2, 8) and eight.dtype == np.uint8
    np.testing.assert_array_equal(eight, ch.to_channels(rgb, 8))  # seeded
    # Another split's seed draws other noise but the same mixture (one sensor for every split).
    big = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8)
    a, b = ch.to_channels(big, 8, seed=0).astype(float), ch.to_channels(big, 8, seed=1).astype(float)
    assert 3 < np.abs(a - b).mean() < 10 and abs((a - b).mean()) < 0.5
    with pytest.raises(ValueError, match="channels must be 1, 3 or 8"):
        ch.to_channels(rgb, 4)


@pytest.mark.slow  # the inputs are checked above, the report from the committed runs below; this is the script (17 s)
def test_channels_smoke_run(tmp_path, lesson):
    out = tmp_path / "ch"
    _smoke(lesson, "channels", out)
    cost = {(r["channels"], r["stem"]): r for r in csv.DictReader(open(out / "cost.csv"))}
    assert len(cost) == 7 and len(list(csv.DictReader(open(out / "runs.csv")))) == 14
    # The linear embedding's kernel grows with the channels (C·P²·D); the projection adds 3·(C+1).
    width, patch = 32, 8
    assert int(cost[("8", "linear")]["params"]) - int(cost[("1", "linear")]["params"]) == 7 * patch * patch * width
    assert int(cost[("8", "proj3")]["params"]) - int(cost[("3", "linear")]["params"]) == 3 * (8 + 1)
    assert "| 8 | proj3 |" in (out / "channels.md").read_text()
    assert (out / "channels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("name", "csvs"), [("positions", ("runs.csv",)), ("pooling", ("runs.csv",)),
                                            ("registers", ("runs.csv",)), ("patch_size", ("cost.csv", "accuracy.csv")),
                                            ("channels", ("runs.csv", "cost.csv")),
                                            ("patch_step", ("patch_step.csv",))])
def test_each_committed_report_is_written_again_from_its_runs_with_its_verdicts(tmp_path, name, csvs):
    """``--report`` rewrites NAME.md from the committed CSV files and setup.json, byte for byte (never
    measuring again over them): the tables as committed and the Verdicts table (the report's paired
    tests, corrected together; patch_step's timings have none)."""
    import importlib
    import shutil

    committed = ROOT / "results/lessons" / name
    for f in (*csvs, "setup.json"):
        shutil.copy(committed / f, tmp_path / f)
    written = importlib.import_module(f"experiments.lessons.{name}").main(["--report", "--out", str(tmp_path)])
    assert written.read_text() == (committed / f"{name}.md").read_text()
    assert ("corrected together (Holm)" in written.read_text()) == (name != "patch_step")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*csvs, "setup.json", f"{name}.md"])
