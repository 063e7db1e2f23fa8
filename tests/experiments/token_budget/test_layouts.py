"""experiments/token_budget/layouts.py: finished sweeps' tests side by side on the design they share."""

import pathlib
import shutil

from experiments.token_budget import layouts
from vitmm.study import outputs

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_layouts_cut_to_the_shared_design_and_say_what_holds(tmp_path):
    """The committed easy sweep against a copy of it in which pixel shuffle gains 15 points from 4 to 64
    tokens (where easy loses 5.1) and Q-Former was never run: the cut drops Q-Former from both, the
    blind rows hold in both, the pixel-shuffle gain is shown with opposite signs."""
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(ROOT / "results/token_budget/runs.csv", other / "runs.csv")
    rows = outputs.read_rows(other / "runs.csv")
    rows = [r for r in rows if r["family"] != "qformer"]
    for r in rows:
        if r["family"] == "pixel_shuffle" and str(r["tokens"]) == "64" and not r["variant"] and r["status"] == "ok":
            r["accuracy"] = str(float(r["accuracy"]) + 0.15)
    outputs.write_rows(rows, other / "runs.csv")
    text = layouts.main(["easy=" + str(ROOT / "results/token_budget"), f"other={other}", "--out",
                         str(tmp_path / "layouts.md")])
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
    sizes = dict(part.split() for part in text.split("(Holm; ")[1].split(" tests)")[0].split(", "))
    assert sizes["easy"] == sizes["other"] == "49"  # the same cut, the same tests: 49 each, not 98 together
    for layout, n in sizes.items():
        assert f"of {n}]`" in blind_row.split(" | ")[1 + list(sizes).index(layout)]
