"""GPU training throughput and MFU of vitmm towers (run on one GPU: ``experiments/gpu/bench.sh``).

For each case: a jit-compiled AdamW step (bf16 matmuls, float32 parameters, donated state) on
synthetic data, timed as the median of ``--repeats`` runs of ``--steps`` steps after warm-up;
MFU = analytic training FLOPs (3 × forward, ``vitmm.models.vit_tools.forward_flops``) / time / peak.
Cases: ViT-B/16 and ViT-L/16 classification at 224 (XLA attention with CLS, 197 tokens; and
cuDNN flash attention with GAP pooling, 196 tokens), and SigLIP-B/16 image+text pairs.
Also checks on the GPU that cuDNN attention and bf16 agree with XLA/float32.

``--profile`` then traces each case's step and prints where its device time goes, by kind
(matmul, attention, fusion, copy, ...), by pass and by module (``vitmm.train.profiling``); the
tables go to ``profile.md`` beside ``--out``.

``--sweep`` instead times one case (``--cases``, default the ViT-B/16 cuDNN one) under several
settings, each in its own process (XLA flags are read once per process), with the baseline run
first and last to show the drift, and prints step time, MFU and the ratio to the baseline; its
deterministic rows measure what the config's ``deterministic=True`` costs.

``--tiny`` shrinks every case (one-layer Ti/16 towers at 32 px, batch 2, XLA attention) so the
whole script runs on a CPU in seconds; the tests use it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import optax

from vitmm import losses
from vitmm.models import text as text_lib
from vitmm.models import two_towers, vit, vit_tools
from vitmm.train import profiling
from vitmm.train import step as step_lib

PEAK = {"bf16": 989e12}  # H100/H200 dense bf16 peak used for MFU
TINY = dict(res=32, batch=2, depth=1)  # --tiny: every case at this size, on any backend

CASES = [  # name, tower, variant, batch, attention, GAP pooling (196 tokens) instead of CLS (197)
    ("ViT-B/16 xla tok(197)", "vit", "B/16", 256, None, False),
    ("ViT-B/16 cudnn gap(196)", "vit", "B/16", 256, "cudnn", True),
    ("ViT-L/16 xla tok(197)", "vit", "L/16", 128, None, False),
    ("ViT-L/16 cudnn gap(196)", "vit", "L/16", 128, "cudnn", True),
    ("SigLIP-B/16 pair cudnn", "siglip", "B/16", 256, "cudnn", True),
]

# --sweep: (name, XLA flags added, bench_gpu.py args added); the first and last are the baseline
SWEEP = [
    ("baseline", "", []),
    ("no Triton GEMM fusions", "--xla_gpu_enable_triton_gemm=false", []),
    ("cuBLASLt GEMMs", "--xla_gpu_enable_cublaslt=true", []),
    ("no command buffers", "--xla_gpu_enable_command_buffer=", []),
    ("cuBLASLt + tanh GELU (bias+GELU epilogue)", "--xla_gpu_enable_cublaslt=true", ["--act", "gelu_tanh"]),
    ("bf16 residual stream", "", ["--dtype_residual", "bfloat16"]),
    ("bf16 residual + cuBLASLt + tanh GELU", "--xla_gpu_enable_cublaslt=true",
     ["--dtype_residual", "bfloat16", "--act", "gelu_tanh"]),
    # deterministic=True (vitmm/train/determinism.py): the flag, and XLA's attention in place of cuDNN's
    ("deterministic ops + cuDNN attention", "--xla_gpu_deterministic_ops=true", []),  # failed when called, 2026-12-04
    ("XLA attention", "", ["--attn", "xla"]),
    ("deterministic=True (deterministic ops + XLA attention)", "--xla_gpu_deterministic_ops=true", ["--attn", "xla"]),
    ("baseline again", "", []),
]


def profile_step(step, state, batch, steps: int) -> profiling.OpProfile:
    """Device time of the compiled, already warm step (a ``jax.stages.Compiled``) by op kind and
    module (``vitmm.train.profiling``)."""
    holder = [state]

    def run():
        holder[0], loss = step(holder[0], batch)
        jax.block_until_ready(loss)

    return profiling.profile_ops(run, step.as_text(), steps)


def train_step(loss_fn, tx):
    update = step_lib.update_step(loss_fn, tx)

    def step(state, batch):
        params, opt, loss = update(*state, batch)
        return (params, opt), loss

    return jax.jit(step, donate_argnums=0)


def build_case(tower: str, variant: str, batch: int, attn_impl, gap: bool, args):
    """``(jitted step, train state, data, training FLOPs per step, batch size)`` for one case."""
    res, depth = (TINY["res"], TINY["depth"]) if args.tiny else (224, None)
    if args.tiny:
        batch, attn_impl, variant = TINY["batch"], None, "Ti/16"
    fast = dict(dtype_mm="bfloat16", dtype_residual=args.dtype_residual, scan=args.scan, remat_policy=args.remat)
    image_kw = dict(variant=variant, depth=depth, attn_impl=attn_impl, act=args.act, embed_impl=args.embed_impl,
                    pool="gap" if gap else "tok", class_token=not gap, **fast)
    images = jax.random.normal(jax.random.key(0), (batch, res, res, 3), jnp.bfloat16)
    tx = optax.adamw(1e-4)
    if tower == "vit":
        model = vit.ViT(num_classes=1000, **image_kw)
        labels = jax.random.randint(jax.random.key(1), (batch,), 0, 1000)
        data = (images, labels)
        params = jax.jit(model.init)(jax.random.key(2), images[:1])["params"]

        def loss_fn(p, data):
            logits, _ = model.apply({"params": p}, data[0], train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), data[1]).mean()

        flops = 3 * vit_tools.forward_flops(model.arch(), (res, res), num_prefix_tokens=0 if gap else 1) * batch
    else:
        text = dict(vocab_size=32_000, width=768, depth=12, num_heads=12, max_len=64)
        if args.tiny:
            text = dict(vocab_size=100, width=64, depth=1, num_heads=2, max_len=8)
        image_kw["pool"] = "map"
        model = two_towers.TwoTowers(image=image_kw, text=dict(causal=False, pool="last", **text, **fast),
                                     embed_dim=text["width"], temperature_init=10.0, bias_init=-10.0)
        ids = jax.random.randint(jax.random.key(1), (batch, text["max_len"]), 0, text["vocab_size"])
        data = (images, ids)
        params = jax.jit(model.init)(jax.random.key(2), images[:1], ids[:1])["params"]

        def loss_fn(p, data):
            zi, zt, out = model.apply({"params": p}, data[0], data[1], train=True)
            return losses.sigmoid_loss(zi.astype(jnp.float32), zt.astype(jnp.float32), out["t"], out["b"])

        image_arch = vit.ViT(**image_kw).arch()
        per_pair = vit_tools.forward_flops(image_arch, (res, res), num_prefix_tokens=0) + text_lib.forward_flops(
            text["width"], text["depth"], 4 * text["width"], text["max_len"])
        flops = 3 * per_pair * batch
    state = jax.jit(lambda p: (p, tx.init(p)))(params)
    return train_step(loss_fn, tx), state, data, flops, batch


def run_case(name: str, spec: tuple, args, profile_md: list[str]) -> dict:
    step, state, data, flops, batch = build_case(*spec, args)
    step = step.lower(state, data).compile()  # compiled once, timed and traced alike
    times, state = profiling.time_step(step, state, data, args.steps, args.repeats)
    t = statistics.median(times)
    r = dict(times=times, flops=flops, batch=batch, step_s=t, examples_per_s=batch / t,
             tflops=flops / t / 1e12, mfu=flops / t / PEAK["bf16"])
    print(f"{name:<26} batch {batch:>4}  step {t * 1e3:8.1f} ms  {r['examples_per_s']:8.0f} ex/s  "
          f"{r['tflops']:6.1f} TFLOP/s  MFU {r['mfu']:.1%}", flush=True)
    if args.profile:
        try:
            prof = profile_step(step, state, data, args.steps)
        except Exception as err:  # noqa: BLE001 - a failed trace must not lose the timing
            traceback.print_exc()
            r["profile"] = dict(error=f"{type(err).__name__}: {err}"[:500])
            return r
        tables = [f"## {name} (batch {batch}): device busy {prof.busy_ms:.1f} ms of a {prof.wall_ms:.1f} ms "
                  f"step (traced), {prof.unknown_ops} events with an unknown op",
                  prof.to_markdown("kind"), prof.to_markdown("phase", "kind"),
                  prof.to_markdown("phase", "module", top=args.profile_top)]
        print("\n\n".join(tables), flush=True)
        profile_md.append("\n\n".join(tables))
        r["profile"] = dict(busy_ms=prof.busy_ms, wall_ms=prof.wall_ms, unknown_ops=prof.unknown_ops,
                            by_kind={k[0]: ms for k, ms, _ in prof.by("kind")})
    return r


def agreement(tiny: bool = False) -> dict:
    """cuDNN attention vs XLA, bf16 matmuls and a bf16 residual stream vs float32, on the GPU
    (relative error of the encoded tokens)."""
    res, depth = (TINY["res"], TINY["depth"]) if tiny else (224, None)
    images = jax.random.normal(jax.random.key(0), (8, res, res, 3))
    out = {}
    kw = dict(variant="S/16", depth=depth, pool="gap", class_token=False)
    base = vit.ViT(**kw)
    variables = base.init(jax.random.key(1), images[:1])
    ref = base.apply(variables, images)[1]["encoded"]
    for name, model in [("cudnn_bf16", vit.ViT(**kw, attn_impl="cudnn", dtype_mm="bfloat16")),
                        ("xla_bf16", vit.ViT(**kw, dtype_mm="bfloat16")),
                        ("xla_bf16_residual_bf16", vit.ViT(**kw, dtype_mm="bfloat16", dtype_residual="bfloat16"))]:
        try:
            got = model.apply(variables, images)[1]["encoded"]
            out[name] = dict(max_abs=float(jnp.max(jnp.abs(got - ref))),
                             rel=float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)))
        except Exception as err:  # noqa: BLE001 - reported, not fatal
            out[name] = dict(error=f"{type(err).__name__}: {err}"[:300])
    return out


def sweep(args, passthrough: list[str]) -> list[dict]:
    """One case under each ``SWEEP`` setting, each in a fresh process; rows for the table."""
    settings = SWEEP if not args.sweep_settings else [s for s in SWEEP if s[0] in args.sweep_settings.split(",")]
    parts = pathlib.Path(tempfile.mkdtemp(prefix="bench_gpu_sweep_"))
    rows = []
    for i, (name, flags, extra) in enumerate(settings):
        part = parts / f"setting_{i}.json"
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), flags) if f)
        cmd = [sys.executable, __file__, "--no_agreement", "--out", str(part), *passthrough, *extra]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        row = dict(setting=name, xla_flags=flags, args=" ".join(extra), wall_s=time.perf_counter() - start)
        results = json.loads(part.read_text()) if proc.returncode == 0 and part.exists() else {}
        case = next((v for k, v in results.items() if k != "agreement"), None)
        if case is None or "error" in case:
            row["error"] = (case or {}).get("error") or proc.stderr.strip().splitlines()[-1:] or ["no output"]
        else:
            row.update(step_ms=case["step_s"] * 1e3, mfu=case["mfu"], examples_per_s=case["examples_per_s"])
        rows.append(row)
        if args.out:  # row by row: a sweep cut off keeps the settings it finished
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"{name:<42} " + (f"step {row['step_ms']:8.2f} ms  MFU {row['mfu']:.1%}" if "step_ms" in row
                                 else f"FAILED: {row['error']}") + f"  ({row['wall_s']:.0f} s)", flush=True)
    shutil.rmtree(parts, ignore_errors=True)
    base = [r["step_ms"] for r in rows if r["setting"].startswith("baseline") and "step_ms" in r]
    for r in rows:
        if base and "step_ms" in r:
            r["speedup"] = statistics.median(base) / r["step_ms"]
    return rows


def sweep_markdown(rows: list[dict], case: str) -> str:
    lines = [f"Sweep of `{case}` (baseline first and last; speed-up against their median)", "",
             "| setting | XLA flags | args | step ms | MFU | speed-up |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        if "step_ms" in r:
            lines.append(f"| {r['setting']} | `{r['xla_flags']}` | `{r['args']}` | {r['step_ms']:.2f} | "
                         f"{r['mfu']:.1%} | {r.get('speedup', float('nan')):.3f}× |")
        else:
            lines.append(f"| {r['setting']} | `{r['xla_flags']}` | `{r['args']}` | failed: {r['error']} | | |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scan", action="store_true")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--act", default="gelu", help="activation of the image towers (e.g. gelu_tanh)")
    parser.add_argument("--embed_impl", default="conv", help="patch embedding: conv or unfold (a matmul)")
    parser.add_argument("--dtype_residual", default=None, help="residual stream dtype (e.g. bfloat16; default float32)")
    parser.add_argument("--batch_scale", type=float, default=1.0, help="multiplies every batch size")
    parser.add_argument("--only_cudnn", action="store_true", help="skip the XLA-attention cases")
    parser.add_argument("--attn", choices=("xla", "cudnn"), default=None,
                        help="every case's attention (default: its own)")
    parser.add_argument("--cases", default="", help="comma-separated substrings: run the cases that match one")
    parser.add_argument("--profile", action="store_true", help="trace each case and tabulate its device time")
    parser.add_argument("--profile_top", type=int, default=15, help="module rows in each profile table")
    parser.add_argument("--sweep", action="store_true", help="one case (--cases) under every SWEEP setting")
    parser.add_argument("--sweep_settings", default="", help="comma-separated SWEEP names to run (default all)")
    parser.add_argument("--no_agreement", action="store_true", help="skip the cuDNN/bf16 agreement check")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and XLA attention: a CPU smoke run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not (args.only_cudnn and c[4] is None)]
    if args.cases:
        cases = [c for c in cases if any(sub in c[0] for sub in args.cases.split(","))]
    if args.sweep:  # (this process opens no device: each setting's process does, under its own flags)
        case = args.cases or "ViT-B/16 cudnn"
        passthrough = ["--cases", case, "--steps", str(args.steps), "--repeats", str(args.repeats),
                       "--remat", args.remat, "--batch_scale", str(args.batch_scale)]
        passthrough += ["--scan"] * args.scan + ["--tiny"] * args.tiny
        rows = sweep(args, passthrough)
        markdown = sweep_markdown(rows, case)
        print(markdown, flush=True)
        if args.out:
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
            pathlib.Path(args.out).with_suffix(".md").write_text(markdown + "\n")
        return {"sweep": rows}
    print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)
    if not cases:
        raise SystemExit(f"--cases {args.cases!r} matches none of {[c[0] for c in CASES]}.")
    results = {}
    if not args.no_agreement:
        results["agreement"] = agreement(args.tiny)
        print(json.dumps(results["agreement"]), flush=True)
    profile_md: list[str] = []
    for name, *spec in cases:
        spec[2] = int(spec[2] * args.batch_scale)
        if args.attn:
            spec[3] = None if args.attn == "xla" else args.attn
        try:
            results[name] = run_case(name, tuple(spec), args, profile_md)
        except Exception as err:  # noqa: BLE001 - one failing case must not hide the others
            traceback.print_exc()
            results[name] = dict(error=f"{type(err).__name__}: {err}"[:500])
            print(f"{name:<26} FAILED: {results[name]['error']}", flush=True)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
        if profile_md:
            pathlib.Path(args.out).with_name("profile.md").write_text("\n\n".join(profile_md) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
