"""experiments/token_budget/layouts.py: finished sweeps' tests side by side on the design they share."""

import json
import pathlib
import shutil

import pytest

from experiments.token_budget import layouts
from vitmm.study import outputs

ROOT = pathlib.Path(__file__).resolve().parents[3]
EASY = ROOT / "results/token_budget"
FIVE = ("blind", "pool", "pixel_shuffle", "perceiver", "qformer", "c_abstractor")  # the hard sweep's families


def sweep(tmp_path, name, keep=lambda r: True, setup=None, rows=None):
    """A finished sweep folder from the committed easy sweep's rows that ``keep`` keeps (or ``rows``),
    its setup.json updated with ``setup``."""
    folder = tmp_path / name
    folder.mkdir()
    rows = [r for r in outputs.read_rows(EASY / "runs.csv") if keep(r)] if rows is None else rows
    outputs.write_rows(rows, folder / "runs.csv")
    (folder / "setup.json").write_text(json.dumps({**json.loads((EASY / "setup.json").read_text()), **(setup or {})}))
    return folder


def five(r):
    return r["family"] in FIVE and not r["variant"]


def test_layouts_cut_to_the_shared_design_and_say_what_holds(tmp_path):
    """The committed easy sweep against a copy of it in which pixel shuffle gains 15 points from 4 to 64
    tokens (where easy loses 5.1) and Q-Former was never run: the cut drops Q-Former from both, the
    blind rows hold in both, the pixel-shuffle gain is shown with opposite signs."""
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(EASY / "runs.csv", other / "runs.csv")
    shutil.copy(EASY / "setup.json", other / "setup.json")
    rows = outputs.read_rows(other / "runs.csv")
    rows = [r for r in rows if r["family"] != "qformer"]
    for r in rows:
        if r["family"] == "pixel_shuffle" and str(r["tokens"]) == "64" and not r["variant"] and r["status"] == "ok":
            r["accuracy"] = str(float(r["accuracy"]) + 0.15)
    outputs.write_rows(rows, other / "runs.csv")
    text = layouts.main(["easy=" + str(EASY), f"other={other}", "--out", str(tmp_path / "layouts.md")])
    assert text == (tmp_path / "layouts.md").read_text()
    assert "qformer" not in text.split("\n")[0] and "pixel_shuffle, pool" in text.split("\n")[0]
    row = next(line for line in text.splitlines() if line.startswith("| pixel_shuffle 4 → 64 tokens |"))
    assert "`[shown: -5.1," in row and "`[shown: +9.9," in row and row.endswith("| opposite signs shown |")
    best = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| best − worst")}
    assert best["| best − worst family at 4 tokens"].endswith("| shown in none |")  # the same pair in both
    assert "(ldp − c_abstractor)" in best["| best − worst family at 64 tokens"]  # pixel shuffle the best in other:
    assert best["| best − worst family at 64 tokens"].endswith("| different pairs: not one test |")  # no verdict
    blind_row = next(line for line in text.splitlines() if line.startswith("| pool@16 − blind |"))
    assert blind_row.endswith("| holds in every layout |")
    # Each layout corrected on its own: its tags count its own tests, as the header says.
    sizes = dict(part.split() for part in text.split("(Holm; ")[1].split(" tests")[0].split(", "))
    assert sizes["easy"] == sizes["other"] == "49"  # the same cut, the same tests: 49 each, not 98 together
    for layout, n in sizes.items():
        assert f"of {n}]`" in blind_row.split(" | ")[1 + list(sizes).index(layout)]


