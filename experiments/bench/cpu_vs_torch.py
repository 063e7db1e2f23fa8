"""vitmm against a PyTorch reference, side by side in one run: ViT and CLIP training and inference speed.

    python -m experiments.bench.cpu_vs_torch                       # ViT-Ti/16, S/16, CLIP B/32 pairs; 224 px, batch 32
    python -m experiments.bench.cpu_vs_torch --pair '' --variants S/16   # ViT-S/16 alone
    python -m experiments.bench.cpu_vs_torch --variants Ti/16,S/16,B/16 --repeats 7
    python -m experiments.bench.cpu_vs_torch --torch_python /path/to/venv/bin/python   # PyTorch lives elsewhere
    python -m experiments.bench.cpu_vs_torch --torch_python ... --timm_python /path/to/timm-venv/bin/python
    python -m experiments.bench.cpu_vs_torch --scaling S --batch 8 # step time vs tokens, next to the analytic count

For each variant, a JAX worker process and a PyTorch worker process take turns (so drift on a
shared machine hits both alike) and each reports: training-step and inference images/s (median
over ``--repeats`` timed steps after warm-up), compile time (JAX), peak resident memory of the
process, achieved FLOP/s from the analytic count (forward per image = 2·N_p·3P²·D +
L·(24·N·D² + 4·N²·D), training = 3× forward; cross-checked against XLA's cost analysis) and the
share of a float32 matmul rate measured in the same worker. The reference is transformers'
``ViTForImageClassification`` with SDPA attention (the same shapes: CLS, 1000-class head, AdamW,
cross-entropy). ``--timm_python`` adds timm's ``VisionTransformer`` (fused SDPA attention) as a
second ViT reference, from an interpreter with ``torch`` and ``timm`` (timm needs torchvision,
which here imports only beside ``torch==2.14.1``, hence its own interpreter). The ratio column
is vitmm's throughput over the row's.

``--pair`` (default ``B/32``) adds CLIP image+text pairs with that image tower and OpenAI CLIP's
text tower (width 512, 12 layers, 8 heads, 77 tokens, vocabulary 49,408, causal, pooled at the
end-of-text token; embeddings 512; ``--pair_text_*`` change it): the softmax contrastive loss of
``TwoTowers`` against transformers' ``CLIPModel(..., return_loss=True)``, and for inference the
image-text logits. Throughput is then image+text pairs/s, and the analytic count adds the text
tower by the same formula (N = 77).

The XLA column divides XLA's cost analysis of the compiled step (or forward) by the analytic
count (3× forward for a training step): above 1 where norms, softmax, heads and the optimizer add
FLOPs, a little under 1 in training where the patch embedding needs no input gradient.

PyTorch is not a vitmm dependency: pass ``--torch_python`` for an interpreter
that has ``torch`` and ``transformers`` (``torch==2.13.0`` installs from a local file here), or
``--no_torch``. Both frameworks run on the same ``--threads`` cores (default: all): each worker pins
itself to the first ``--threads`` cores before its framework starts, as XLA sizes its thread pool
from the process's CPU affinity (``OMP_NUM_THREADS`` does not reach it); torch is also told
``set_num_threads``.

Every worker, of either framework, starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` added
(``--glibc_tunables``; '' for none): malloc then asks the kernel for transparent huge pages for its
large blocks, and XLA's per-step temporaries no longer page-fault 4 KiB at a time (the faults/step
column counts them).

Writes ``benchmark.csv`` and ``benchmark.md`` (with ratios vitmm / reference) to ``--out``.
``--rounds R`` runs every worker R times, taking turns (the first to go alternating between
rounds: since 2026-12-07; before, vitmm's worker went first in every round): times are medians
over the rounds, a ratio is the median of the rounds' paired ratios, shown with their range (on
a shared machine one run's ratio can move by ±0.1).

``--scaling WIDTH`` instead times vitmm alone (inference and training) at 224 px with patches 32, 16
and 8 and at 448 px with patch 16 (49 to 3,136 tokens), and sets each time, relative to /16 at
224 px, next to the analytic FLOP ratio: where the measured ratio exceeds the prediction, the
N² attention terms or memory traffic cost more than their FLOPs. Writes ``scaling.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
# XLA:CPU allocates a step's temporaries as one block (~1.4 GB for ViT-Ti/16 training at batch 32),
# which glibc maps afresh each step: ~360,000 page faults of 4 KiB. With this tunable (glibc >= 2.35)
# malloc asks for transparent huge pages where the kernel's THP mode is "madvise", and the faults
# drop to ~2,000 (results/benchmark/README.md). Older glibc ignores it.
HUGE_PAGES = "glibc.malloc.hugetlb=1"


# ------------------------------------------------------------------------------------ driver
def _with_tunables(tunables: str) -> str:
    """``GLIBC_TUNABLES`` of this process with ``tunables`` appended."""
    return ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), tunables) if t)


def _run_worker(python: str, kind: str, spec: dict, threads: int, tunables: str = "") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if tunables:  # glibc reads them when a process starts, so each worker gets them in its environment
        env["GLIBC_TUNABLES"] = _with_tunables(tunables)
    proc = subprocess.run([python, "-m", "experiments.bench.workers", "--kind", kind, "--spec",
                           json.dumps({**spec, "threads": threads})], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def analytic_gflop(variant: str, res: int, pair: dict | None = None) -> float:
    """Forward GFLOP per image (per image+text pair with ``pair``: the text tower by the same count)."""
    from vitmm.models import text, vit, vit_tools

    flops = vit_tools.forward_flops(vit.decode_variant(variant), (res, res))
    if pair:
        flops += text.forward_flops(pair["text_width"], pair["text_depth"], 4 * pair["text_width"], pair["text_len"])
    return flops / 1e9


def to_markdown(rows: list[dict], setup: dict) -> str:
    rounds = (f", {setup['rounds']} rounds taking turns (times: medians over rounds; ratios: median of the rounds' "
              "paired ratios, range in brackets)") if setup.get("rounds", 1) > 1 else ""
    tunables = (f" Every worker ran with GLIBC_TUNABLES={setup['glibc_tunables']}."
                if setup.get("glibc_tunables") else "")
    lines = [f"{setup['date']}, {setup['machine']}, float32, batch {setup['batch']}, {setup['res']}×{setup['res']}, "
             f"{setup['threads']} threads, medians of {setup['repeats']} steps after {setup['warmup']} warm-up"
             f"{rounds}.{tunables} "
             "Utilisation = analytic FLOP/s over the same worker's 2048² float32 matmul rate; faults = the "
             "worker's minor page faults per timed step.",
             "",
             "| model | mode | framework | images/s | vitmm ÷ this | GFLOP/s | util. | XLA/analytic FLOPs "
             "| compile s | peak RSS MB | faults/step |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}×" if r.get("ratio") else ""
        if r.get("ratio") and r["rounds"] > 1:
            ratio += f" ({r['ratio_min']:.2f}–{r['ratio_max']:.2f})"
        compile_s = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else ""
        xla = f"{r['xla_vs_analytic']:.3f}" if r.get("xla_vs_analytic") else ""
        faults = f"{r['minor_faults_per_step']:,.0f}" if r.get("minor_faults_per_step") is not None else ""
        lines.append(f"| {_label(r)} | {r['mode']} | {r['framework']} | {r['images_s']:.1f} | {ratio} | "
                     f"{r['gflops']:.1f} | {r['util']:.0%} | {xla} | {compile_s} | {r['peak_rss_mb']:.0f} | {faults} |")
    return "\n".join(lines) + "\n"


def _one_round(workers: list[tuple], r: int, threads: int, tunables: str) -> list[dict]:
    """Round ``r``: every worker once, in ``workers``' order in even rounds and in reverse in odd
    ones, so that a machine drifting slower or faster over the run does not always favour the side
    that goes first; the results in ``workers``' order."""
    order = range(len(workers)) if r % 2 == 0 else reversed(range(len(workers)))
    out = {i: _run_worker(workers[i][0], workers[i][1], workers[i][2], threads, tunables) for i in order}
    return [out[i] for i in range(len(workers))]


