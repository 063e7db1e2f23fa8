"""Language-model generation speed, vitmm against transformers on the same GGUF weights, in one run.

    python -m experiments.bench.decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --torch_python /path/to/venv/bin/python

For batch sizes 1 and 8, a prompt of ``--prompt_len`` tokens: the time to produce the first
token (prefill and one sample) and the time per further token (``(T(1 + n) - T(1)) / n`` over
``n = --new_tokens``), each the median of ``--repeats`` after a warm-up, both frameworks measured
the same way: vitmm's ``decode.Generator`` (KV cache, one compiled step per token) and
transformers' ``generate(do_sample=False)`` with its cache, float32, taking turns. Reports
prefill and decode tokens/s and vitmm's ratio. Writes ``bench_decode.{csv,md}`` to ``--out``.
The PyTorch side runs in ``--torch_python`` (with torch, transformers, gguf and accelerate).
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
import json, statistics, sys, time, torch, transformers
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
path = spec["gguf"]
folder, name = path.rsplit("/", 1)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
out = {}
for batch in spec["batches"]:
    ids = torch.randint(3, 1000, (batch, spec["prompt_len"]), generator=torch.Generator().manual_seed(0))
    def run(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    def median(n):
        run(n)
        times = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter(); run(n); times.append(time.perf_counter() - start)
        return statistics.median(times)
    first, full = median(1), median(1 + spec["new_tokens"])
    out[str(batch)] = {"first_s": first, "per_token_s": (full - first) / spec["new_tokens"]}
print("RESULT " + json.dumps({"framework": f"torch {torch.__version__} + transformers {transformers.__version__}",
                              **out}))
"""


def vitmm_side(spec: dict) -> dict:
    import numpy as np

    from vitmm import decode
    from vitmm.interop import gguf_lm

    kwargs, params, _, _ = gguf_lm.load(spec["gguf"])
    gen = decode.Generator(kwargs)
    out = {}
    for batch in spec["batches"]:
        ids = np.random.default_rng(0).integers(3, 1000, (batch, spec["prompt_len"])).astype(np.int32)
        mask = np.ones_like(ids, bool)

        def median(n, ids=ids, mask=mask):
            gen.generate(params, ids, mask, n, eos_id=-1)  # compiles this cache length
            times = []
            for _ in range(spec["repeats"]):
                start = time.perf_counter()
                gen.generate(params, ids, mask, n, eos_id=-1)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        first, full = median(1), median(1 + spec["new_tokens"])
        out[str(batch)] = {"first_s": first, "per_token_s": (full - first) / spec["new_tokens"]}
    import jax

    return {"framework": f"vitmm (jax {jax.__version__})", **out}


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
    ours = vitmm_side(spec)
    proc = subprocess.run([args.torch_python, "-c", TORCH_WORKER, json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the transformers worker failed:\n{proc.stderr[-3000:]}")
    theirs = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
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
