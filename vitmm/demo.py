"""Front-end demo: one image through a ViT, its tokens and costs (``make demo`` trains CLIP instead).

    python -m vitmm.demo --config configs/frontend_demo.py[:variant=B/16] [--config.key=value]

Feeds one deterministic synthetic image through the configured ViT and prints the token shape,
the CLS norm, a row of the position table, parameter counts, and the token counts and costs of
common resolutions and patch sizes.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from vitmm import tree, xla_flags
from vitmm.models import posemb, vit, vit_tools


def synthetic_image(size: int) -> np.ndarray:
    """A deterministic ``[size, size, 3]`` uint8 scene: a colour ramp, a red disc, a blue square."""
    y, x = np.mgrid[:size, :size] / max(size - 1, 1)
    image = np.stack([0.2 + 0.6 * x, 0.2 + 0.6 * y, 0.5 * (1 - x)], axis=-1)
    disc = (x - 0.3) ** 2 + (y - 0.35) ** 2 < 0.15**2
    square = (np.abs(x - 0.7) < 0.12) & (np.abs(y - 0.65) < 0.12)
    image[disc] = (0.9, 0.1, 0.1)
    image[square] = (0.1, 0.2, 0.9)
    return np.round(image * 255).astype(np.uint8)


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def run(config, print_fn=print) -> dict:
    """Runs the demo for ``config`` (see ``configs/frontend_demo.py``); returns what it printed."""
    size = config.image_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"image_size={size!r}: a positive number of pixels (e.g. 224).")
    model = vit.ViT(**config.model.to_dict())
    arch = model.arch()
    image = synthetic_image(size)
    images = jnp.asarray(image[None], jnp.float32) / 127.5 - 1.0  # value range [-1, 1]

    start = time.perf_counter()
    variables = jax.jit(model.init)(jax.random.key(config.seed), images)
    pooled, out = jax.jit(model.apply)(variables, images)
    pooled.block_until_ready()
    seconds = time.perf_counter() - start
    params = variables["params"]
    grid = model.grid((size, size))

    print_fn(f"vitmm front-end demo: ViT-{config.model.variant} on one synthetic {size}x{size}x3 image "
             f"(init + forward, compiled, {seconds:.1f} s on {jax.devices()[0].platform})")
    print_fn(f"  patch grid            {grid[0]} x {grid[1]} = {grid[0] * grid[1]} patches of "
             f"{arch.patch_size[0]}x{arch.patch_size[1]}")
    print_fn(f"  token shape           {tuple(out['encoded'].shape)}  (batch, CLS + patches, width)")
    cls_norm = float(jnp.linalg.norm(out["encoded"][0, 0]))
    last_block = f"block_{arch.depth - 1:02d}"
    cls_norm_raw = float(jnp.linalg.norm(out[last_block][0, 0]))
    print_fn(f"  CLS norm              {cls_norm:.4f} after the final LayerNorm (≈ sqrt(width) at init), "
             f"{cls_norm_raw:.4f} at {last_block} (residual stream)")
    if "pos_embedding" in params:
        row = np.asarray(params["pos_embedding"][0, 0, 1, :6])
        print_fn(f"  learned pos row (0,1) {np.array2string(row, precision=4, floatmode='fixed')} ...")
    sincos = np.asarray(posemb.sincos_2d(*grid, arch.width)[1, :6])
    print_fn(f"  sincos2d row (0,1)    {np.array2string(sincos, precision=4, floatmode='fixed')} ...")

    parts = {
        "patch embedding": tree.count(params["embedding"]),
        "cls + positions": sum(tree.count(params[k])
                               for k in ("cls", "pos_embedding", "cls_pos_embedding") if k in params),
        "encoder": tree.count(params["encoder"]),
    }
    total = tree.count(params)
    print_fn("\nParameters of this model")
    for name, count in parts.items():
        print_fn(f"  {name:<16} {count:>14,}")
    print_fn(f"  {'total':<16} {total:>14,}")

    print_fn("\nViT variants at 224x224, patch 16, timm layout (learned positions cover CLS, no head)")
    print_fn(f"  {'variant':<8} {'width':>6} {'depth':>6} {'mlp':>6} {'heads':>6} {'params':>15} "
             f"{'GFLOP/img':>10}")
    variants = {}
    for name in config.variants:
        v_arch = vit.decode_variant(f"{name}/16")
        count = vit_tools.count_params(vit.ViT(variant=f"{name}/16", posemb_layout="with_cls"))
        variants[name] = count
        gflops = vit_tools.forward_flops(v_arch, (224, 224)) / 1e9
        print_fn(f"  {name + '/16':<8} {v_arch.width:>6} {v_arch.depth:>6} {v_arch.mlp_dim:>6} "
                 f"{v_arch.num_heads:>6} {count:>15,} {gflops:>10.2f}")

    name = config.model.variant.split("/")[0]
    rows = vit_tools.token_costs(name, config.table_resolutions, config.table_patches)
    base = next((r for r in rows if r["resolution"] == 224 and r["patch"] == 16), None)
    print_fn(f"\nTokens per image and cost for ViT-{name} (N = patches + CLS; attention grows as N²)")
    print_fn(f"  {'res':>5} {'patch':>5} {'patches':>8} {'N':>6} {'N² / N²(224/16)':>16} "
             f"{'GFLOP fwd':>10} {'attn share':>10}")
    for r in rows:
        rel = (r["attn_pairs"] / base["attn_pairs"]) if (base and r["attn_pairs"]) else None
        print_fn(f"  {r['resolution']:>5} {r['patch']:>5} {_fmt(r['patches'], ','):>8} "
                 f"{_fmt(r['tokens'], ','):>6} {_fmt(rel, '.2f'):>16} {_fmt(r['gflops'], '.1f'):>10} "
                 f"{_fmt(r['attn_share'], '.1%'):>10}")
    print_fn("  (— : the resolution is not a multiple of the patch; vitmm raises instead of cropping)")
    return dict(token_shape=tuple(out["encoded"].shape), cls_norm=cls_norm, params=total,
                variants=variants, rows=rows, pooled_shape=tuple(pooled.shape))


DEFAULT_CONFIG = "configs/frontend_demo.py"


def _default_config() -> str:
    """``configs/frontend_demo.py`` here, else the repository's (the demo started from another folder)."""
    import pathlib

    here = pathlib.Path(DEFAULT_CONFIG)
    return DEFAULT_CONFIG if here.is_file() else str(pathlib.Path(__file__).resolve().parents[1] / DEFAULT_CONFIG)


