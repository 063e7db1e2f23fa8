"""What a study writes: per-run rows as CSV, ``mean ± 95% CI`` cells for its Markdown tables, its
setup with the command and date, and figures (bar charts with CI error bars)."""

from __future__ import annotations

import csv
import json
import pathlib
import shlex
import sys
import time

import numpy as np

from vitmm.study import stats


def write_rows(rows: list[dict], path: pathlib.Path) -> None:
    """``rows`` as a CSV file, columns in order of first appearance."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)


def read_rows(path: pathlib.Path) -> list[dict]:
    """The rows ``write_rows`` wrote, numbers as numbers (an int where the text is one), empty cells
    as None and other text as it is: what a report reads to be written again without training."""

    def value(text: str):
        if text == "":
            return None
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def mean_ci(values, scale: float = 100, digits: int = 1) -> str:
    """``mean ± 95% CI half-width`` of per-seed values (a dict's values or a sequence), scaled; the
    mean alone for one seed (no interval)."""
    v = np.array(list(values.values()) if isinstance(values, dict) else list(values), float)
    if len(v) < 2:
        return f"{scale * v.mean():.{digits}f}"
    return f"{scale * v.mean():.{digits}f} ± {scale * stats.ci95(v):.{digits}f}"


def command(argv=None) -> str:
    """The command line that ran this study, as a user would type it again: ``python -m MODULE
    ARGS`` when it was started with ``-m`` (``argv``: the options, when ``main`` was handed them)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([head, shlex.join(sys.argv[1:] if argv is None else argv)]).rstrip()  # (quoted: read back by shlex)


def write_outputs(out: pathlib.Path, name: str, setup: dict, table: str, csvs: dict) -> None:
    """``setup.json`` (with the backend, date and command added), each ``{file: rows}`` CSV and
    ``NAME.md``; prints the table."""
    import jax

    setup = {**setup, "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"),
             "command": command()}
    for file, rows in csvs.items():
        write_rows(rows, out / file)
    (out / "setup.json").write_text(json.dumps(setup, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(table)
    print(table)


def save_figure(fig, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_plot(groups: dict, ylabel: str, path: pathlib.Path, title: str = "") -> None:
    """Grouped bars with 95% CI error bars: ``{group: {bar: per-seed values}}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = list(dict.fromkeys(b for g in groups.values() for b in g))
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(groups) * max(len(bars), 1) / 2), 3.8))
    width = 0.8 / max(len(bars), 1)
    for i, bar in enumerate(bars):
        xs = [j + i * width for j, g in enumerate(groups.values()) if bar in g]
        vals = [np.asarray(list(g[bar].values()) if isinstance(g[bar], dict) else g[bar], float)
                for g in groups.values() if bar in g]
        ax.bar(xs, [v.mean() for v in vals], width, yerr=[np.nan_to_num(stats.ci95(v)) for v in vals],
               capsize=3, label=bar)
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=7)
    save_figure(fig, path)
