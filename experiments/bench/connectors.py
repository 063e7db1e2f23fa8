"""Connectors and the LM's prefill at real sizes (issue 27, part 3), on one device.

    python -m experiments.bench.connectors --out $OUT/bench_connectors.json   # a GPU: ~5 minutes (a guess)
    python -m experiments.bench.connectors --tiny                             # a CPU smoke: seconds

The tower is a ViT-L/14 at 336 px: 576 patch features of width 1024, made once (its own forward
is timed too, for scale); the weights are random, since only cost is measured. For every
connector family and each ``--budgets`` visual-token count (the family's nearest reachable count
within a factor 2, else listed as unreachable): the connector's parameters and forward FLOPs per
image (``connectors.cost``), its forward time on a batch of tower features, and each ``--lms``
LM's prefill (the forward of ``tokens + --text_tokens`` embeddings to the next token's logits,
bf16 matmuls) in FLOPs (XLA:CPU's count of the program as lowered, not as compiled) and time. For
``--step_families`` the stage-1 training step is timed as well: the
connector's gradient through the frozen LM, the loss on the last ``--answer_tokens`` positions
(``logits_at``: the head there only). Times are medians of ``--repeats`` runs after compilation,
per batch of ``--batch`` images. Writes the rows to ``--out`` (JSON) and a Markdown table next to
it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[2]

from vitmm import tree  # noqa: E402
from vitmm.models import common, connectors  # noqa: E402
from vitmm.models import lm as lm_lib  # noqa: E402
from vitmm.models.vit import ViT  # noqa: E402

FAMILIES = ("linear", "mlp", "pool", "pixel_shuffle", "patch_merger", "c_abstractor", "ldp", "qwen_resampler",
            "perceiver", "qformer")
# Shapes of the real models (random weights): Hugging Face's SmolLM2-135M and Qwen2-0.5B configs.
LMS = {
    "smollm2_135m": dict(vocab_size=49_152, width=576, depth=30, num_heads=9, num_kv_heads=3, mlp_dim=1536,
                         tie_embeddings=True, rope_theta=100_000.0, norm_eps=1e-5),
    "qwen2_0.5b": dict(vocab_size=151_936, width=896, depth=24, num_heads=14, num_kv_heads=2, mlp_dim=4864,
                       qkv_bias=True, tie_embeddings=True, rope_theta=1_000_000.0, norm_eps=1e-6),
    "tiny": dict(vocab_size=1000, width=64, depth=2, num_heads=4),
}
TOWER = dict(width=1024, depth=24, mlp_dim=4096, num_heads=16, patch_size=14, class_token=False, pool="none")
TINY_TOWER = dict(width=64, depth=1, mlp_dim=128, num_heads=4, patch_size=8, class_token=False, pool="none")


def timed(fn, *args, repeats: int) -> float:
    """Median milliseconds of ``fn(*args)`` (compiled; a first call warms it)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def lm_config(name: str, dtype: str) -> dict:
    return dict(LMS[name], dtype_mm=dtype)


def prefill(lm_cfg: dict, batch: int, seq: int, repeats: int, key) -> dict:
    """The LM's forward over ``seq`` embeddings up to the next token's logits (the head at the
    last position only): FLOPs per sequence (XLA:CPU's count of the timed program as lowered:
    ``common.lowered_flops``; an H200's count of the compiled one missed most matmuls) and ms per
    batch."""
    model = lm_lib.LM(**lm_cfg)
    x = jax.random.normal(key, (batch, seq, model.width), jnp.float32)
    params = jax.jit(model.init)(key, embeds=x[:1])
    last = jnp.full((batch, 1), seq - 1)
    forward = lambda p, x: model.apply(p, embeds=x, logits_at=last)  # noqa: E731
    return {"lm_gflops": common.lowered_flops(forward, params, x) / batch / 1e9,
            "prefill_ms": timed(jax.jit(forward).lower(params, x).compile(), params, x, repeats=repeats)}


def stage1_step(cfg: dict, lm_cfg: dict, features, grid, text_tokens: int, answer_tokens: int, repeats: int,
                key) -> float:
    """ms per batch of the connector's update through the frozen LM (stage 1)."""
    connector, model = connectors.build(cfg, lm_cfg["width"]), lm_lib.LM(**lm_cfg)
    batch = features.shape[0]
    text = jax.random.normal(key, (batch, text_tokens, model.width), jnp.float32)
    targets = jax.random.randint(key, (batch, answer_tokens), 0, lm_cfg["vocab_size"])
    c_params = jax.jit(lambda k: connector.init(k, features[:1], grid))(key)
    m = connectors.num_visual_tokens(cfg, grid)
    lm_params = jax.jit(model.init)(key, embeds=jnp.zeros((1, m + text_tokens, model.width)))
    at = jnp.broadcast_to(jnp.arange(m + text_tokens - answer_tokens, m + text_tokens), (batch, answer_tokens))
    tx = optax.adamw(1e-4)

    def loss(c, f, lm):
        x = jnp.concatenate([connector.apply(c, f, grid), text], axis=1)
        logits = model.apply(lm, embeds=x, logits_at=at)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(c, opt, f, lm):  # the LM's weights an argument: closed over, XLA folds them as constants
        grads = jax.grad(loss)(c, f, lm)
        updates, opt = tx.update(grads, opt, c)
        return optax.apply_updates(c, updates), opt

    return timed(step, c_params, tx.init(c_params), features, lm_params, repeats=repeats)


