"""Raw-data reader speed: examples/s of each format with JPEG decoding and resizing to 224 px, and
the cores that would feed one GPU.

    python -m experiments.bench.readers [--num 512] [--resolution 448] [--repeats 5] [--threads 1 2] [--workers 1 2]

Writes scenes as JPEG (quality 95, ``--resolution`` px, the size of a typical web or COCO photo
after img2dataset) into each format (``vitmm.data.examples``), then times, in one run, the training
input of each (``pipeline.train_iterator`` with ``skip_bad``: read, decode, crop or pad, resize to
224, normalise, tokenize, batch) over ``--batches`` batches of 64 after a warm-up, median and range
over ``--repeats``, with 1 reader thread (about one core: decoding releases the GIL, the rest is
Python), more threads, and worker processes (``workers``, 1 thread each). ``draft`` rows let libjpeg
decode at a reduced scale (``decode(draft=224)``). The built-in scenes (TFDS, PNG records at 224 px,
``--num`` of them) are timed the same way with the scenes configs' pp.
The cores one GPU needs: the GPU step's rate (``--gpu_rate``, the H200's CLIP-B/16 step) over the
one-thread rate. Results go to ``results/bench_readers/bench_readers.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib
import platform
import statistics
import tempfile
import time

from vitmm.data import device_feed, examples, formats, pipeline, preprocess

CLIP_PP = ("decode{draft}|random_resized_crop(224, scale=(0.9, 1.0))|value_range(-1, 1)|"
           "tokenize('caption', 64)|keep('image', 'caption_tokens')")
SCENES_PP = "decode{draft}|flip_lr|value_range(-1, 1)|tokenize('caption', 64)|keep('image', 'caption_tokens')"
LLAVA_PP = ("decode{draft}|pad_to_square()|resize(224)|normalize()|conversation_tokens(256)|"
            "keep('image', 'ids', 'answer_mask', 'prompt_len', 'image_pos', 'has_image')")
OUT = pathlib.Path(__file__).resolve().parents[2] / "results/bench_readers"


def write_data(root: pathlib.Path, num: int, resolution: int) -> dict:
    """``{format: input spec}`` of the same scenes in each format."""
    kw = dict(resolution=resolution, exts=("jpg",))
    from vitmm.data import scenes_builder

    name = f"easy_224_{num}_16_16_s0"
    scenes_builder.prepare(name, str(root / "tfds"))
    return {
        "scenes": {"scenes": f"scenes/{name}", "data_dir": str(root / "tfds")},
        "llava": {"data_path": str(examples.write_llava(root / "llava", num, **kw)),
                  "image_folder": str(root / "llava")},
        "wds": {"wds": examples.write_wds(root / "wds", num, per_shard=256, **kw)},
        "csv": {"csv": str(examples.write_csv(root / "csv", num, **kw))},
        "parquet": {"parquet": str(examples.write_parquet(root / "parquet", num, **kw))},
    }


def rate(spec: dict, pp: str, threads: int, workers: int, batch: int, batches: int, repeats: int) -> list[float]:
    if "scenes" in spec:  # the built-in TFDS scenes (PNG records), read as training reads them
        source = pipeline.get_source(spec["scenes"], "train", spec["data_dir"], keys=("image", "caption"))
        skip = None
    else:
        source, skip = formats.source_from(spec), 0.0
    it = pipeline.train_iterator(source, preprocess.parse(pp), batch, seed=0, num_threads=threads,
                                 prefetch=2 * batch if skip is not None else 4, skip_bad=skip, workers=workers)
    try:
        next(it)  # warm-up: threads or processes started, files opened
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(batches):
                next(it)
            rates.append(batches * batch / (time.perf_counter() - start))
    finally:
        device_feed.close(it)
    return rates


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=512)
    parser.add_argument("--resolution", type=int, default=448)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="reader threads, no workers")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker processes, 1 thread each")
    parser.add_argument("--formats", nargs="+", default=["scenes", "llava", "wds", "csv", "parquet"])
    parser.add_argument("--uint8", action="store_true",
                        help="images leave the host as uint8 (input.device_normalize: the pp's final "
                             "value_range/normalize runs on the device)")
    parser.add_argument("--gpu_rate", type=float, default=2900.0, help="examples/s of the GPU step to feed")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        specs = write_data(pathlib.Path(tmp), args.num, args.resolution)
        settings = [(t, 0) for t in args.threads] + [(1, w) for w in args.workers if w > 0]
        for fmt, spec in specs.items():
            if fmt not in args.formats:
                continue
            for draft in ("",) if fmt == "scenes" else ("", "draft"):  # scenes are PNG: no DCT scaling
                for threads, workers in settings:
                    pp = (LLAVA_PP if fmt == "llava" else SCENES_PP if fmt == "scenes" else CLIP_PP).format(
                        draft="(draft=224)" if draft else "")
                    if args.uint8:
                        pp = preprocess.split_image_affine(pp)[0]
                    r = rate(spec, pp, threads, workers, args.batch, args.batches, args.repeats)
                    med = statistics.median(r)
                    per_core = (threads, workers) == (1, 0)
                    rows.append(dict(format=fmt, decode=draft or "full", host="uint8" if args.uint8 else "float32",
                                     threads=threads, workers=workers,
                                     median=round(med, 1), low=round(min(r), 1), high=round(max(r), 1),
                                     cores_per_gpu=round(args.gpu_rate / med, 1) if per_core else ""))
                    print(rows[-1], flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_readers_uint8" if args.uint8 else "bench_readers"
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    head = (f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores; {args.num} scenes as "
            f"{args.resolution}px JPEG; batches of {args.batch}, {args.batches} a repeat, median (range) of "
            f"{args.repeats}; cores a GPU needs at {args.gpu_rate:.0f} examples/s: that rate over the 1-thread one.")
    lines = [head, "", "| format | decode | host images | threads | workers | examples/s | range | cores per GPU |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    lines += [f"| {r['format']} | {r['decode']} | {r['host']} | {r['threads']} | {r['workers']} | {r['median']:,.0f} | "
              f"{r['low']:,.0f}–{r['high']:,.0f} | {r['cores_per_gpu']} |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
