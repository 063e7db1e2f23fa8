"""Token counts and analytic forward cost of ViT variants across resolutions and patch sizes.

    python -m experiments.bench.token_counts [--out results/token_counts]

Writes ``token_counts.csv`` and ``token_counts.md``: for each variant, square resolution and
patch size, the number of tokens (patches + CLS), N², forward GFLOP per image (the standard
count, ``vitmm.models.vit_tools.forward_flops``) and the share of each layer's FLOPs spent in
attention scores. Resolutions that the patch does not divide are listed as not applicable.
This is the analytic side of the scaling tables; measured step times come with the benchmark.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

from vitmm.models import vit_tools

VARIANTS = ("Ti", "S", "B", "L")
RESOLUTIONS = (224, 256, 336, 384, 448, 512)
PATCHES = (8, 14, 16, 32)
COLUMNS = ("variant", "resolution", "patch", "patches", "tokens", "attn_pairs", "gflops", "attn_share")


def build_rows() -> list[dict]:
    return [row for name in VARIANTS for row in vit_tools.token_costs(name, RESOLUTIONS, PATCHES)]


def to_markdown(rows: list[dict]) -> str:
    lines = ["| variant | resolution | tokens N | N² | GFLOP fwd | attention share |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["tokens"] is None:
            lines.append(f"| {r['variant']} | {r['resolution']} | n/a (not a multiple of "
                         f"{r['patch']}) | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['resolution']} | {r['tokens']:,} | "
                         f"{r['attn_pairs']:,} | {r['gflops']:.1f} | {r['attn_share']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/token_counts", help="output folder")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = build_rows()
    with open(out / "token_counts.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "token_counts.md").write_text(to_markdown(rows))
    print(f"wrote {len(rows)} rows to {out}/token_counts.{{csv,md}}")
    return out


if __name__ == "__main__":
    main()
