"""LLaVA-style conversations: a JSON list or JSONL of ``{"id", "image", "conversations"}`` with the
images under ``image_folder`` (``formats`` has the overview)."""

from __future__ import annotations

import json
import pathlib

from vitmm.data import file_io
from vitmm.data.skips import Skipped


class LlavaSource:
    """A LLaVA JSON list (or JSONL, one object a line) and its image folder, which holds the videos
    too: ``video`` is a video file, a folder of frame images (LLaVA-NeXT's trainer: every
    ``jpg|jpeg|png|webp`` file in it, sorted by name, as its ``os.listdir`` + ``sort``), or a list of
    frame files. Its place in the conversation is its ``<video>`` tag, or the one ``<image>`` tag of
    a record without one (``data.video``)."""

    def __init__(self, data_path, image_folder=None):
        self.path = file_io.path(data_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"input.data_path={str(data_path)!r}: no such file (a LLaVA JSON or JSONL).")
        self.image_folder = file_io.path(image_folder) if image_folder else self.path.parent
        if image_folder and not self.image_folder.is_dir():
            raise FileNotFoundError(f"input.image_folder={str(image_folder)!r}: no such folder.")
        self._records = _load_json_records(self.path)
        self.name = self.path.name

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int):
        record = self._records[index]
        if isinstance(record, Skipped):
            return record
        example_id = str(record.get("id", f"{self.name}:{index}")) if isinstance(record, dict) else \
            f"{self.name}:{index}"
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            return Skipped("bad_record", example_id, "no 'conversations' list")
        images = record.get("image")
        paths = [] if images is None else [images] if isinstance(images, str) else images
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            return Skipped("bad_record", example_id, f"'image' must be a path or a list of paths, got {images!r}")
        video = record.get("video")  # a file, a folder of frames, or a list of frame files
        frames = [] if video is None else [video] if isinstance(video, str) else video
        if not isinstance(frames, list) or not all(isinstance(p, str) for p in frames):
            return Skipped("bad_record", example_id, f"'video' must be a path or a list of paths, got {video!r}")
        frames = [self.image_folder / p for p in frames]
        folder = isinstance(video, str) and frames[0].is_dir()
        if folder:
            frames = sorted((f for f in frames[0].iterdir() if f.is_file() and not f.name.startswith(".")
                             and f.suffix.lower().lstrip(".") in file_io.IMAGE_EXTENSIONS), key=lambda f: f.name)
            if not frames:
                return Skipped("image_missing", example_id, f"{self.image_folder / video}: a folder with no "
                               f"{'/'.join(file_io.IMAGE_EXTENSIONS)} frames")
        loaded = []
        for p in [self.image_folder / p for p in paths] + frames:
            data = file_io.read_bytes(p, example_id)
            if isinstance(data, Skipped):
                return data
            loaded.append(data)
        out = {"_id": example_id, "images": loaded[: len(paths)], "conversations": record["conversations"]}
        if video is not None:
            out["video"] = loaded[len(paths)] if isinstance(video, str) and not folder else loaded[len(paths):]
        return out


def _load_json_records(path: pathlib.Path) -> list:
    """A JSON list, or JSONL (a line that is not JSON becomes a ``bad_record`` skip)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark, as some editors write, is not data)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err}); save it as UTF-8.") from None
    stripped = text.strip()
    if stripped.startswith("{") and "\n" in stripped:  # one indented object is not JSONL (a record a line)
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict):
            raise ValueError(f"{path} holds one JSON object (keys {sorted(whole)[:5]}), not a list of records; "
                             "LLaVA data is a JSON list or JSONL (one record a line).")
    if stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); LLaVA data is a JSON list or JSONL.") from None
        return records
    records = []
    for number, line in enumerate(text.split("\n"), 1):  # (splitlines would also cut at U+2028 inside a string)
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            records.append(Skipped("bad_record", f"{path.name}:line{number}", str(err)))
    if not records:
        raise ValueError(f"{path} holds no examples.")
    return records
