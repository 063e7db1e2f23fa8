"""vitmm against a PyTorch reference, side by side in one run: ViT training and inference speed.

    python experiments/benchmark.py                       # ViT-Ti/16 and S/16, 224 px, batch 32, fp32
    python experiments/benchmark.py --variants Ti/16,S/16,B/16 --repeats 7
    python experiments/benchmark.py --torch_python /path/to/venv/bin/python   # PyTorch lives elsewhere
    python experiments/benchmark.py --scaling S --batch 8 # step time vs tokens, next to the analytic count

For each variant, a JAX worker process and a PyTorch worker process take turns (so drift on a
shared machine hits both alike) and each reports: training-step and inference images/s (median
over ``--repeats`` timed steps after warm-up), compile time (JAX), peak resident memory of the
process, achieved FLOP/s from the analytic count (forward per image = 2·N_p·3P²·D +
L·(24·N·D² + 4·N²·D), training = 3× forward; cross-checked against XLA's cost analysis) and the
share of a float32 matmul rate measured in the same worker. The reference is transformers'
``ViTForImageClassification`` with SDPA attention (the same shapes: CLS, 1000-class head, AdamW,
cross-entropy). PyTorch is not a vitmm dependency: pass ``--torch_python`` for an interpreter
that has ``torch`` and ``transformers`` (``torch==2.13.0`` installs from a local file here), or
``--no_torch``. Both frameworks get the same number of threads (``--threads``, default: all cores).

Writes ``benchmark.csv`` and ``benchmark.md`` (with ratios vitmm / reference) to ``--out``.

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
import resource
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _median_time(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------ JAX side
def jax_worker(variant: str, batch: int, res: int, warmup: int, repeats: int, mode: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from vitmm.models import common, vit

    jax.config.update("jax_enable_compilation_cache", False)  # compile_s is a real compile, cache or not
    model = vit.ViT(variant=variant, num_classes=1000, pool="tok")
    images = jax.random.normal(jax.random.key(0), (batch, res, res, 3), jnp.float32)
    labels = jax.random.randint(jax.random.key(1), (batch,), 0, 1000)
    params = jax.jit(model.init)(jax.random.key(2), images[:1])["params"]
    out = {"framework": "vitmm", "variant": variant, "mode": mode}
    if mode == "train":
        tx = optax.adamw(1e-4)
        opt_state = tx.init(params)

        def loss_fn(p):
            logits, _ = model.apply({"params": p}, images, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        def step(p, o):
            loss, grads = jax.value_and_grad(loss_fn)(p)
            updates, o = tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o, loss

        start = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state).compile()
        out["compile_s"] = time.perf_counter() - start
        state = [params, opt_state]

        def run():
            state[0], state[1], loss = compiled(state[0], state[1])
            loss.block_until_ready()
    else:
        forward = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
        start = time.perf_counter()
        compiled = forward.lower(params, images).compile()
        out["compile_s"] = time.perf_counter() - start
        out["xla_gflop_per_image"] = common.xla_flops(compiled) / batch / 1e9

        def run():
            compiled(params, images).block_until_ready()

    out["step_s"] = _median_time(run, warmup, repeats)
    a = jax.random.normal(jax.random.key(3), (2048, 2048), jnp.float32)
    dot = jax.jit(jnp.dot).lower(a, a).compile()
    out["matmul_gflops"] = 2 * 2048**3 / _median_time(lambda: dot(a, a).block_until_ready(), 2, 5) / 1e9
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


# ------------------------------------------------------------------------------------ PyTorch side
def torch_worker(variant: str, batch: int, res: int, warmup: int, repeats: int, mode: str, threads: int,
                 arch: dict) -> dict:
    """``arch``: width, depth, num_heads, mlp_dim, patch (from vitmm's variant table)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    config = transformers.ViTConfig(hidden_size=arch["width"], num_hidden_layers=arch["depth"],
                                    num_attention_heads=arch["num_heads"], intermediate_size=arch["mlp_dim"],
                                    image_size=res, patch_size=arch["patch"], num_labels=1000, hidden_act="gelu",
                                    layer_norm_eps=1e-6)
    config._attn_implementation = "sdpa"
    model = transformers.ViTForImageClassification(config)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, res, res, generator=g)
    labels = torch.randint(0, 1000, (batch,), generator=g)
    out = {"framework": f"torch {torch.__version__} + transformers {transformers.__version__} (sdpa)",
           "variant": variant, "mode": mode}
    if mode == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def run():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(pixel_values=images).logits, labels)
            loss.backward()
            opt.step()
    else:
        model.eval()

        def run():
            with torch.inference_mode():
                model(pixel_values=images)

    out["step_s"] = _median_time(run, warmup, repeats)
    a = torch.randn(2048, 2048, generator=g)
    out["matmul_gflops"] = 2 * 2048**3 / _median_time(lambda: torch.mm(a, a), 2, 5) / 1e9
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


