"""Tables of examples: a CSV/TSV of image paths and captions (open_clip's), and Hugging Face
datasets' parquet files read with pyarrow (``formats`` has the overview)."""

from __future__ import annotations

import collections
import csv
import threading

import numpy as np

from vitmm.data import file_io
from vitmm.data.skips import Skipped


def _csv_rows(f, separator: str, img_key: str, caption_key: str, path) -> list[tuple]:
    """``(image, caption, line)`` of each row, ``line`` the file's line the row starts on (a quoted
    caption may span several; blank lines are skipped, and counted)."""
    reader = csv.reader(f, delimiter=separator)  # (it returns a blank line as [], so line_num counts it)
    header = next((row for row in reader if row), None) or []
    missing = [k for k in (img_key, caption_key) if k not in header]
    other = next((s for s in ("\t", ";", "|") if s != separator and len(header) == 1 and s in header[0]), None)
    if missing and other:  # (open_clip's --csv-separator defaults to a tab, in files it names .csv)
        raise ValueError(f"{path} has one column {header[0]!r} with separator {separator!r}: the file looks "
                         f"{other!r}-separated; set input.csv_separator={other!r}.")
    if missing:
        raise ValueError(f"{path} has no column(s) {missing} (its columns: {header or None}); set "
                         "input.csv_img_key and input.csv_caption_key.")
    at = {k: header.index(k) for k in (img_key, caption_key)}
    rows = []
    while True:
        start = reader.line_num + 1
        row = next(reader, None)
        if row is None:
            return rows
        if row:
            rows.append(tuple(row[at[k]] if at[k] < len(row) else None for k in (img_key, caption_key)) + (start,))


class CsvSource:
    """Rows of an image path and a caption; relative paths are under ``image_folder`` (default: the
    CSV's folder). The separator is a tab for ``.tsv`` and a comma otherwise unless given."""

    def __init__(self, path, img_key="filepath", caption_key="title", separator=None, image_folder=None):
        self.path = file_io.path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"input.csv={str(path)!r}: no such file.")
        separator = separator or ("\t" if self.path.suffix.lower() == ".tsv" else ",")
        try:
            with open(self.path, newline="", encoding="utf-8-sig") as f:  # (Excel's byte-order mark is not a name)
                self._rows = _csv_rows(f, separator, img_key, caption_key, self.path)
        except UnicodeDecodeError as err:
            raise ValueError(f"{self.path} is not UTF-8 text ({err}); save it as UTF-8.") from None
        self.image_folder = file_io.path(image_folder) if image_folder else self.path.parent
        self.name = self.path.name

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int):
        image, caption, line = self._rows[index]
        example_id = f"{self.name}:{line}"  # the file's line the row starts on
        if not caption or not caption.strip():
            return Skipped("caption_missing", example_id)
        if not image or not image.strip():
            return Skipped("image_missing", example_id, "the row has no image path")
        data = file_io.read_bytes(self.image_folder / image, example_id)
        if isinstance(data, Skipped):
            return data
        return {"_id": example_id, "image": data, "caption": caption.strip()}


# ----------------------------------------------------------------------------------------------
#                                    Hugging Face datasets parquet
# ----------------------------------------------------------------------------------------------
IMAGE_COLUMNS = ("image", "images", "jpg", "png", "img")
LARGE_GROUP = 10_000  # rows a row group may hold before reading at random is said to be slow
TEXT_COLUMNS = ("messages", "conversations", "texts", "caption", "text", "txt")


def _metadata(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as f:
            return f.metadata
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"input.parquet: {path} cannot be read as parquet ({err}).") from None


