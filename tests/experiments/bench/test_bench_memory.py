"""experiments/bench/memory.py on shrunk models: rows written one at a time (a rerun skips them), the
optimizer state following what each stage trains."""

import json

import pytest

from experiments.bench import memory


@pytest.mark.slow  # --dry_run's numbers are tests/train/test_dry_run.py's; this is the script's rows and table (~17 s)
def test_the_memory_rows_follow_what_each_stage_trains(tmp_path):
    rows = memory.main(["--tiny", "--only", "0.5B", "--out", str(tmp_path)])
    stage1, stage2, lora = (next(r for r in rows if r["row"].endswith(s)) for s in ("stage 1", "stage 2", "LoRA 8"))
    assert stage1["optimizer_state"] < lora["optimizer_state"] < stage2["optimizer_state"]
    assert stage1["parameters"] < lora["parameters"]  # the adapters are parameters too
    assert all(r["peak"] >= r["arguments"] > 0 and r["flops"] > 0 for r in rows)
    plain = next(r for r in rows if r["row"].endswith("no checkpointing"))  # stage 2, every activation kept
    assert plain["parameters"] == stage2["parameters"]  # (its saving: tests/train/test_dry_run.py, on an H100)
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 5
    table = (tmp_path / "memory.md").read_text()
    assert table.count("\n| VLM") == 5 and "from `--dry_run` compiled for cpu" in table
    again = memory.main(["--tiny", "--only", "0.5B", "--out", str(tmp_path)])  # nothing compiled again
    assert [r["compile_s"] for r in again] == [r["compile_s"] for r in rows]
    assert json.loads((tmp_path / "setup.json").read_text())["tiny"] is True
    with pytest.raises(SystemExit, match="made with tiny=True for cpu .* asks for tiny=True for h100"):
        memory.main(["--tiny", "--only", "0.5B", "--target", "h100", "--out", str(tmp_path)])  # no row reused