# ------------------------------------------------------------------------------------ driver
def _run_worker(python: str, kind: str, spec: dict, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([python, __file__, "--_worker", kind, "--_spec", json.dumps({**spec, "threads": threads})],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def analytic_gflop(variant: str, res: int) -> float:
    from vitmm.models import vit

    arch = vit.decode_variant(variant)
    return vit.forward_flops(arch, (res, res)) / 1e9


def to_markdown(rows: list[dict], setup: dict) -> str:
    lines = [f"{setup['date']}, {setup['machine']}, float32, batch {setup['batch']}, {setup['res']}×{setup['res']}, "
             f"{setup['threads']} threads, medians of {setup['repeats']} steps after {setup['warmup']} warm-up. "
             "Utilisation = analytic FLOP/s over the same worker's 2048² float32 matmul rate.",
             "",
             "| variant | mode | framework | images/s | ratio vitmm/ref | GFLOP/s | util. | compile s | peak RSS MB |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}×" if r.get("ratio") else ""
        compile_s = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else ""
        lines.append(f"| {r['variant']} | {r['mode']} | {r['framework']} | {r['images_s']:.1f} | {ratio} | "
                     f"{r['gflops']:.1f} | {r['util']:.0%} | {compile_s} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


SCALING = ((32, 224), (16, 224), (8, 224), (16, 448))  # (patch, resolution): 49, 196, 784, 784 tokens


def scaling(width: str, args) -> list[dict]:
    """Measured step time vs the analytic prediction as tokens grow (vitmm only)."""
    rows = []
    for patch, res in SCALING:
        variant = f"{width}/{patch}"
        for mode in ("infer", "train"):
            spec = dict(variant=variant, batch=args.batch, res=res, warmup=args.warmup, repeats=args.repeats,
                        mode=mode, arch={})
            r = _run_worker(sys.executable, "jax", spec, args.threads)
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
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--res", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--torch_python", default=sys.executable, help="a Python with torch and transformers")
    parser.add_argument("--no_torch", action="store_true")
    parser.add_argument("--scaling", default=None, metavar="WIDTH",
                        help="time one width (e.g. S) across patch sizes and resolutions instead")
    parser.add_argument("--out", default="results/benchmark")
    parser.add_argument("--_worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker:
        spec = json.loads(args._spec)
        threads = spec.pop("threads")
        arch = spec.pop("arch")
        result = jax_worker(**spec) if args._worker == "jax" else torch_worker(**spec, threads=threads, arch=arch)
        print(json.dumps(result))
        return None

    from vitmm.models import vit

    out = pathlib.Path(args.out)
    setup = dict(date=time.strftime("%Y-%m-%d"), machine=f"{os.cpu_count()}-core {os.uname().machine} CPU",
                 batch=args.batch, res=args.res, threads=args.threads, repeats=args.repeats, warmup=args.warmup)
    if args.scaling:
        rows = scaling(args.scaling, args)
        _write(out, "scaling", rows, scaling_markdown(rows, setup))
        return out
    rows = []
    for variant in args.variants.split(","):
        flops = analytic_gflop(variant, args.res)
        a = vit.decode_variant(variant)
        arch = dict(width=a.width, depth=a.depth, num_heads=a.num_heads, mlp_dim=a.mlp_dim, patch=a.patch_size[0])
        for mode in ("train", "infer"):
            spec = dict(variant=variant, batch=args.batch, res=args.res, warmup=args.warmup, repeats=args.repeats,
                        mode=mode, arch=arch)
            results = [_run_worker(sys.executable, "jax", spec, args.threads)]
            if not args.no_torch:
                results.append(_run_worker(args.torch_python, "torch", spec, args.threads))
            for r in results:
                r["images_s"] = args.batch / r["step_s"]
                r["gflops"] = flops * (3 if mode == "train" else 1) * r["images_s"]
                r["util"] = r["gflops"] / r["matmul_gflops"]
                r["analytic_gflop_per_image"] = flops
            if len(results) == 2:
                results[0]["ratio"] = results[0]["images_s"] / results[1]["images_s"]
            rows.extend(results)
            summary = (f"{r['framework'].split()[0]} {variant} {mode}: {r['images_s']:.1f} img/s" for r in results)
            print(" | ".join(summary), flush=True)
    _write(out, "benchmark", rows, to_markdown(rows, setup))
    return out


if __name__ == "__main__":
    main()