def test_sweeps_made_under_other_settings_are_refused_in_one_line(tmp_path):
    """Another training plan (or LM) is refused, naming the key and both values; what the hard sweep
    changes by design (its data and so its question counts, vocabulary and longest question, its tower,
    its chosen rates and tuning record, no equal-parameter rows, one worker, its families) is not."""
    hard_like = dict(data="scenes/hard_64", tower="results/token_budget/hard/tower",
                     tower_fingerprint="a0e3dbfc9dec98c7", tower_config={"width": 96},
                     chosen={"pool": [3e-4, 25]}, tuning={}, param_budget=0, workers=1,
                     vocab_size=60, max_len=20, train_questions=1, val_questions=2, test_questions=3,
                     train_images=9, connectors={}, stage0_final_loss={}, date="2026-12-08", command="x",
                     worker_hours=1.0, runs_timed=3, backend="gpu", seeds=[0, 1, 2])
    easy = sweep(tmp_path, "easy", five)
    text = layouts.main([f"easy={easy}", f"hard={sweep(tmp_path, 'hard', five, hard_like)}"])
    assert "Data: easy scenes/easy_64, hard scenes/hard_64." in text.split("\n")[0]
    plan = dict(json.loads((EASY / "setup.json").read_text())["plan"], max_steps=300)
    with pytest.raises(SystemExit, match=r"^easy and short differ in plan\.max_steps: 8000 vs 300; "):
        layouts.main([f"easy={easy}", f"short={sweep(tmp_path, 'short', five, dict(hard_like, plan=plan))}"])
    with pytest.raises(SystemExit, match=r"differ in lm\.width: 64 vs 576"):
        big = sweep(tmp_path, "big", five, {"lm": dict(width=576, depth=2, num_heads=2)})
        layouts.main([f"easy={easy}", f"big={big}"])
    with pytest.raises(SystemExit, match=r"differ in stage0_steps: 1000 vs 0"):
        layouts.main([f"easy={easy}", f"s={sweep(tmp_path, 's', five, {'stage0_steps': 0})}"])
    # Rates given with --chosen, not tuned on the layout's own validation split: another tuning protocol.
    with pytest.raises(SystemExit, match=r"differ in chosen_given: False vs True"):
        layouts.main([f"easy={easy}", f"given={sweep(tmp_path, 'given', five, {'chosen_given': True})}"])
    (easy / "setup.json").unlink()
    with pytest.raises(SystemExit, match="has no setup.json"):
        layouts.main([f"easy={easy}", f"hard={tmp_path / 'hard'}"])


def test_the_header_says_what_the_cut_holds_and_lists_the_tests_it_lost(tmp_path):
    """Pool never ran at 4 tokens in one sweep: the header says pool at 16 and 64 tokens only, and
    pool@4 − blind is named among the tests the other's report makes that the cut cannot."""
    easy = sweep(tmp_path, "easy", five)
    other = sweep(tmp_path, "other", lambda r: five(r) and not (r["family"] == "pool" and str(r["tokens"]) == "4"))
    text = layouts.main([f"easy={easy}", f"other={other}"])
    head = text.split("\n")[0]
    assert "pool at 16, 64 tokens" in head and "perceiver, pixel_shuffle, qformer at 4, 16, 64 tokens" in head
    assert "and blind, seeds 0, 1, 2, 3, 4" in head
    assert "The analysis of variance uses pixel_shuffle, c_abstractor, perceiver, qformer (the families" in head
    lost = next(line for line in text.splitlines() if line.startswith("Tests easy's report makes that this cut cannot"))
    assert "pool@4 − blind" in lost and "pool 4 → 64 tokens" in lost
    assert "What the cut took from each sweep (besides its equal-parameter and encoder-side rows): easy: cells " \
           "pool@4" in text


def test_a_cut_without_blind_or_with_no_run_in_common_is_refused(tmp_path):
    easy = sweep(tmp_path, "easy", five)
    with pytest.raises(SystemExit, match="share no finished blind run"):
        layouts.main([f"easy={easy}", f"nb={sweep(tmp_path, 'nb', lambda r: five(r) and r['family'] != 'blind')}"])
    moved = [dict(r, seed=str(int(r["seed"]) + 5)) for r in outputs.read_rows(EASY / "runs.csv") if five(r)]
    with pytest.raises(SystemExit, match="share no finished .family, token count, seed. run"):
        layouts.main([f"easy={easy}", f"later={sweep(tmp_path, 'later', rows=moved)}"])


def test_a_layout_or_folder_named_twice_is_refused(tmp_path, capsys):
    easy, other = sweep(tmp_path, "easy", five), sweep(tmp_path, "other", five)
    with pytest.raises(SystemExit):
        layouts.main([f"easy={easy}", f"easy={other}"])
    assert "name each layout once: easy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layouts.main([f"easy={easy}", f"hard={easy}"])
    assert "give each sweep once" in capsys.readouterr().err


