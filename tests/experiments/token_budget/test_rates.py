"""The rate check: a finished sweep's cells again at their chosen rate's ladder neighbours, compared on
validation, and the budget effect under each budget's best rate (the sweeps faked: their wiring and the
report, not training, are what is tested here)."""

import json
import pathlib

import pytest

from experiments.token_budget import rates
from experiments.token_budget import sweep as tb
from vitmm.study import outputs

# {(family, tokens): {ladder step: [(validation at the tested check, test) per seed]}}
RUNS = {("pool", 4): {0: [(0.50, 0.48), (0.52, 0.50)], -1: [(0.40, 0.41), (0.42, 0.40)],
                     1: [(0.60, 0.57), (0.58, 0.55)]},
        ("pool", 64): {0: [(0.70, 0.66), (0.68, 0.68)], -1: [(0.69, 0.60), (0.69, 0.62)],
                       1: [(0.69, 0.64), (0.69, 0.60)]},
        ("qformer", 16): {0: [(0.45, 0.44), (0.47, 0.46)], -1: [(0.47, 0.45), (0.47, 0.45)],
                          1: [(0.30, 0.3), (0.3, 0.3)]}}
_SMOKE = tb.parse_args(["--smoke", "--out", "/nonexistent"])  # the settings the faked sweeps ran with
SETUP = {"tower_fingerprint": "t", "data": "hard_64", "lm": _SMOKE.lm, "seeds": [0, 1, 2],
         **{k: getattr(_SMOKE, k) for k in ("stage0_lr", "stage0_steps", "stage1_steps", "tokenizer")},
         "plan": {"max_steps": 1000, **{k: getattr(_SMOKE, k) for k in ("batch_size", "eval_every", "curve_questions",
                                                                        "patience")}, "min_delta": 0.005},
         "tune_budget": 16, "tune_seed": 0, "chosen": {"pool": [3e-4, 25], "qformer": [1e-4, 250], "blind": [1e-3, 25]}}


