"""Language-model generation speed, vitmm against transformers on the same GGUF weights, in one run.

    python -m experiments.bench.decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --torch_python /path/to/venv/bin/python

For batch sizes 1 and 8, a prompt of ``--prompt_len`` tokens: the time to produce the first
token (prefill and one sample) and the time per further token (``(T(1 + n) - T(1)) / n`` over
``n = --new_tokens``), each the median of ``--repeats`` after a warm-up, both frameworks measured
the same way: vitmm's ``decode.Generator`` (KV cache, one compiled step per token) and
transformers' ``generate(do_sample=False)`` with its cache, float32, taking turns (each round
times one call of each, the first alternating). Reports prefill and decode tokens/s and vitmm's
ratio. Writes ``bench_decode.{csv,md}`` to ``--out``. The PyTorch side runs in ``--torch_python``
(with torch, transformers, gguf and accelerate), a process kept alive beside this one; both run
on the same ``--threads`` cores (this process is pinned to them before JAX starts, and the
worker inherits the pinning: XLA sizes its thread pool from the affinity, not from a setting).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import statistics
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

TORCH_WORKER = r"""
import json, sys, time, torch, transformers
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
folder, name = spec["gguf"].rsplit("/", 1)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
print("READY " + json.dumps({"framework": f"torch {torch.__version__} + transformers {transformers.__version__}"}),
      flush=True)
for line in sys.stdin:  # one timed generate per request: {"batch": B, "new": n}
    req = json.loads(line)
    top = min(1000, model.config.vocab_size)  # (a tiny test model's vocabulary is smaller)
    ids = torch.randint(3, top, (req["batch"], spec["prompt_len"]), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=req["new"], min_new_tokens=req["new"], do_sample=False)
    print(json.dumps(time.perf_counter() - start), flush=True)
"""


class VitmmSide:
    """vitmm's ``decode.Generator`` (KV cache, one compiled step per token) on the GGUF's weights."""

    def __init__(self, spec: dict):
        import jax

        from vitmm import decode
        from vitmm.interop import gguf_lm

        kwargs, self.params, _, _ = gguf_lm.load(spec["gguf"])
        self.gen, self.prompt_len = decode.Generator(kwargs), spec["prompt_len"]
        self.top = min(1000, kwargs["vocab_size"])  # the prompt's ids: below 1000, as the worker's
        self.framework = f"vitmm (jax {jax.__version__})"

    def time(self, batch: int, new: int) -> float:
        import numpy as np

        ids = np.random.default_rng(0).integers(3, self.top, (batch, self.prompt_len)).astype(np.int32)
        start = time.perf_counter()
        self.gen.generate(self.params, ids, np.ones_like(ids, bool), new, eos_id=-1)
        return time.perf_counter() - start

    def close(self):
        pass


class TorchSide:
    """transformers' ``generate(do_sample=False)`` with its cache, in ``torch_python``: one process
    kept alive, so that each timing is one request and the two frameworks can take turns."""

    def __init__(self, torch_python: str, spec: dict):
        self.proc = subprocess.Popen([torch_python, "-c", TORCH_WORKER, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.framework = json.loads(self._read("READY ")[6:])["framework"]

    def _read(self, prefix: str = "") -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
        raise SystemExit(f"the transformers worker failed:\n{self.proc.stderr.read()[-3000:]}")

    def time(self, batch: int, new: int) -> float:
        self.proc.stdin.write(json.dumps({"batch": batch, "new": new}) + "\n")
        self.proc.stdin.flush()
        return float(self._read())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def measure(sides: list, spec: dict) -> list[dict]:
    """Each side's ``{batch: {"first_s", "per_token_s"}}``: per batch and generation length (1 and
    ``1 + new_tokens``) one untimed call per side (compilation, warm-up), then ``repeats`` rounds
    in which the sides take turns, the first to go alternating; medians over the rounds."""
    out = [{} for _ in sides]
    for batch in spec["batches"]:
        medians = [{} for _ in sides]
        for new in (1, 1 + spec["new_tokens"]):
            for side in sides:
                side.time(batch, new)
            times = [[] for _ in sides]
            for r in range(spec["repeats"]):
                for i in (range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))):
                    times[i].append(sides[i].time(batch, new))
            for i, ts in enumerate(times):
                medians[i][new] = statistics.median(ts)
        for i, m in enumerate(medians):
            first, full = m[1], m[1 + spec["new_tokens"]]
            out[i][str(batch)] = {"first_s": first, "per_token_s": (full - first) / spec["new_tokens"]}
    return out


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--torch_python", required=True)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="results/bench_decode")
    args = parser.parse_args(argv)
    spec = dict(gguf=str(pathlib.Path(args.gguf).expanduser().absolute()),
                batches=[int(b) for b in args.batches.split(",")], prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, repeats=args.repeats, threads=args.threads)
    if args.threads < (os.cpu_count() or 1):  # XLA sizes its pool from the affinity; the worker inherits it
        os.sched_setaffinity(0, range(args.threads))
    sides = [VitmmSide(spec), TorchSide(args.torch_python, spec)]
    try:
        ours, theirs = measure(sides, spec)
    finally:
        sides[1].close()
    ours["framework"], theirs["framework"] = sides[0].framework, sides[1].framework
    rows = []
    for batch in spec["batches"]:
        a, b = ours[str(batch)], theirs[str(batch)]
        rows.append(dict(batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                         vitmm_prefill_tok_s=batch * args.prompt_len / a["first_s"],
                         torch_prefill_tok_s=batch * args.prompt_len / b["first_s"],
                         vitmm_decode_tok_s=batch / a["per_token_s"], torch_decode_tok_s=batch / b["per_token_s"]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_decode.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU, {args.threads} threads, float32, "
             f"`{pathlib.Path(args.gguf).name}`; {ours['framework']} against {theirs['framework']}; prompt "
             f"{args.prompt_len} tokens, {args.new_tokens} new tokens, medians of {args.repeats}. Prefill: the first "
             "token's time (prompt + one sample); decode: the time per further token.", "",
             "| batch | prefill tok/s vitmm | transformers | ratio | decode tok/s vitmm | transformers | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['vitmm_prefill_tok_s']:,.0f} | {r['torch_prefill_tok_s']:,.0f} | "
                     f"{r['vitmm_prefill_tok_s'] / r['torch_prefill_tok_s']:.2f}× | {r['vitmm_decode_tok_s']:,.1f} | "
                     f"{r['torch_decode_tok_s']:,.1f} | {r['vitmm_decode_tok_s'] / r['torch_decode_tok_s']:.2f}× |")
    (out / "bench_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    from vitmm import xla_flags

    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