def run(args) -> list[dict]:
    key = jax.random.key(0)
    tower_cfg, res = (TINY_TOWER, 32) if args.tiny else (TOWER, 336)
    tower = ViT(**tower_cfg)
    images = jax.random.normal(key, (args.batch, res, res, 3), jnp.float32)
    tower_params = jax.jit(tower.init)(key, images[:1])
    features = jax.jit(lambda p, x: tower.apply(p, x)[1]["encoded"])(tower_params, images)
    grid = tuple(tower.grid((res, res)))
    rows = [{"what": "tower", "grid": list(grid), "params": tree.count(tower_params["params"]),
             "forward_ms": timed(jax.jit(lambda p, x: tower.apply(p, x)[1]["encoded"]), tower_params, images,
                                 repeats=args.repeats)}]
    lms = {name: lm_config(name, args.dtype) for name in args.lms}
    prefills: dict[tuple[str, int], dict] = {}
    for family in args.families:
        for budget in args.budgets:
            setting, tokens, note = connectors.resolve(family, budget, grid, 2.0)
            row = {"what": "connector", "family": family, "budget": budget}
            if setting is None:
                rows.append({**row, "note": note})
                continue
            cfg = {"name": family, "budget": setting}
            cost = connectors.cost(cfg, features.shape[-1], lms[args.lms[0]]["width"], grid)
            connector = connectors.build(cfg, lms[args.lms[0]]["width"])
            c_params = jax.jit(lambda k, c=connector: c.init(k, features[:1], grid))(key)
            row.update(tokens=tokens, note=note, connector_params=cost["params"],
                       connector_gflops=cost["flops"] / 1e9,
                       connector_ms=timed(jax.jit(lambda p, f, c=connector: c.apply(p, f, grid)), c_params, features,
                                          repeats=args.repeats))
            for name, lm_cfg in lms.items():
                if (name, tokens) not in prefills:
                    prefills[(name, tokens)] = prefill(lm_cfg, args.batch, tokens + args.text_tokens, args.repeats,
                                                       key)
                row[name] = dict(prefills[(name, tokens)])
                if family in args.step_families and name == args.lms[0]:
                    row[name]["stage1_step_ms"] = stage1_step(cfg, lm_cfg, features, grid, args.text_tokens,
                                                              args.answer_tokens, args.repeats, key)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def markdown(rows: list[dict], args) -> str:
    tower = rows[0]
    lines = [f"{jax.devices()[0].device_kind}, jax {jax.__version__}, batch {args.batch}, {args.text_tokens} text "
             f"tokens, LM matmuls in {args.dtype}. Tower: {tower['grid'][0]}×{tower['grid'][1]} patches, "
             f"{tower['params'] / 1e6:.0f}M parameters, forward {tower['forward_ms']:.2f} ms a batch.", "",
             "| connector | tokens | params | GFLOP/img | ms | " + " | ".join(
                 f"{n} GFLOP/seq | {n} prefill ms | {n} stage-1 step ms" for n in args.lms) + " |",
             "|---|---:|---:|---:|---:|" + "---:|---:|---:|" * len(args.lms)]
    for r in rows[1:]:
        if "tokens" not in r:
            lines.append(f"| {r['family']} | {r['budget']}: {r['note']} |")
            continue
        cells = []
        for n in args.lms:
            step = r[n].get("stage1_step_ms")
            cells += [f"{r[n]['lm_gflops']:.2f}", f"{r[n]['prefill_ms']:.2f}", "" if step is None else f"{step:.2f}"]
        lines.append(f"| {r['family']} | {r['tokens']}{' (' + r['note'] + ')' if r['note'] else ''} | "
                     f"{r['connector_params']:,} | {r['connector_gflops']:.3f} | {r['connector_ms']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a small tower and LM, 4/16 tokens: a CPU smoke run")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--budgets", default="64,144,576")
    parser.add_argument("--lms", default="smollm2_135m,qwen2_0.5b")
    parser.add_argument("--step_families", default="mlp,pool,qwen_resampler")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--text_tokens", type=int, default=64)
    parser.add_argument("--answer_tokens", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", help="the LM's matmul dtype")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="a JSON file (the Markdown table goes beside it)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.budgets, args.lms, args.batch, args.text_tokens, args.repeats = "4,16", "tiny", 2, 8, 2
        args.answer_tokens, args.dtype = 2, "float32"
    args.families, args.lms = args.families.split(","), args.lms.split(",")
    args.step_families = args.step_families.split(",")
    args.budgets = [int(b) for b in args.budgets.split(",")]
    rows = run(args)
    table = markdown(rows, args)
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.write_text(json.dumps({"devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
                                   "args": {k: v for k, v in vars(args).items()}, "rows": rows}, indent=1) + "\n")
        out.with_suffix(".md").write_text(table)
    return rows


if __name__ == "__main__":
    main()
