"""``python -m vitmm.data check|examples``: look at raw data before a run; write example data.

    python -m vitmm.data check --data_path llava.json --image_folder images/
    python -m vitmm.data check --wds 'shards/{00000..00099}.tar'
    python -m vitmm.data check --csv train.csv [--csv_img_key filepath --csv_caption_key title]
    python -m vitmm.data check --parquet 'data/train-*.parquet'
    python -m vitmm.data examples --format llava --out /tmp/llava_demo --num 512

``check`` reads every example once as a training run would (the image decoded, the conversation's
turns and ``<image>`` tags checked) and prints the number of good examples and every bad one by
its id and reason; exit 0 when nothing is bad, 1 otherwise, 2 when the data cannot be opened.
``examples`` writes scenes in one of the formats (``vitmm.data.examples``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import sys

from vitmm.data import formats, skips
from vitmm.data.chat_render import IMAGE_PLACEHOLDER, conversation_messages


def check_example(example, max_images: int = 1) -> skips.Skipped | None:
    """Why a source's example would be skipped in training (format-level checks), or None."""
    from vitmm.data.images import decode_image

    if isinstance(example, skips.Skipped):
        return example
    example_id = skips.example_id(example)
    try:
        images = example.get("images", [example["image"]] if "image" in example else [])
        if len(images) > max_images:
            raise skips.BadExample("too_many_images", f"{len(images)} images")
        for data in images:
            decode_image(data)
        if "conversations" in example:
            messages = conversation_messages(example["conversations"])
            tags = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
            if tags != len(images) or any(IMAGE_PLACEHOLDER in m["content"] for m in messages if m["role"] != "user"):
                raise skips.BadExample("image_tag_mismatch", f"{tags} tag(s) for {len(images)} image(s)")
    except skips.BadExample as bad:
        return skips.Skipped(bad.reason, example_id, bad.detail)
    return None


def check(source, max_images: int = 1, workers: int | None = None, out=None) -> int:
    """Prints every bad example of ``source`` and a summary; returns the number of bad ones."""
    out = out or sys.stdout
    workers = workers or min(8, os.cpu_count() or 1)

    def one(index):
        return check_example(source[index], max_images)

    bad = collections.Counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for result in pool.map(one, range(len(source)), chunksize=64):
            if result is not None:
                bad[result.reason] += 1
                detail = f" ({result.detail})" if result.detail else ""
                print(f"bad: {result.id}: {result.reason}{detail}", file=out)
    total = sum(bad.values())
    by_reason = ", ".join(f"{reason} {n}" for reason, n in sorted(bad.items()))
    print(f"{len(source) - total} good, {total} bad" + (f" ({by_reason})" if bad else "") + f" of {len(source)}.",
          file=out)
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitmm.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="read every example once; name every bad one")
    c.add_argument("--data_path", help="LLaVA JSON or JSONL")
    c.add_argument("--image_folder", help="where LLaVA's (or a CSV's) relative image paths start")
    c.add_argument("--wds", help="tar shards, e.g. 'shards/{00000..00099}.tar'")
    c.add_argument("--csv", help="a CSV/TSV of image paths and captions")
    c.add_argument("--csv_img_key", default="filepath")
    c.add_argument("--csv_caption_key", default="title")
    c.add_argument("--csv_separator")
    c.add_argument("--parquet", help="parquet files (a glob or brace pattern; several joined by ::)")
    c.add_argument("--parquet_image_key")
    c.add_argument("--parquet_text_key")
    c.add_argument("--max_images", type=int, default=1, help="images an example may have (the model's limit)")
    c.add_argument("--workers", type=int, default=None)
    e = sub.add_parser("examples", help="write scenes in a raw format")
    e.add_argument("--format", choices=("llava", "wds", "csv", "parquet"), required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--num", type=int, default=512)
    e.add_argument("--resolution", type=int, default=64)
    e.add_argument("--split", default="train")
    e.add_argument("--multi_image_every", type=int, default=0,
                   help="llava: every N-th conversation shows 2 or 3 images (0: none)")
    args = parser.parse_args(argv)
    from vitmm import console

    console.quiet()  # the libraries' expected warnings (vitmm/console.py)

    if args.command == "examples":
        kwargs = {"text_only_every": 10, "multi_image_every": args.multi_image_every} if args.format == "llava" else {}
        from vitmm import cli
        from vitmm.data import examples

        if args.num < 1 or args.resolution < 8 or args.split not in ("train", "validation", "test"):
            parser.error(f"--num {args.num} (at least 1), --resolution {args.resolution} (at least 8 pixels) and "
                         f"--split {args.split!r} (train, validation or test): one of them is not.")
        try:
            other_splits = (lambda names: args.format == "parquet"  # splits side by side, as the Hub lays them
                            and all(n.endswith(".parquet") and not n.startswith(f"{args.split}-") for n in names))
            out = cli.new_output_folder(args.out, reusable=other_splits)
        except (ValueError, FileExistsError) as err:
            print(f"python -m vitmm.data examples: {err}", file=sys.stderr)
            return 2
        path = examples.write(args.format, out, args.num, resolution=args.resolution, split=args.split, **kwargs)
        print(f"wrote {args.num} {args.format} examples: {path}")
        return 0
    spec = {k: v for k, v in vars(args).items() if v is not None}
    try:
        source = formats.source_from(spec)
    except (ValueError, FileNotFoundError) as err:
        print(f"python -m vitmm.data check: {err}", file=sys.stderr)
        return 2
    return 1 if check(source, args.max_images, args.workers) else 0


if __name__ == "__main__":
    sys.exit(main())
