"""`python -m experiments.bench decode`: the vitmm side on a tiny GGUF (the transformers side needs torch)."""

import importlib
import pathlib

import numpy as np

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures/interop/gguf_llama/tiny.gguf"


class Recorder:
    """A stand-in side: its calls, in order, into a shared log; a fixed time per generated token."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def time(self, batch, new):
        self.log.append((self.name, batch, new))
        return 0.01 * new


def test_the_decode_benchmark_times_vitmm_and_the_other_side_taking_turns():
    bench = importlib.import_module("experiments.bench.decode")
    spec = dict(gguf=str(FIXTURE), batches=[1, 2], prompt_len=5, new_tokens=3, repeats=3)
    log = []
    ours, theirs = bench.measure([bench.VitmmSide(spec), Recorder("other", log)], spec)
    # timings only (a tiny model's per-token estimate is noise): present and finite for each batch
    assert all(ours[b]["first_s"] > 0 and np.isfinite(ours[b]["per_token_s"]) for b in ("1", "2"))
    assert theirs["1"] == {"first_s": 0.01, "per_token_s": 0.01}
    # per batch and length: one warm-up call, then one call per round (the other side's calls interleave
    # with vitmm's, which the log does not see: each round is one call of each)
    assert log == [("other", b, n) for b in (1, 2) for n in (1, 4) for _ in range(4)]
    order = []
    sides = [Recorder("a", order), Recorder("b", order)]
    bench.measure(sides, dict(spec, batches=[1], repeats=3))
    assert order[:8] == [("a", 1, 1), ("b", 1, 1), ("a", 1, 1), ("b", 1, 1), ("b", 1, 1), ("a", 1, 1),
                         ("a", 1, 1), ("b", 1, 1)]  # warm-ups, then rounds whose first side alternates

