"""Importing vitmm changes nothing; its entry points apply vitmm's XLA settings."""

import os
import subprocess
import sys

FLAG = "--xla_cpu_experimental_ynn_fusion_type"
IMPORT_ALL = ("import pkgutil, importlib, vitmm\n"
              "for m in pkgutil.walk_packages(vitmm.__path__, 'vitmm.'):\n"
              "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n")


def _run(code, env_flags=None, opt_out=None):
    """``XLA_FLAGS`` and whether a compiled tanh(a @ b) uses YNN fusions, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "VITMM_XLA_CPU_DEFAULTS")}
    if env_flags is not None:
        env["XLA_FLAGS"] = env_flags
    if opt_out is not None:
        env["VITMM_XLA_CPU_DEFAULTS"] = opt_out
    code += ("import os, jax, jax.numpy as jnp\n"
             "from jax._src import xla_bridge\n"
             "print(bool(xla_bridge._backends))\n"
             "a = jnp.ones((64, 64))\n"
             "hlo = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(a, a).compile().as_text()\n"
             "print(os.environ.get('XLA_FLAGS')); print('__ynn_fusion' in hlo)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    backend_open, flags, ynn = out.strip().splitlines()
    assert backend_open == "False", "importing vitmm opened a JAX backend, so entry points could not set flags"
    return flags, ynn == "True"


def test_importing_every_vitmm_module_changes_no_flags_and_opens_no_backend():
    assert _run(IMPORT_ALL) == ("None", True)  # XLA's default: YNN fusions on
    assert _run(IMPORT_ALL, "--xla_force_host_platform_device_count=2") == (
        "--xla_force_host_platform_device_count=2", True)


def test_entry_point_defaults_turn_off_ynn_fusions_and_keep_the_users_flags():
    use = "import vitmm.xla_flags\nvitmm.xla_flags.use_vitmm_defaults()\n"  # every module imported: the test above
    assert _run(use) == (f"{FLAG}=", False)
    flags, ynn = _run(use, "--xla_force_host_platform_device_count=2")
    assert flags == f"--xla_force_host_platform_device_count=2 {FLAG}=" and not ynn
    assert _run(use, f"{FLAG}=dot") == (f"{FLAG}=dot", True)  # the user's own choice wins
    assert _run(use, opt_out="0") == ("None", True)  # XLA's default left alone


def test_every_entry_point_applies_them():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    for path in ("vitmm/train/__main__.py", "vitmm/demo.py", "experiments/token_budget/__main__.py",
                 "experiments/bench/input.py", "experiments/bench/workers.py", "experiments/bench/decode.py",
                 "experiments/bench/resample_parity.py"):
        assert "xla_flags.use_vitmm_defaults()" in (root / path).read_text(), path
