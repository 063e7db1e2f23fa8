"""Scenes written in the formats researchers bring (``python -m vitmm.data examples``): a LLaVA
folder (JSON + images, multi-turn conversations, some text-only), webdataset tar shards, a CSV and
a parquet file. For trying the raw-data path end to end without a download, and for the tests.

Every file is made from ``scenes.generate`` (deterministic), so two calls write the same bytes.
"""

from __future__ import annotations

import csv
import io
import json
import pathlib
import tarfile

import numpy as np
from PIL import Image

from vitmm.data import scenes

FORMATS = ("llava", "wds", "csv", "parquet")
PIL_FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


def encode(image: np.ndarray, ext: str = "jpg") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, PIL_FORMATS[ext], **({"quality": 95} if ext == "jpg" else {}))
    return buf.getvalue()


def _scene(i: int, resolution: int, difficulty: str, split: str) -> dict:
    return scenes.generate(difficulty, resolution, i, split)


def _ext(i: int, exts) -> str:
    return exts[i % len(exts)]


def write_llava(out, num: int, *, resolution: int = 64, difficulty: str = "easy", split: str = "train",
                exts=("jpg",), text_only_every: int = 0, turns: int = 2, jsonl: bool = False,
                multi_image_every: int = 0, max_images: int = 3, video_every: int = 0) -> pathlib.Path:
    """``out/data.json`` (or ``.jsonl``) and ``out/images/``: each scene a conversation of up to
    ``turns`` question/answer exchanges, the image in the first user turn (its caption as the first
    answer); every ``text_only_every``-th example has no image (a question about words), every
    ``multi_image_every``-th shows 2 to ``max_images`` scenes and asks for one's caption, and every
    ``video_every``-th is a video of 12 scenes (``write_video``) asking for its last one's."""
    out = pathlib.Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(num):
        s = _scene(i, resolution, difficulty, split)
        if text_only_every and i % text_only_every == text_only_every - 1:
            records.append({"id": f"text{i:06d}", "conversations": [
                {"from": "human", "value": f"Spell the word '{s['answers'][0]}'."},
                {"from": "gpt", "value": " ".join(s["answers"][0])}]})
            continue
        name = f"{i:06d}.{_ext(i, exts)}"
        (out / "images" / name).write_bytes(encode(s["image"], _ext(i, exts)))
        if video_every and i % video_every == video_every - 1:
            shown = [_scene(20_000_000 + i * 16 + k, resolution, difficulty, split) for k in range(12)]
            write_video(out / "videos" / f"{i:06d}.mp4", [v["image"] for v in shown])
            records.append({"id": f"{i:06d}", "video": f"videos/{i:06d}.mp4", "conversations": [
                {"from": "human", "value": "<video>\nDescribe the last frame."},
                {"from": "gpt", "value": shown[-1]["caption"]}]})
            continue
        if multi_image_every and i % multi_image_every == multi_image_every - 1:
            records.append(_several_images(out, i, resolution, difficulty, split, exts, name, max_images))
            continue
        conv = [{"from": "human", "value": "<image>\nDescribe the image."}, {"from": "gpt", "value": s["caption"]}]
        for q, a in list(zip(s["questions"], s["answers"], strict=True))[: turns - 1]:
            conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        records.append({"id": f"{i:06d}", "image": f"images/{name}", "conversations": conv})
    path = out / ("data.jsonl" if jsonl else "data.json")
    if jsonl:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records, indent=1))
    return path


def write_video(path, frames: list, fps: int = 4) -> pathlib.Path:
    """``frames`` (uint8 ``[H, W, 3]``, even sides) as an MPEG-4 video file (PyAV)."""
    import av

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return path


def _several_images(out, i, resolution, difficulty, split, exts, first, max_images) -> dict:
    """A conversation about 2 to ``max_images`` scenes (``first`` and others made for it): which
    one is which, asked by number."""
    count = 2 + (i * 7 // 3) % (max_images - 1)
    names, captions = [f"images/{first}"], [_scene(i, resolution, difficulty, split)["caption"]]
    for k in range(1, count):
        s = _scene(10_000_000 + i * 8 + k, resolution, difficulty, split)
        name = f"images/{i:06d}_{k}.{_ext(i, exts)}"
        (out / name).write_bytes(encode(s["image"], _ext(i, exts)))
        names.append(name)
        captions.append(s["caption"])
    shown = "".join(f"Image {k + 1}: <image>\n" for k in range(count))
    asked = 1 + (i // 2) % count
    return {"id": f"{i:06d}", "image": names, "conversations": [
        {"from": "human", "value": f"{shown}Describe image {asked}."}, {"from": "gpt", "value": captions[asked - 1]}]}


def write_wds(out, num: int, *, per_shard: int = 100, resolution: int = 64, difficulty: str = "easy",
              split: str = "train", exts=("jpg",)) -> str:
    """img2dataset's layout: ``out/{00000..N}.tar`` of ``key.jpg``, ``key.txt``, ``key.json``;
    returns the brace pattern."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = (num + per_shard - 1) // per_shard
    for shard in range(shards):
        with tarfile.open(out / f"{shard:05d}.tar", "w") as tar:
            for i in range(shard * per_shard, min(num, (shard + 1) * per_shard)):
                s = _scene(i, resolution, difficulty, split)
                key = f"{shard:05d}{i:04d}"
                for field, data in ((_ext(i, exts), encode(s["image"], _ext(i, exts))),
                                    ("txt", s["caption"].encode()),
                                    ("json", json.dumps({"key": key, "caption": s["caption"]}).encode())):
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(out / f"{{00000..{shards - 1:05d}}}.tar")


def write_csv(out, num: int, *, resolution: int = 64, difficulty: str = "easy", split: str = "train",
              exts=("jpg",), separator: str = ",") -> pathlib.Path:
    """open_clip's CSV: ``filepath`` and ``title`` columns, the images beside it."""
    out = pathlib.Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / ("data.tsv" if separator == "\t" else "data.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter=separator)
        writer.writerow(["filepath", "title"])
        for i in range(num):
            s = _scene(i, resolution, difficulty, split)
            name = f"images/{i:06d}.{_ext(i, exts)}"
            (out / name).write_bytes(encode(s["image"], _ext(i, exts)))
            writer.writerow([name, s["caption"]])
    return path


def write_parquet(out, num: int, *, resolution: int = 64, difficulty: str = "easy", split: str = "train",
                  exts=("jpg",), messages: bool = False, row_group_size: int = 100) -> pathlib.Path:
    """Hugging Face datasets' layout: an ``image`` column of ``{"bytes", "path"}`` and a ``caption``
    column, or (``messages``) an ``images`` list and ``messages`` in the chat format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(num):
        s = _scene(i, resolution, difficulty, split)
        image = {"bytes": encode(s["image"], _ext(i, exts)), "path": f"{i:06d}.{_ext(i, exts)}"}
        if messages:
            rows.append({"images": [image], "messages": [
                {"role": "user", "content": [{"type": "image", "text": None},
                                             {"type": "text", "text": "\n" + s["questions"][0]}]},
                {"role": "assistant", "content": [{"type": "text", "text": s["answers"][0]}]}]})
        else:
            rows.append({"image": image, "caption": s["caption"]})
    path = out / f"{split}-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def write(fmt: str, out, num: int, **kwargs):
    writers = {"llava": write_llava, "wds": write_wds, "csv": write_csv, "parquet": write_parquet}
    if fmt not in writers:
        raise ValueError(f"Unknown format {fmt!r}; choose one of {FORMATS}.")
    return writers[fmt](out, num, **kwargs)
