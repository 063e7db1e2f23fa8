"""The two sides of ``experiments/bench/cpu_vs_torch.py``, one worker process each: vitmm's (JAX) and a
PyTorch reference's (transformers or timm). The driver starts ``python -m experiments.bench.workers --kind
jax|torch --spec JSON`` in the interpreter that has the framework (PyTorch lives in a venv of its
own), and reads one JSON line of results: step time (median after warm-up), compile time, peak
memory, minor page faults per step and the same process's 2048² matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time


def _median_time(fn, warmup: int, repeats: int, faults: dict | None = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup``; with ``faults``, also the
    process's minor page faults per timed call (``faults["minor_faults_per_step"]``)."""
    for _ in range(warmup):
        fn()
    times = []
    minflt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if faults is not None:
        faults["minor_faults_per_step"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minflt) / repeats
    return statistics.median(times)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------ JAX side
def _jax_task(task: str, variant: str, batch: int, res: int, pair: dict):
    """(init of a key, inputs, loss of (params, inputs), forward of (params, inputs)) for ``task``."""
    import jax
    import jax.numpy as jnp
    import optax

    from vitmm import losses
    from vitmm.models import two_towers, vit

    images = jax.random.normal(jax.random.key(0), (batch, res, res, 3), jnp.float32)
    if task == "vit":
        model = vit.ViT(variant=variant, num_classes=1000, pool="tok")
        labels = jax.random.randint(jax.random.key(1), (batch,), 0, 1000)

        def loss(p, x):
            logits, _ = model.apply({"params": p}, x[0], train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, x[1]).mean()

        def logits(p, x):
            return model.apply({"params": p}, x[0])[0]

        return lambda key: model.init(key, images[:1]), (images, labels), loss, logits
    model = two_towers.TwoTowers(
        image=dict(variant=variant, pool="tok", pre_norm=True, embed_bias=False), embed_dim=pair["embed_dim"],
        text=dict(vocab_size=pair["vocab"], width=pair["text_width"], depth=pair["text_depth"],
                  num_heads=pair["text_heads"], max_len=pair["text_len"], causal=True, pool="eot"))
    ids = jnp.asarray(_pair_ids(batch, pair))

    def loss(p, x):
        zimg, ztxt, out = model.apply({"params": p}, *x, train=True)
        return losses.softmax_loss(zimg, ztxt, out["t"])

    def forward(p, x):
        zimg, ztxt, out = model.apply({"params": p}, *x)
        return out["t"] * zimg @ ztxt.T

    return lambda key: model.init(key, images[:1], ids[:1]), (images, ids), loss, forward


