"""Packed against padded VLM batches on a LLaVA-Instruct-like mix: padding share and training
examples/s on this CPU.

    python -m experiments.bench.packing [--examples 600] [--steps 5] [--repeats 5]

The mix (``write_mix``, a LLaVA folder of scenes JPEGs): 0 to 4 images an example (10% text-only,
60% one, 15% two, 10% three, 5% four), 1 to 3 exchanges, questions and answers of log-normal
length (answers long-tailed: median ~90 bytes, the longest past 1,000), in the byte tokenizer.
The model: ``configs/llava_finetune.py`` (tower width 128, depth 4, patch 8 at 64 px: 64 visual
tokens an image through the MLP connector; LM width 128, depth 4), ``model.max_len`` 512 text
tokens, so an example takes at most ``512 + 4 · 64 = 768`` positions.

Both modes use rows of 768 positions: ``padded`` holds one example a row (4 image slots),
``packed`` fills each row by first fit (8 bins, 8 image slots). Reported per mode: the share of
positions (and of image slots) that hold nothing, examples a row, and the trainer's compiled step
(``trainer.build``: same task and optimizer) in examples/s, the median of ``--repeats`` timings of
``--steps`` steps over the batches the input gave, with their range. Padding to each batch's
longest example (what dynamic-shape frameworks do; one compilation per shape in JAX) is given
for reference from the same lengths. Writes ``results/bench_packing/packing.{csv,md}``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np

from vitmm.config_args import load
from vitmm.data import examples
from vitmm.study import outputs
from vitmm.train import inputs, trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ("the shape red blue circle square triangle left right top bottom small large near far above below next "
         "to a an of in on is are there one two three green yellow star colour picture image").split()
IMAGES_PER_EXAMPLE = ((0, 0.10), (1, 0.60), (2, 0.15), (3, 0.10), (4, 0.05))
MAX_LEN, VISUAL, MAX_IMAGES = 512, 64, 4


def _text(rng: np.random.Generator, median: float, sigma: float, cap: int) -> str:
    n = int(min(cap, max(4, rng.lognormal(np.log(median), sigma))))
    out = ""
    while len(out) < n:
        out += WORDS[rng.integers(len(WORDS))] + " "
    return out[:n].strip()


def write_mix(out: pathlib.Path, num: int, seed: int = 0) -> pathlib.Path:
    """``out/data.json`` and ``out/images/`` (48 scenes shared by all examples): the mix above."""
    from vitmm.data import packing, scenes

    rng = np.random.default_rng(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for j in range(48):  # scenes of many shapes, as photos come: longer side 48-128 px, aspect up to 2:1
        size = packing.random_size(rng, 48, 128, 2.0)
        image = scenes.generate("easy", size, j, "train")["image"]
        (out / "images" / f"{j:06d}.jpg").write_bytes(examples.encode(image))
    counts, probs = zip(*IMAGES_PER_EXAMPLE, strict=True)
    records = []
    for i in range(num):
        k = int(rng.choice(counts, p=probs))
        conv = []
        for turn in range(int(rng.integers(1, 4))):
            tags = "".join("<image>\n" for _ in range(k)) if turn == 0 else ""
            conv += [{"from": "human", "value": tags + _text(rng, 40, 0.6, 200)},
                     {"from": "gpt", "value": _text(rng, 90, 1.0, 1200)}]
        record = {"id": f"mix{i:05d}", "conversations": conv}
        if k:
            record["image"] = [f"images/{int(j):06d}.jpg" for j in rng.integers(0, 48, k)]
        records.append(record)
    path = out / "data.json"
    path.write_text(json.dumps(records))
    return path


MODES = {"padded": dict(pack=False), "packed": dict(pack=True), "packed, own sizes": dict(pack=True, native=True)}


def _config(data: pathlib.Path, rows: int, pack: bool, native: bool = False):
    """The run of a mode: square images (pad to square, resize to 64 px: 64 tokens) in 4 slots a
    row (padded) or 8 (packed); or each image at its own size within 64 patches, one token a patch,
    its patches packed for the tower into 4 images' worth (256) a row."""
    arg = f"pack={MAX_LEN + MAX_IMAGES * VISUAL},images={MAX_IMAGES}" + (f",native={VISUAL}" if native else "")
    return load(ROOT / "configs/llava_finetune.py", arg,
                **{"input.data_path": str(data), "model.max_len": MAX_LEN, "batch_size": rows,
                   "input.sequences.pack": pack, "input.sequences.max_images": 2 * MAX_IMAGES if pack else MAX_IMAGES,
                   "input.sequences.tower_length": MAX_IMAGES * VISUAL if native else 0,
                   "input.num_threads": 1, "init.allow_random_tower": True})