def test_an_interim_sweep_is_refused(tmp_path):
    easy = sweep(tmp_path, "easy", five)
    interim = sweep(tmp_path, "interim", five, {"interim": {"runs": 60, "of": 80}})
    with pytest.raises(SystemExit, match=r"interim sweep \(60 of 80 runs\): layouts compares finished sweeps"):
        layouts.main([f"easy={easy}", f"hard={interim}"])
    rows = [r for r in outputs.read_rows(EASY / "runs.csv") if five(r)]
    rows = [r for r in rows if not (r["family"] == "qformer" and str(r["tokens"]) == "64")]
    rows.append(dict(rows[-1], family="qformer", tokens="64", seed="", status="pending", note="no seed finished yet"))
    with pytest.raises(SystemExit, match=r"interim sweep \(1 cells pending\)"):
        layouts.main([f"easy={easy}", f"hard={sweep(tmp_path, 'pending', rows=rows)}"])


def test_verdicts_that_differ_from_a_layouts_own_report_are_listed(tmp_path):
    """On the hard sweep's five families the committed easy sweep's family × budget interaction is not
    shown (39 tests, 5 families), though token_budget.md shows it (80 tests, 8 families): the output
    says the tests are recomputed on the cut and names that verdict with both tags."""
    text = layouts.main(["easy=" + str(EASY), f"hard={sweep(tmp_path, 'hard', five)}"])
    assert "its report's tests recomputed on this cut" in text.split("\n")[0]
    differ = text.split("Verdicts here that differ from easy's own report")[1].split("Tests hard's")[0]
    assert ("- analysis of variance: family × budget (share of the variance, %): here `[not shown: +6.7, Holm p 0.37 "
            "of 39]`; its report `[shown: +13.1, Holm p 8.8e-06 of 80]`") in differ
    assert "(pixel_shuffle − qformer); its report `[shown: +9.2, Holm p 0.041 of 80]` (patch_merger − qformer)" \
           in differ
    assert ("Verdicts here that differ from hard's own report (cite that report for its design, this table for the "
            "cut): none.") in text


def test_the_tests_a_report_makes_that_the_cut_cannot_include_its_variant_rows(tmp_path):
    """Easy's report makes 80 tests, the cut 39 of them: the 41 it cannot include the equal-parameter and
    encoder-side rows' tests (27), not only the main table's (14), and the line says how many."""
    text = layouts.main(["easy=" + str(EASY), f"hard={sweep(tmp_path, 'hard', five)}"])
    lost = next(line for line in text.splitlines() if line.startswith("Tests easy's report makes that this cut"))
    assert lost.startswith("Tests easy's report makes that this cut cannot (41 of its 80): ")
    for name in ("patch_merger@4 − blind", "pool@16 (params ≈ 100,000) − default size",
                 "best − worst at equal parameters", "image 16 px − pool at 4 tokens",
                 "patch 32 − best connector at 4 tokens (pixel_shuffle)"):
        assert name in lost
    assert "Tests hard's report makes that this cut cannot: none." in text


def test_the_header_says_a_verdict_shown_in_some_layouts_only_is_no_difference_between_them(tmp_path):
    text = layouts.main(["easy=" + str(EASY), f"hard={sweep(tmp_path, 'hard', five)}"])
    assert "A test shown in some layouts only is not shown to differ between them" in text.split("\n")[0]


def test_the_committed_layouts_table_is_written_again_from_the_sweeps_runs(tmp_path):
    """``layouts.md`` (easy against hard) is what the code writes from the two sweeps' committed
    runs.csv and setup.json, so its verdicts cannot drift from the runs."""
    out = tmp_path / "layouts.md"
    layouts.main([f"easy={ROOT / 'results/token_budget'}", f"hard={ROOT / 'results/token_budget/hard'}",
                  "--out", str(out)])
    assert out.read_text() == (ROOT / "results/token_budget/layouts.md").read_text()