def jax_worker(task: str, variant: str, batch: int, res: int, warmup: int, repeats: int, mode: str,
               pair: dict) -> dict:
    from vitmm import xla_flags

    xla_flags.use_vitmm_defaults()  # a fresh worker process: JAX has opened no backend yet
    import jax
    import jax.numpy as jnp
    import optax

    from vitmm.models import common
    from vitmm.train import step as step_lib

    jax.config.update("jax_enable_compilation_cache", False)  # compile_s is a real compile, cache or not
    init, inputs, loss_fn, forward = _jax_task(task, variant, batch, res, pair)
    params = jax.jit(init)(jax.random.key(2))["params"]
    out = {"framework": "vitmm", "task": task, "variant": variant, "mode": mode}
    if mode == "train":
        tx = optax.adamw(1e-4)
        opt_state = tx.init(params)
        start = time.perf_counter()
        step = jax.jit(step_lib.update_step(loss_fn, tx), donate_argnums=(0, 1))
        compiled = step.lower(params, opt_state, inputs).compile()
        out["compile_s"] = time.perf_counter() - start
        state = [params, opt_state]

        def run():
            state[0], state[1], loss = compiled(state[0], state[1], inputs)
            loss.block_until_ready()
    else:
        start = time.perf_counter()
        compiled = jax.jit(forward).lower(params, inputs).compile()
        out["compile_s"] = time.perf_counter() - start

        def run():
            compiled(params, inputs).block_until_ready()

    out["xla_gflop_per_image"] = common.xla_flops(compiled) / batch / 1e9
    out["step_s"] = _median_time(run, warmup, repeats, out)
    out["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    a = jax.random.normal(jax.random.key(3), (2048, 2048), jnp.float32)
    dot = jax.jit(jnp.dot).lower(a, a).compile()
    out["matmul_gflops"] = 2 * 2048**3 / _median_time(lambda: dot(a, a).block_until_ready(), 2, 5) / 1e9
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def _pair_ids(batch: int, pair: dict):
    """Token ids both frameworks share: random text, end-of-text (the largest id) at a random spot."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1, pair["vocab"] - 1, (batch, pair["text_len"]))
    ids[np.arange(batch), rng.integers(pair["text_len"] // 2, pair["text_len"], batch)] = pair["vocab"] - 1
    return ids


# ------------------------------------------------------------------------------------ PyTorch side
def _torch_model(task: str, res: int, arch: dict, pair: dict, ref: str):
    if ref == "timm":
        import timm

        return timm.models.vision_transformer.VisionTransformer(
            img_size=res, patch_size=arch["patch"], embed_dim=arch["width"], depth=arch["depth"],
            num_heads=arch["num_heads"], mlp_ratio=arch["mlp_dim"] / arch["width"], num_classes=1000,
            global_pool="token")
    import transformers

    vision = dict(hidden_size=arch["width"], num_hidden_layers=arch["depth"], num_attention_heads=arch["num_heads"],
                  intermediate_size=arch["mlp_dim"], image_size=res, patch_size=arch["patch"], hidden_act="gelu",
                  layer_norm_eps=1e-6)
    if task == "vit":
        config = transformers.ViTConfig(**vision, num_labels=1000)
        config._attn_implementation = "sdpa"
        return transformers.ViTForImageClassification(config)
    text = dict(vocab_size=pair["vocab"], hidden_size=pair["text_width"], num_hidden_layers=pair["text_depth"],
                num_attention_heads=pair["text_heads"], intermediate_size=4 * pair["text_width"],
                max_position_embeddings=pair["text_len"], hidden_act="gelu", layer_norm_eps=1e-6,
                eos_token_id=2)  # 2: the legacy rule, pool at argmax(ids) (vitmm's eos_id=None)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=pair["embed_dim"])
    config._attn_implementation = "sdpa"
    return transformers.CLIPModel(config)


def torch_worker(task: str, variant: str, batch: int, res: int, warmup: int, repeats: int, mode: str,
                 threads: int, arch: dict, pair: dict, ref: str) -> dict:
    """``arch``: width, depth, num_heads, mlp_dim, patch (from vitmm's variant table); ``ref``:
    ``transformers`` or ``timm``."""
    import importlib

    import torch

    torch.set_num_threads(threads)
    model = _torch_model(task, res, arch, pair, ref)
    logits = (lambda o: o) if ref == "timm" else (lambda o: o.logits)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, res, res, generator=g)
    if task == "vit":
        labels = torch.randint(0, 1000, (batch,), generator=g)

        def loss_fn():
            return torch.nn.functional.cross_entropy(logits(model(images)), labels)

        def forward():
            return logits(model(images))
    else:
        ids = torch.as_tensor(_pair_ids(batch, pair))

        def loss_fn():
            return model(input_ids=ids, pixel_values=images, return_loss=True).loss

        def forward():
            return model(input_ids=ids, pixel_values=images).logits_per_image
    out = {"framework": f"torch {torch.__version__} + {ref} {importlib.import_module(ref).__version__} (sdpa)",
           "task": task, "variant": variant, "mode": mode}
    if mode == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def run():
            opt.zero_grad(set_to_none=True)
            loss_fn().backward()
            opt.step()
    else:
        model.eval()

        def run():
            with torch.inference_mode():
                forward()

    out["step_s"] = _median_time(run, warmup, repeats, out)
    out["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    a = torch.randn(2048, 2048, generator=g)
    out["matmul_gflops"] = 2 * 2048**3 / _median_time(lambda: torch.mm(a, a), 2, 5) / 1e9
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def pin(threads: int) -> None:
    """This process on the first ``threads`` cores, before a framework starts: XLA sizes its thread pool
    from the CPU affinity (``OMP_NUM_THREADS`` does not reach it), so both sides then get the same cores."""
    if threads < len(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", required=True, choices=("jax", "torch"))
    parser.add_argument("--spec", required=True, help="the worker's keyword arguments, as JSON")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    threads, arch = spec.pop("threads"), spec.pop("arch")
    pin(threads)
    result = jax_worker(**spec) if args.kind == "jax" else torch_worker(**spec, threads=threads, arch=arch)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