def main(argv=None) -> None:
    """The demo; a bad config file, arg, key or value is one line and exit 2 (``VITMM_DEBUG=1``: the
    traceback)."""
    import os

    from absl import app, flags, logging
    from ml_collections import config_flags

    from vitmm import config_args

    argv = list(argv or sys.argv)
    if config_args.config_spec(argv) is None:  # the default as if given: a flag's default is read when
        argv.insert(1, f"--config={_default_config()}")  # it is defined, where its overrides' errors escaped
    config_flags.DEFINE_config_file("config", None, f"Demo config file (default: {DEFAULT_CONFIG}).",
                                    lock_config=True, sys_argv=argv)
    debug = os.environ.get("VITMM_DEBUG", "") not in ("", "0")

    def fail(err: BaseException | str):
        if debug and isinstance(err, BaseException):
            raise err
        lines = [line for line in str(err).splitlines() if line.strip()]
        print(f"python -m vitmm.demo: {lines[-1].strip() if lines else repr(err)}", file=sys.stderr)
        sys.exit(2)

    def parse(args):
        path = config_args.config_spec(args).partition(":")[0]
        if not os.path.isfile(path) and not debug:
            fail(f"--config {path}: no such file; the demo's is {DEFAULT_CONFIG}.")
        try:
            parsed = flags.FLAGS(args)
            flags.FLAGS.config.get("model")  # a config file that failed to load raises only when used
            return parsed
        except Exception as err:  # noqa: BLE001 - config_flags raises whatever the config file raised
            if not debug:
                fail(config_args.unknown_override(args, keys_are=f"in {path}") or err)
            raise

    def _main(_):
        logging.set_verbosity(logging.WARNING)  # hide JAX's "no TPU/GPU backend" INFO lines
        try:
            run(flags.FLAGS.config)
        except (ValueError, KeyError, TypeError) as err:
            fail(err)

    app.run(_main, argv=argv, flags_parser=parse)


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