def write_sweep(directory, step, seeds=(0, 1), blind=True):
    """A finished sweep's files: each cell's runs at ladder step ``step`` (checked at step 750 of 1000)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for (family, tokens), by_step in RUNS.items():
        for seed in seeds:
            val, test = by_step[step][seed]
            rows.append({"family": family, "budget": "all" if tokens == 64 else tokens, "variant": "", "tokens": tokens,
                         "note": "", "seed": seed, "status": "ok", "accuracy": test, "best_step": 750,
                         "steps_trained": 1000})
            curves[f"{family}|{tokens}||{seed}"] = [[500, val - 0.1], [750, val], [1000, val - 0.01]]
    if blind:
        rows.append({"family": "blind", "budget": 0, "variant": "", "tokens": 1, "note": "", "seed": 0, "status": "ok",
                     "accuracy": 0.3, "best_step": 250, "steps_trained": 1000})
    outputs.write_rows(rows, directory / "runs.csv")
    (directory / "curves.json").write_text(json.dumps(curves))
    (directory / "setup.json").write_text(json.dumps(SETUP))


def test_each_cell_is_compared_on_validation_and_the_budget_effect_under_each_budgets_best_rate():
    by_step = {k: {cell: dict(enumerate(runs[k])) for cell, runs in RUNS.items()} for k in (-1, 0, 1)}
    lines = rates.compare(by_step, {"pool": {-1: 1e-4, 0: 3e-4, 1: 1e-3}, "qformer": {-1: 3e-5, 0: 1e-4, 1: 3e-4}},
                          [0, 1], 0.005)
    row = {tuple(line.split(" | ")[:2]): line for line in lines if line.startswith("| pool") or line.startswith("| qf")}
    # pool at 4 tokens: 1e-3 best by 8 points and the outermost rate tried, so the ladder should go on.
    assert row[("| pool", "4")] == "| pool | 4 | 2 | 41.0 | **51.0** | 59.0 | 0.001 | +8.0 | yes |"
    # At 64 tokens the three rates tie: the sweep's own wins a tie (the nearest to it).
    assert row[("| pool", "64")] == "| pool | 64 | 2 | 69.0 | **69.0** | 69.0 | 0.0003 | +0.0 |  |"
    # Q-Former: the smaller rate leads by 1 point, by 1 point over the sweep's: an edge too.
    assert row[("| qformer", "16")] == "| qformer | 16 | 2 | 47.0 | **46.0** | 30.0 | 3e-05 | +1.0 | yes |"
    # pool 4 → 64 on test: 67 − 49 = +18.0 at the sweep's rate; 67 − 56 = +11.0 at each budget's best.
    assert "| pool | 4 → 64 | +18.0 | +11.0 | yes |" in lines
    assert not any(line.startswith("| qformer | 16 →") for line in lines)  # one count: no budget effect


def test_a_missing_rate_is_said_not_compared():
    by_step = {0: {("pool", 4): {0: (0.5, 0.5)}}, 1: {}}
    lines = rates.compare(by_step, {"pool": {0: 3e-4, 1: 1e-3}}, [0], 0.005)
    assert "| pool | 4 | 0 |  |  | not all rates ran | | |" in lines


def test_the_neighbours_run_as_sweeps_of_their_own_and_rates_md_compares_them(tmp_path, monkeypatch):
    main_dir = tmp_path / "hard"
    write_sweep(main_dir, 0)
    calls = []

    def fake_sweep(argv):
        calls.append(argv)
        out = argv[argv.index("--out") + 1]
        write_sweep(pathlib.Path(out), int(out.rsplit("_", 1)[1]), blind=False)

    monkeypatch.setattr(tb, "main", fake_sweep)
    out = rates.main(["--main", str(main_dir), "--workers", "1", "--smoke"])
    assert out == main_dir / "rates"
    assert [a[a.index("--out") + 1] for a in calls] == [str(out / "lr_-1"), str(out / "lr_+1")]
    lower = calls[0]
    assert lower[:3] == ["--smoke", "--tower", str(main_dir / "tower")]  # the sweep's own options and tower
    assert lower[lower.index("--chosen") + 1] == "pool=0.0001/25,qformer=3e-05/250"  # one rung down, same warmup
    assert lower[lower.index("--budgets") + 1] == "4,all,16" and "--no_blind" in lower
    assert lower[lower.index("--steps") + 1] == "1000" and lower[lower.index("--seeds") + 1] == "0,1"
    md = (out / "rates.md").read_text()
    assert "pool 0.0003 (warmup 25), qformer 0.0001 (warmup 250)" in md
    assert "| pool | 4 | 2 | 41.0 | **51.0** | 59.0 | 0.001 | +8.0 | yes |" in md
    calls.clear()
    assert rates.main(["--main", str(main_dir), "--report"]) == out and not calls  # --report trains nothing
    assert (out / "rates.md").read_text().splitlines()[3:] == md.splitlines()[3:]  # the command line aside
    # A neighbour sweep made under other settings is refused, nothing compared.
    setup = json.loads((out / "lr_+1" / "setup.json").read_text())
    (out / "lr_+1" / "setup.json").write_text(json.dumps({**setup, "data": "easy_64"}))
    with pytest.raises(SystemExit, match=r"differ from the sweep .* in \['data'\]"):
        rates.main(["--main", str(main_dir), "--report"])


def test_options_that_would_train_under_other_settings_are_refused_before_any_run(tmp_path, capsys, monkeypatch):
    """The rate sweeps' settings are compared with the main sweep's before anything trains (their own
    setup.json exists only once they have finished): a sweep run with other options is refused at once."""
    write_sweep(tmp_path / "m", 0)
    monkeypatch.setattr(tb, "main", lambda argv: pytest.fail("trained"))
    with pytest.raises(SystemExit):
        rates.main(["--main", str(tmp_path / "m"), "--smoke", "--stage1_steps", "99"])
    err = capsys.readouterr().err
    assert "other settings than the sweep" in err and "'stage1_steps'" in err


@pytest.mark.parametrize("argv, says", [
    (["--steps_away", "0,1"], "nonzero ladder steps"),
    (["--steps_away", "up"], "comma-separated integers"),
    (["--families", "ldp"], "--families ['ldp']"),
    (["--seeds", "0,7"], "--seeds [7]"),
])
def test_bad_options_are_one_line_naming_them(tmp_path, capsys, argv, says):
    write_sweep(tmp_path / "m", 0)
    with pytest.raises(SystemExit):
        rates.main(["--main", str(tmp_path / "m"), *argv])
    assert says in capsys.readouterr().err


def test_the_ladder_moves_by_rungs():
    assert [rates.step_rate(3e-4, k) for k in (-2, -1, 1, 2)] == [3e-5, 1e-4, 1e-3, 3e-3]


@pytest.mark.slow  # ~30 s: three smoke sweeps; the wiring and the report: the tests above
def test_the_rate_check_reruns_a_finished_smoke_sweep(tmp_path, clip_smoke_run):
    out = tmp_path / "tb"
    common = ["--smoke", "--workers", "1", "--tower", str(clip_smoke_run.workdir), "--data_dir",
              clip_smoke_run.data_dir]
    tb.main([*common, "--out", str(out), "--families", "pool", "--budgets", "4,all", "--seeds", "0,1",
             "--param_budget", "0", "--encoder_budgets", ""])
    checked = rates.main(["--main", str(out), "--steps_away", "1", *common])
    setup = json.loads((out / "setup.json").read_text())
    higher = json.loads((checked / "lr_+1" / "setup.json").read_text())
    lr, warmup = setup["chosen"]["pool"]
    assert higher["chosen"] == {"pool": [rates.step_rate(lr, 1), warmup]} and higher["seeds"] == [0, 1]
    md = (checked / "rates.md").read_text()
    assert "| pool | 4 | 2 |" in md and "| pool | 16 | 2 |" in md and "| pool | 4 → 16 |" in md  # smoke: a 4×4 grid


def test_a_ladder_with_a_gap_is_refused(tmp_path, capsys):
    """``--steps_away=-2`` alone would choose each cell's best among the sweep's rate and two rungs down,
    leaving out the rung between (and rates.md's earlier -1 and +1 columns): the steps must reach 0."""
    write_sweep(tmp_path / "m", 0)
    with pytest.raises(SystemExit):
        rates.main(["--main", str(tmp_path / "m"), "--steps_away=-2"])
    assert "--steps_away -2: include -1" in capsys.readouterr().err
    assert "--steps_away=-2,-1,1" in rates.__doc__


def test_families_not_checked_are_left_out_of_rates_md(tmp_path, monkeypatch):
    """With ``--families pool`` the sweep's Q-Former cells were not rerun: rates.md has no row saying
    'not all rates ran' for them."""
    write_sweep(tmp_path / "m", 0)
    monkeypatch.setattr(tb, "main", lambda argv: write_sweep(pathlib.Path(argv[argv.index("--out") + 1]),
                                                             int(argv[argv.index("--out") + 1].rsplit("_", 1)[1]),
                                                             blind=False))
    md = (rates.main(["--main", str(tmp_path / "m"), "--families", "pool", "--smoke"]) / "rates.md").read_text()
    assert "| pool | 4 | 2 |" in md and "qformer" not in md.split("chose each rate")[1]
