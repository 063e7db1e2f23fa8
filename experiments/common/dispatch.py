"""``python -m experiments.<study> NAME [options]`` for a study of several scripts: runs
``experiments.<study>.NAME`` as ``__main__`` with the options; with no NAME, lists them."""

from __future__ import annotations

import importlib
import pkgutil
import runpy
import sys


def main(package: str) -> None:
    module = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(module.__path__)
                   if not m.name.startswith("_") and m.name != "common")
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        given = f"{sys.argv[1]!r} is not one of them. " if len(sys.argv) > 1 else ""
        sys.exit(f"{(module.__doc__ or '').strip()}\n\n{given}Run one of: "
                 + ", ".join(f"python -m {package} {n}" for n in names))
    name = sys.argv.pop(1)
    sys.argv[0] = f"{package}.{name}"
    runpy.run_module(f"{package}.{name}", run_name="__main__", alter_sys=True)