class Mode:
    """One mode's batches (drawn from the trainer's input) and its compiled step."""

    def __init__(self, data: pathlib.Path, name: str, rows: int, batches: int):
        config = _config(data, rows, **MODES[name])
        self.name = name
        setup = trainer.build(config)
        it = inputs.make(config, setup.tokenizer, setup.par, setup.task)
        self.host = [next(it) for _ in range(batches)]
        if hasattr(it, "close"):
            it.close()
        self.par = setup.par
        self.state = setup.par.put_state(setup.state)
        self.step = setup.compile(self.state)
        self.placed = [setup.par.put_batch(b) for b in self.host]
        self.cursor, self.rates = 0, []
        self.time(2)  # compilation and warm-up

    def time(self, steps: int) -> float:
        """Examples/s over the next ``steps`` steps (cycling through the batches)."""
        seen, start = 0, time.perf_counter()
        for _ in range(steps):
            k = self.cursor % len(self.placed)
            self.state, out = self.step(self.state, self.placed[k])
            seen += per_row_count(self.host[k])
            self.cursor += 1
        jax.block_until_ready((self.state, out))
        return seen / (time.perf_counter() - start)

    def row(self) -> dict:
        """The mode's numbers. ``tower_padding``: the share of the tower's input that holds no image
        (empty image slots; with the tower's patches packed, padding patches)."""
        segments = np.stack([b["segment_ids"] for b in self.host]).reshape(-1, self.host[0]["segment_ids"].shape[-1])
        if "tower_segments" in self.host[0]:
            used = np.stack([b["tower_segments"] > 0 for b in self.host])
            tower = f"{used.shape[-1]} patches"
        else:
            used = np.stack([np.asarray(b["images"]).reshape(*b["images"].shape[:2], -1).std(-1) > 0
                             for b in self.host])
            tower = f"{used.shape[-1]} image slots"
        return {"mode": self.name, "rows": len(self.host[0]["segment_ids"]),
                "length": segments.shape[-1], "tower_input": tower,
                "visual_per_example": float(np.mean([(b["visual"] >= 0).sum() / per_row_count(b) for b in self.host])),
                "examples_per_row": float(np.mean([len(set(r[r > 0].tolist())) for r in segments])),
                "padding_share": float(np.mean(segments == 0)), "tower_padding": float(1 - used.mean()),
                "examples_per_s": statistics.median(self.rates), "examples_per_s_min": min(self.rates),
                "examples_per_s_max": max(self.rates)}

    def lengths(self) -> list[int]:
        segments = np.stack([b["segment_ids"] for b in self.host]).reshape(-1, self.host[0]["segment_ids"].shape[-1])
        return [int((r == s).sum()) for r in segments for s in set(r[r > 0].tolist())]


def per_row_count(batch: dict) -> int:
    return sum(len(set(r[r > 0].tolist())) for r in np.asarray(batch["segment_ids"]))


def longest_in_batch_share(lengths: list[int], batch: int, seed: int = 0) -> float:
    """Padding share when each batch of ``batch`` examples (in a random order) is padded to its
    longest."""
    order = np.random.default_rng(seed).permutation(np.asarray(lengths))
    order = order[: len(order) // batch * batch].reshape(-1, batch)
    return float(1 - order.sum() / (order.max(1).sum() * batch))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=600)
    parser.add_argument("--rows", type=int, default=8, help="rows a step (every mode)")
    parser.add_argument("--batches", type=int, default=20, help="batches drawn per mode (the steps cycle over them)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "results/bench_packing"))
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = write_mix(pathlib.Path(tempfile.mkdtemp(prefix="vitmm_mix_")), args.examples)
    modes = [Mode(data, name, args.rows, args.batches) for name in MODES]
    for _ in range(args.repeats):  # the modes' timings interleaved, so that load on the machine hits each
        for mode in modes:
            mode.rates.append(mode.time(args.steps))
    lengths = modes[0].lengths()
    rows = [mode.row() for mode in modes]
    table = [
        f"| batches of {args.rows} rows × {rows[0]['length']} positions | visual tokens an example | examples a row | "
        "padding (positions) | tower input | its padding | training examples/s (median, range) |",
        "|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        table.append(f"| {r['mode']} | {r['visual_per_example']:.1f} | {r['examples_per_row']:.2f} | "
                     f"{100 * r['padding_share']:.1f}% | {r['tower_input']} a row | {100 * r['tower_padding']:.1f}% | "
                     f"{r['examples_per_s']:.1f} ({r['examples_per_s_min']:.1f}–{r['examples_per_s_max']:.1f}) |")
    base = rows[0]["examples_per_s"]
    dynamic = longest_in_batch_share(lengths, args.rows)
    text = "\n".join([
        *table, "",
        "Training examples/s against padded: " + ", ".join(f"{r['mode']} **{r['examples_per_s'] / base:.2f}×**"
                                                          for r in rows[1:])
        + f" (medians of {args.repeats} timings of {args.steps} steps each, the modes interleaved in one run). "
        f"Padding each batch of {args.rows} square-image examples to its longest instead of to {rows[0]['length']} "
        f"would leave {100 * dynamic:.1f}% padding (the same {len(lengths)} examples' lengths: median "
        f"{int(np.median(lengths))}, longest {max(lengths)} positions)."])
    outputs.write_outputs(out, "packing", {"examples": args.examples, "rows": args.rows, "steps": args.steps,
                                           "repeats": args.repeats, "max_len": MAX_LEN, "visual_per_image": VISUAL},
                          text, {"packing.csv": rows})
    return rows


if __name__ == "__main__":
    main()