class ParquetSource:
    """Rows of local parquet files, a row group read at a time (the last few kept per thread).

    ``image_key``/``text_key``: the columns (default: the first present of ``IMAGE_COLUMNS`` and
    ``TEXT_COLUMNS``). An image cell is Hugging Face's ``{bytes, path}``, bytes, or a path (a string),
    or a list of them; a path is relative to the parquet file's folder; any other value is a
    ``bad_record`` naming the column and its type. A text column of strings is a ``caption``; of chat messages
    (``{"role", "content"}`` or LLaVA's ``{"from", "value"}``) or the_cauldron's ``texts``
    (``{"user", "assistant"}`` pairs) it is ``conversations``."""

    def __init__(self, files, image_key=None, text_key=None, cache_groups: int = 4):

        patterns = files.split("::") if isinstance(files, str) else list(files)
        self.files = [p for pattern in patterns for p in file_io.expand_pattern(pattern, "input.parquet")]
        metadata = [_metadata(f) for f in self.files]
        names = metadata[0].schema.to_arrow_schema().names
        self.image_key = image_key or next((c for c in IMAGE_COLUMNS if c in names), None)
        self.text_key = text_key or next((c for c in TEXT_COLUMNS if c in names), None)
        for f, meta in zip(self.files, metadata, strict=True):  # every file: a later one may lack a column
            has = meta.schema.to_arrow_schema().names
            if self.image_key not in has or self.text_key not in has:
                raise ValueError(f"{f} has columns {has}; set input.parquet_image_key and input.parquet_text_key "
                                 "(an image column and a text or messages column every file has).")
        self._groups = []  # (file, row group, first row)
        self._file_starts, start = [], 0
        for f, meta in enumerate(metadata):
            self._file_starts.append(start)
            for g in range(meta.num_row_groups):
                self._groups.append((f, g, start))
                start += meta.row_group(g).num_rows
        self._starts = np.array([s for _, _, s in self._groups] + [start])
        largest = int(np.diff(self._starts).max(initial=0))
        if largest > LARGE_GROUP:  # a shuffled read of one example reads its whole row group
            print(f"Warning: {self.files[0].name} and the rest hold row groups of up to {largest:,} rows; each example "
                  f"read at random reads its whole group: rewrite them with row_group_size=100 (Hugging Face's) for "
                  "speed.", flush=True)
        self._cache_groups = cache_groups
        self._local = threading.local()
        self.name = self.files[0].name

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self):  # picklable for worker processes: handles are opened where they are used
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state):
        self.__dict__.update(state, _local=threading.local())

    def _group(self, number: int) -> dict:
        """Row group ``number``'s two columns, from this thread's cache (a ``ParquetFile`` must not
        be read from two threads at once, so each thread opens its own)."""
        import pyarrow.parquet as pq

        cache = self._local.__dict__.setdefault("groups", collections.OrderedDict())
        if number not in cache:
            f, g, _ = self._groups[number]
            parquet = file_io.thread_handle(self._local, f, lambda: pq.ParquetFile(self.files[f]))
            table = parquet.read_row_group(g, columns=[self.image_key, self.text_key])
            cache[number] = {k: table.column(k) for k in (self.image_key, self.text_key)}  # Arrow: a row at a time
            while len(cache) > self._cache_groups:
                cache.popitem(last=False)
        cache.move_to_end(number)
        return cache[number]

    def __getitem__(self, index: int):
        number = int(np.searchsorted(self._starts, index, side="right") - 1)
        f, _, first = self._groups[number]
        row = index - first
        group = self._group(number)
        example_id = f"{self.files[f].name}:{index - self._file_starts[f]}"
        images, text = group[self.image_key][row].as_py(), group[self.text_key][row].as_py()
        images = images if isinstance(images, list) else [] if images is None else [images]
        loaded = []
        for image in images:
            if isinstance(image, str):  # a column of paths: read as the struct's path is
                image = {"path": image}
            if isinstance(image, dict):
                data = image.get("bytes")
                if not data and image.get("path"):
                    data = file_io.read_bytes(self.files[f].parent / image["path"], example_id)
                    if isinstance(data, Skipped):
                        return data
            else:
                data = image
            if data is not None and not isinstance(data, bytes):
                return Skipped("bad_record", example_id, f"column {self.image_key!r} holds {type(data).__name__}, not "
                               "image bytes, a path or {bytes, path} (relative paths: to the parquet's folder)")
            if not data:
                return Skipped("image_missing", example_id)
            loaded.append(data)
        example = {"_id": example_id}
        if isinstance(text, str):
            if not loaded:
                return Skipped("image_missing", example_id)
            if not text.strip():
                return Skipped("caption_missing", example_id)
            example.update(image=loaded[0], caption=text.strip())
            if len(loaded) > 1:
                return Skipped("too_many_images", example_id)
            return example
        conversations = as_conversations(text, len(loaded))
        if conversations is None:
            return Skipped("bad_record", example_id, f"column {self.text_key!r} is neither text nor messages")
        example.update(images=loaded, conversations=conversations)
        return example


def as_conversations(value, num_images: int = 0) -> list | None:
    """LLaVA's ``[{"from", "value"}]`` from chat messages or the_cauldron's ``texts``; the
    ``num_images`` images go at the start of the first user turn when no turn names one (the_cauldron's
    convention)."""
    turns = _turns(value)
    if turns and num_images and not any("<image>" in str(t["value"]) for t in turns):
        first = next((i for i, t in enumerate(turns) if t["from"] in ("human", "user")), None)
        if first is not None:
            turns[first] = dict(turns[first], value="<image>" * num_images + "\n" + turns[first]["value"])
    return turns


def _turns(value) -> list | None:
    if not isinstance(value, list):
        return None
    turns = []
    for item in value:
        if not isinstance(item, dict):
            return None
        if "from" in item and "value" in item:
            turns.append({"from": item["from"], "value": item["value"]})
        elif "role" in item and "content" in item:
            content = item["content"]
            if isinstance(content, list):  # [{"type": "image"} | {"type": "text", "text": ...}]
                content = "".join("<image>" if part.get("type") == "image" else part.get("text") or ""
                                  for part in content)
            turns.append({"from": item["role"], "value": content})
        elif "user" in item and "assistant" in item:
            turns += [{"from": "human", "value": item["user"]}, {"from": "gpt", "value": item["assistant"]}]
        else:
            return None
    return turns
