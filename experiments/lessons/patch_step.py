"""Lesson 002, exercise 4, measured: the patch step's cost, as a strided convolution and as
unfold + matmul, alone and as a share of the whole forward.

    python -m experiments.lessons.patch_step                        # results/lessons/patch_step/
    python -m experiments.lessons.patch_step --smoke --out /tmp/pst # the tests run it

A ViT (default ``S/16`` at 224 px, float32, this CPU's threads) with either patch embedding
(``embed_impl="conv"`` or ``"unfold"``: the same parameters, the same numbers to float
rounding, which is checked), at batch 1, 8 and 64: seconds for the patch embedding alone and for
the whole forward, taken in turns (every setting once per round, ``--repeats`` rounds; median and
range), throughput, and the patch step's measured share of the forward next to its share of the
analytic FLOP count (``2·N_p·3P²·D`` of ``vit_tools.forward_flops``). Run it on a quiet machine.

Writes ``patch_step.csv``, ``patch_step.md`` and ``setup.json`` to ``--out``.
"""

from __future__ import annotations

import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lessons import common
from vitmm import xla_flags
from vitmm.models import vit as vit_lib
from vitmm.models import vit_tools
from vitmm.models.patch_embed import PatchEmbed
from vitmm.study import outputs

ROOT = pathlib.Path(__file__).resolve().parents[2]

IMPLS = ("conv", "unfold")
PRESETS = {
    "default": dict(variant="S/16", res=224, batches="1,8,64", repeats=5, seeds="0", workers=1),
    "smoke": dict(variant="Ti/16", res=64, batches="1,2", repeats=1, seeds="0", workers=1),
}


def build(variant: str, res: int, batches: list[int]) -> dict:
    """Compiled patch step and forward per (impl, batch), sharing one set of parameters."""
    params = vit_lib.ViT(variant=variant).init(jax.random.key(0), jnp.zeros((1, res, res, 3)))["params"]
    arch = vit_lib.ViT(variant=variant).arch()
    out = {}
    for impl in IMPLS:
        model = vit_lib.ViT(variant=variant, embed_impl=impl)
        embed = PatchEmbed(arch.width, arch.patch_size, impl=impl)
        for b in batches:
            x = jax.random.normal(jax.random.key(b), (b, res, res, 3))
            out[(impl, b)] = {
                "patch": (jax.jit(lambda p, x, e=embed: e.apply({"params": p}, x)), (params["embedding"], x)),
                "forward": (jax.jit(lambda p, x, m=model: m.apply({"params": p}, x)[0]), (params, x)),
            }
    return out


def measure(compiled: dict, repeats: int) -> dict:
    times = {key: {part: [] for part in fns} for key, fns in compiled.items()}
    for fns in compiled.values():  # compile and warm everything first
        for fn, args in fns.values():
            jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        for key, fns in compiled.items():
            for part, (fn, args) in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[key][part].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> pathlib.Path:
    args, preset, _ = common.parse_args(__doc__.splitlines()[0], "results/lessons/patch_step", PRESETS, argv,
                                        extra=(("repeats", int), ("variant", str), ("res", int)))
    out = pathlib.Path(args.out)
    if args.report:  # the report again from the committed timings: never a new measurement over them
        return common.rewrite(out, "patch_step", ("patch_step.csv",), to_markdown)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in str(preset["batches"]).split(",")]
    compiled = build(preset["variant"], preset["res"], batches)
    # The two implementations compute the same tokens (float rounding apart).
    gap = max(float(jnp.max(jnp.abs(compiled[("conv", b)]["patch"][0](*compiled[("conv", b)]["patch"][1])
                                     - compiled[("unfold", b)]["patch"][0](*compiled[("unfold", b)]["patch"][1]))))
              for b in batches)
    times = measure(compiled, preset["repeats"])
    arch = vit_lib.ViT(variant=preset["variant"]).arch()
    total = vit_tools.forward_flops(arch, (preset["res"],) * 2)
    n_patch = (preset["res"] // arch.patch_size[0]) * (preset["res"] // arch.patch_size[1])
    embed = 2 * n_patch * 3 * arch.patch_size[0] * arch.patch_size[1] * arch.width
    rows = []
    for (impl, b), parts in times.items():
        patch, forward = np.array(parts["patch"]), np.array(parts["forward"])
        rows.append({"impl": impl, "batch": b, "patch_s": float(np.median(patch)), "patch_s_min": float(patch.min()),
                     "patch_s_max": float(patch.max()), "forward_s": float(np.median(forward)),
                     "forward_s_min": float(forward.min()), "forward_s_max": float(forward.max()),
                     "patch_img_s": b / float(np.median(patch)), "forward_img_s": b / float(np.median(forward)),
                     "patch_share": float(np.median(patch)) / float(np.median(forward)),
                     "analytic_share": embed / total})
    setup = {**preset, "cpu_threads": len(os.sched_getaffinity(0)), "max_abs_difference": gap}
    outputs.write_outputs(out, "patch_step", setup, to_markdown(rows, setup), {"patch_step.csv": rows})
    groups = {f"batch {b}": {impl: [100 * t / f for t, f in zip(times[(impl, b)]["patch"], times[(impl, b)]["forward"],
                                                                  strict=True)] for impl in IMPLS} for b in batches}
    outputs.bar_plot(groups, "patch step / whole forward (%)", out / "patch_step.png",
                    f"ViT-{preset['variant']} at {preset['res']} px (per round)")
    return out


def to_markdown(rows: list[dict], setup: dict) -> str:
    lines = [f"ViT-{setup['variant']} at {setup['res']} px, float32, {setup['cpu_threads']} CPU threads; seconds: "
             f"median [min, max] of {setup['repeats']} rounds in which every setting took a turn. The two patch "
             "embeddings "
             f"agree to {setup['max_abs_difference']:.1e} (max abs difference of the tokens).", "",
             "| patch step | batch | patch step s | forward s | patch img/s | forward img/s | share of forward | "
             "share of FLOPs |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['batch']} | {r['patch_s']:.4f} [{r['patch_s_min']:.4f}, "
                     f"{r['patch_s_max']:.4f}] | {r['forward_s']:.4f} [{r['forward_s_min']:.4f}, "
                     f"{r['forward_s_max']:.4f}] | {r['patch_img_s']:,.0f} | {r['forward_img_s']:,.1f} | "
                     f"{100 * r['patch_share']:.2f}% | {100 * r['analytic_share']:.2f}% |")
    by = {(r["impl"], r["batch"]): r for r in rows}
    lines += ["", "unfold / conv time of the patch step: " + "; ".join(
        f"batch {b}: {by[('unfold', b)]['patch_s'] / by[('conv', b)]['patch_s']:.2f}×"
        for b in sorted({r["batch"] for r in rows}))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