def _over_rounds(results: list[dict]) -> dict:
    """One worker's rounds as one row: medians of the times and rates, the largest peak memory."""
    out = dict(results[0])
    for key in ("step_s", "compile_s", "matmul_gflops", "minor_faults_per_step"):
        if key in out:
            out[key] = statistics.median(r[key] for r in results)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    out["rounds"] = len(results)
    return out


def _label(r: dict) -> str:
    return f"CLIP {r['variant']} + text (pairs)" if r["task"] == "pair" else f"ViT-{r['variant']}"


SCALING = ((32, 224), (16, 224), (8, 224), (16, 448))  # (patch, resolution): 49, 196, 784, 784 tokens


def scaling(width: str, args) -> list[dict]:
    """Measured step time vs the analytic prediction as tokens grow (vitmm only)."""
    rows = []
    for patch, res in SCALING:
        variant = f"{width}/{patch}"
        for mode in ("infer", "train"):
            spec = dict(task="vit", variant=variant, batch=args.batch, res=res, warmup=args.warmup,
                        repeats=args.repeats, mode=mode, arch={}, pair={})
            r = _run_worker(sys.executable, "jax", spec, args.threads, args.glibc_tunables)
            rows.append(dict(variant=variant, res=res, tokens=(res // patch) ** 2, mode=mode,
                             analytic_gflop_per_image=analytic_gflop(variant, res), step_s=r["step_s"]))
            print(f"{variant} @ {res}: {mode} {r['step_s']:.3f} s/step", flush=True)
    for r in rows:
        base = next(b for b in rows if b["variant"] == f"{width}/16" and b["res"] == 224 and b["mode"] == r["mode"])
        r["predicted_ratio"] = r["analytic_gflop_per_image"] / base["analytic_gflop_per_image"]
        r["measured_ratio"] = r["step_s"] / base["step_s"]
    return rows


def scaling_markdown(rows: list[dict], setup: dict) -> str:
    lines = [f"{setup['date']}, {setup['machine']}, float32, batch {setup['batch']}, {setup['threads']} threads, "
             f"medians of {setup['repeats']} steps; ratios relative to /16 at 224 px of the same mode.", "",
             "| model | px | tokens | analytic GFLOP/img | mode | s/step | predicted ratio | measured ratio |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['res']} | {r['tokens']} | {r['analytic_gflop_per_image']:.2f} | "
                     f"{r['mode']} | {r['step_s']:.3f} | {r['predicted_ratio']:.2f} | {r['measured_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def _write(out: pathlib.Path, name: str, rows: list[dict], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="Ti/16,S/16")
    parser.add_argument("--pair", default="B/32", help="image towers of CLIP image+text pairs ('' for none)")
    parser.add_argument("--pair_text_width", type=int, default=512)
    parser.add_argument("--pair_text_depth", type=int, default=12)
    parser.add_argument("--pair_text_len", type=int, default=77)
    parser.add_argument("--pair_vocab", type=int, default=49408)
    parser.add_argument("--pair_embed_dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--res", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every worker this many times, taking turns; ratios are medians of the rounds' "
                             "paired ratios, shown with their range")
    parser.add_argument("--torch_python", default=sys.executable, help="a Python with torch and transformers")
    parser.add_argument("--no_torch", action="store_true")
    parser.add_argument("--timm_python", default=None,
                        help="a Python with torch and timm: timm's VisionTransformer as a second ViT reference")
    parser.add_argument("--scaling", default=None, metavar="WIDTH",
                        help="time one width (e.g. S) across patch sizes and resolutions instead")
    parser.add_argument("--glibc_tunables", default=HUGE_PAGES,
                        help="GLIBC_TUNABLES added for every worker, both frameworks ('' for none; default: "
                             "transparent huge pages for malloc's large blocks)")
    parser.add_argument("--out", default="results/benchmark")
    args = parser.parse_args(argv)

    from vitmm.models import vit

    out = pathlib.Path(args.out)
    setup = dict(date=time.strftime("%Y-%m-%d"), machine=f"{os.cpu_count()}-core {os.uname().machine} CPU",
                 batch=args.batch, res=args.res, threads=args.threads, repeats=args.repeats, warmup=args.warmup,
                 rounds=args.rounds, glibc_tunables=_with_tunables(args.glibc_tunables))
    if args.scaling:
        rows = scaling(args.scaling, args)
        _write(out, "scaling", rows, scaling_markdown(rows, setup))
        return out
    pair = dict(vocab=args.pair_vocab, text_width=args.pair_text_width, text_depth=args.pair_text_depth,
                text_heads=args.pair_text_width // 64, text_len=args.pair_text_len, embed_dim=args.pair_embed_dim)
    cases = [("vit", v) for v in args.variants.split(",") if v] + [("pair", v) for v in args.pair.split(",") if v]
    rows = []
    for task, variant in cases:
        flops = analytic_gflop(variant, args.res, pair if task == "pair" else None)
        a = vit.decode_variant(variant)
        arch = dict(width=a.width, depth=a.depth, num_heads=a.num_heads, mlp_dim=a.mlp_dim, patch=a.patch_size[0])
        for mode in ("train", "infer"):
            spec = dict(task=task, variant=variant, batch=args.batch, res=args.res, warmup=args.warmup,
                        repeats=args.repeats, mode=mode, arch=arch, pair=pair)
            workers = [(sys.executable, "jax", spec)]
            if not args.no_torch:
                workers.append((args.torch_python, "torch", {**spec, "ref": "transformers"}))
            if args.timm_python and task == "vit":
                workers.append((args.timm_python, "torch", {**spec, "ref": "timm"}))
            rounds = [_one_round(workers, r, args.threads, args.glibc_tunables) for r in range(args.rounds)]
            results = [_over_rounds([rnd[i] for rnd in rounds]) for i in range(len(workers))]
            for r in results:
                r["images_s"] = args.batch / r["step_s"]
                r["gflops"] = flops * (3 if mode == "train" else 1) * r["images_s"]
                r["util"] = r["gflops"] / r["matmul_gflops"]
                r["analytic_gflop_per_image"] = flops
                if r.get("xla_gflop_per_image"):
                    r["xla_vs_analytic"] = r["xla_gflop_per_image"] / (flops * (3 if mode == "train" else 1))
            for i, r in enumerate(results[1:], 1):
                paired = [rnd[i]["step_s"] / rnd[0]["step_s"] for rnd in rounds]  # vitmm speed over this one's
                r["ratio"] = statistics.median(paired)
                r["ratio_min"], r["ratio_max"] = min(paired), max(paired)
            rows.extend(results)
            summary = (f"{r['framework']} {_label(r)} {mode}: {r['images_s']:.1f} img/s" for r in results)
            print(" | ".join(summary), flush=True)
    _write(out, "benchmark", rows, to_markdown(rows, setup))
    return out


if __name__ == "__main__":
    main()
