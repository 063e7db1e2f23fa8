"""GPU training throughput and MFU of vitmm towers (run on one GPU: ``experiments/bench_gpu.sh``).

For each case: a jit-compiled AdamW step (bf16 matmuls, float32 parameters, donated state) on
synthetic data, timed as the median of ``--repeats`` runs of ``--steps`` steps after warm-up;
MFU = analytic training FLOPs (3 × forward, ``vitmm.models.vit.forward_flops``) / time / peak.
Cases: ViT-B/16 and ViT-L/16 classification at 224 (XLA attention with CLS, 197 tokens; and
cuDNN flash attention with GAP pooling, 196 tokens), and SigLIP-B/16 image+text pairs.
Also checks on the GPU that cuDNN attention and bf16 agree with XLA/float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import optax

from vitmm import losses
from vitmm.models import two_towers, vit

PEAK = {"bf16": 989e12}  # H100/H200 dense bf16 peak used for MFU


def text_forward_flops(width: int, depth: int, mlp: int, length: int) -> int:
    return depth * (8 * length * width * width + 4 * length * width * mlp + 4 * length * length * width)


def time_step(step, state, batch, steps: int, repeats: int) -> list[float]:
    for _ in range(2):
        state, loss = step(state, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state, loss = step(state, batch)
        jax.block_until_ready(loss)
        times.append((time.perf_counter() - start) / steps)
    return times


def vit_case(variant: str, batch: int, attn_impl, gap: bool, args) -> dict:
    model = vit.ViT(variant=variant, dtype_mm="bfloat16", num_classes=1000, attn_impl=attn_impl,
                    pool="gap" if gap else "tok", class_token=not gap, scan=args.scan,
                    remat_policy=args.remat)
    images = jax.random.normal(jax.random.key(0), (batch, 224, 224, 3), jnp.bfloat16)
    labels = jax.random.randint(jax.random.key(1), (batch,), 0, 1000)
    params = jax.jit(model.init)(jax.random.key(2), images[:1])["params"]
    tx = optax.adamw(1e-4)

    @jax.jit
    def init_state(params):
        return params, tx.init(params)

    def step(state, batch):
        params, opt = state
        images, labels = batch

        def loss_fn(p):
            logits, _ = model.apply({"params": p}, images, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    step = jax.jit(step, donate_argnums=0)
    times = time_step(step, init_state(params), (images, labels), args.steps, args.repeats)
    arch = vit.decode_variant(variant)
    flops = 3 * vit.forward_flops(arch, (224, 224), num_prefix_tokens=0 if gap else 1) * batch
    return dict(times=times, flops=flops, batch=batch)


def siglip_case(batch: int, attn_impl, args) -> dict:
    fast = dict(dtype_mm="bfloat16", scan=args.scan, remat_policy=args.remat)
    model = two_towers.TwoTowers(
        image=dict(variant="B/16", pool="map", class_token=False, attn_impl=attn_impl, **fast),
        text=dict(vocab_size=32_000, width=768, depth=12, num_heads=12, max_len=64, causal=False,
                  pool="last", **fast),
        embed_dim=768, temperature_init=10.0, bias_init=-10.0)
    images = jax.random.normal(jax.random.key(0), (batch, 224, 224, 3), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (batch, 64), 0, 32_000)
    params = jax.jit(model.init)(jax.random.key(2), images[:1], ids[:1])["params"]
    tx = optax.adamw(1e-4)

    def step(state, batch):
        params, opt = state
        images, ids = batch

        def loss_fn(p):
            zi, zt, out = model.apply({"params": p}, images, ids, train=True)
            return losses.sigmoid_loss(zi.astype(jnp.float32), zt.astype(jnp.float32), out["t"], out["b"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    step = jax.jit(step, donate_argnums=0)
    times = time_step(step, (params, jax.jit(tx.init)(params)), (images, ids), args.steps, args.repeats)
    arch = vit.decode_variant("B/16")
    per_pair = vit.forward_flops(arch, (224, 224), num_prefix_tokens=0) + text_forward_flops(768, 12, 3072, 64)
    return dict(times=times, flops=3 * per_pair * batch, batch=batch)


def agreement() -> dict:
    """cuDNN attention vs XLA, and bf16 vs float32, on the GPU."""
    images = jax.random.normal(jax.random.key(0), (8, 224, 224, 3))
    out = {}
    base = vit.ViT(variant="S/16", pool="gap", class_token=False)
    variables = base.init(jax.random.key(1), images[:1])
    ref = base.apply(variables, images)[1]["encoded"]
    for name, model in [("cudnn_bf16", vit.ViT(variant="S/16", pool="gap", class_token=False,
                                               attn_impl="cudnn", dtype_mm="bfloat16")),
                        ("xla_bf16", vit.ViT(variant="S/16", pool="gap", class_token=False, dtype_mm="bfloat16"))]:
        try:
            got = model.apply(variables, images)[1]["encoded"]
            out[name] = dict(max_abs=float(jnp.max(jnp.abs(got - ref))),
                             rel=float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)))
        except Exception as err:  # noqa: BLE001 - reported, not fatal
            out[name] = dict(error=f"{type(err).__name__}: {err}"[:300])
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scan", action="store_true")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--batch_scale", type=float, default=1.0, help="multiplies every batch size")
    parser.add_argument("--only_cudnn", action="store_true", help="skip the XLA-attention cases")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)
    results = {"agreement": agreement()}
    print(json.dumps(results["agreement"]), flush=True)
    b = lambda n: int(n * args.batch_scale)  # noqa: E731
    cases = [
        ("ViT-B/16 xla tok(197)", lambda: vit_case("B/16", b(256), None, False, args)),
        ("ViT-B/16 cudnn gap(196)", lambda: vit_case("B/16", b(256), "cudnn", True, args)),
        ("ViT-L/16 xla tok(197)", lambda: vit_case("L/16", b(128), None, False, args)),
        ("ViT-L/16 cudnn gap(196)", lambda: vit_case("L/16", b(128), "cudnn", True, args)),
        ("SigLIP-B/16 pair cudnn", lambda: siglip_case(b(256), "cudnn", args)),
    ]
    if args.only_cudnn:
        cases = [c for c in cases if "xla" not in c[0]]
    for name, run in cases:
        try:
            r = run()
            t = statistics.median(r["times"])
            r.update(step_s=t, examples_per_s=r["batch"] / t, tflops=r["flops"] / t / 1e12,
                     mfu=r["flops"] / t / PEAK["bf16"])
            print(f"{name:<26} batch {r['batch']:>4}  step {t * 1e3:8.1f} ms  {r['examples_per_s']:8.0f} ex/s  "
                  f"{r['tflops']:6.1f} TFLOP/s  MFU {r['mfu']:.1%}", flush=True)
        except Exception as err:  # noqa: BLE001 - one failing case must not hide the others
            traceback.print_exc()
            r = dict(error=f"{type(err).__name__}: {err}"[:500])
            print(f"{name:<26} FAILED: {r['error']}", flush=True)
        results[name] = r
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
