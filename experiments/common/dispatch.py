"""``python -m experiments.<study> NAME [options]`` for a study of several scripts: runs
``experiments.<study>.NAME`` as ``__main__`` with the options; with no NAME, lists them
(``--help``: the same list, on stdout). ``--verbose`` anywhere keeps the libraries' routine
warnings on the console (``entry.quiet``)."""

from __future__ import annotations

import importlib
import pkgutil
import runpy
import sys

from experiments.common import entry


def main(package: str) -> None:
    entry.quiet()
    module = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(module.__path__)
                   if not m.name.startswith("_") and m.name != "common")
    def usage(given: str = "") -> str:
        return (f"{(module.__doc__ or '').strip()}\n\n{given}Run one of: "
                + ", ".join(f"python -m {package} {n}" for n in names)
                + f" (each takes --help; {entry.VERBOSE} keeps the libraries' routine warnings on the console)")

    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(usage())
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        sys.exit(usage(f"{sys.argv[1]!r} is not one of them. " if len(sys.argv) > 1 else ""))
    name = sys.argv.pop(1)
    sys.argv[0] = f"{package}.{name}"
    runpy.run_module(f"{package}.{name}", run_name="__main__", alter_sys=True)
