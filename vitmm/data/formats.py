"""Raw data as researchers have it, read as random-access sources for the grain pipeline.

* ``LlavaSource``: LLaVA-style conversations, a JSON list or JSONL of ``{"id", "image": path |
  [paths], "conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}`` with the images
  under ``image_folder`` (LLaVA's ``--data_path``/``--image_folder``); examples without ``image``
  are text-only.
* ``WdsSource``: webdataset tar shards in img2dataset's layout (``key.jpg|png|webp``, ``key.txt``,
  ``key.json``), named by brace patterns such as ``shards/{00000..00099}.tar``.
* ``CsvSource``: a CSV/TSV of image paths and captions (open_clip's ``--csv-img-key`` and
  ``--csv-caption-key``).
* ``ParquetSource``: Hugging Face datasets' parquet files (an image column of ``{"bytes", "path"}``
  structs or raw bytes, or a list of them; a text, caption or messages column), read with pyarrow.
* Mixtures: several sources, concatenated or interleaved by weight, each subsampled by
  LLaVA-NeXT's rules (``all``, ``first:N``, ``end:N``, ``random:N`` or ``random:P%``); a
  ``data_path`` ending in ``.yaml`` is LLaVA-NeXT's list of JSON files with those rules.

Each is a sequence of examples: every index returns a dict with ``_id`` and, depending on the
format, ``image`` (encoded bytes), ``images`` (a list of them), ``caption`` or ``conversations``;
an index whose example cannot be read returns ``skips.Skipped`` (reason and id) instead of
raising, so grain's shuffling, per-process slicing, epochs and exact resume work unchanged and
bad data is counted, not fatal. Decoding happens in the preprocessing (``decode``), in grain's
reader threads.
"""

from __future__ import annotations

import collections
import csv
import glob
import json
import os
import pathlib
import tarfile
import threading

import numpy as np

from vitmm.data.skips import Skipped

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


def _path(p) -> pathlib.Path:
    return pathlib.Path(os.path.expanduser(str(p)))


def _read_bytes(path: pathlib.Path, example_id: str) -> bytes | Skipped:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return Skipped("image_missing", example_id, str(path))
    except OSError as err:
        return Skipped("image_unreadable", example_id, f"{path}: {err}")


# ----------------------------------------------------------------------------------------------
#                                        LLaVA conversations
# ----------------------------------------------------------------------------------------------
class LlavaSource:
    """A LLaVA JSON list (or JSONL, one object a line) and its image folder (which holds the
    videos too: ``video`` is a file or a list of frame files, LLaVA-Video's layout)."""

    def __init__(self, data_path, image_folder=None):
        self.path = _path(data_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"input.data_path={str(data_path)!r}: no such file (a LLaVA JSON or JSONL).")
        self.image_folder = _path(image_folder) if image_folder else self.path.parent
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
        video = record.get("video")  # LLaVA-Video's: a file, or a list of frame files
        frames = [] if video is None else [video] if isinstance(video, str) else video
        if not isinstance(frames, list) or not all(isinstance(p, str) for p in frames):
            return Skipped("bad_record", example_id, f"'video' must be a path or a list of paths, got {video!r}")
        loaded = []
        for p in paths + frames:
            data = _read_bytes(self.image_folder / p, example_id)
            if isinstance(data, Skipped):
                return data
            loaded.append(data)
        out = {"_id": example_id, "images": loaded[: len(paths)], "conversations": record["conversations"]}
        if video is not None:
            out["video"] = loaded[len(paths)] if isinstance(video, str) else loaded[len(paths):]
        return out


def _load_json_records(path: pathlib.Path) -> list:
    """A JSON list, or JSONL (a line that is not JSON becomes a ``bad_record`` skip)."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); LLaVA data is a JSON list or JSONL.") from None
        return records
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            records.append(Skipped("bad_record", f"{path.name}:line{number}", str(err)))
    if not records:
        raise ValueError(f"{path} holds no examples.")
    return records


# ----------------------------------------------------------------------------------------------
#                                     webdataset tar shards
# ----------------------------------------------------------------------------------------------
def expand_pattern(pattern: str) -> list[pathlib.Path]:
    """Shard files of a brace pattern (``shards/{00000..00009}.tar``, ``{a,b}.tar``; several
    patterns joined by ``::`` as webdataset does); a pattern with ``*`` or ``?`` is globbed."""
    import braceexpand

    paths = []
    for part in pattern.split("::"):
        for name in braceexpand.braceexpand(os.path.expanduser(part)):
            if any(ch in name for ch in "*?["):
                paths.extend(pathlib.Path(p) for p in sorted(glob.glob(name)))
            else:
                paths.append(pathlib.Path(name))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing or not paths:
        what = f"{len(missing)} of {len(paths)} shards do not exist (first: {missing[0]})." if missing else \
            "no shards match."
        raise FileNotFoundError(f"input.wds={pattern!r}: {what}")
    return paths


def _split_key(name: str) -> tuple[str, str]:
    """webdataset's rule: the key is the path up to the first dot of the file name, the rest
    (lower-cased) is the field."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


class WdsSource:
    """Image–text pairs from tar shards: an index of every member's offset (headers only, read
    once), then each example read by seeking. A shard that ends inside a member keeps the
    examples before it; the cut one is skipped as ``shard_truncated``."""

    def __init__(self, pattern: str):
        self.pattern, self.shards = pattern, expand_pattern(pattern)
        self._index = []  # (shard number, key, {field: (offset, size)} or a skip reason)
        for number, shard in enumerate(self.shards):
            self._index.extend((number, key, fields) for key, fields in _index_shard(shard).items())
        self.name = pathlib.Path(pattern).name
        self._local = threading.local()

    def __len__(self) -> int:
        return len(self._index)

    def __getstate__(self):  # picklable for worker processes: handles are opened where they are used
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state):
        self.__dict__.update(state, _local=threading.local())

    def _file(self, number: int):
        files = self._local.__dict__.setdefault("files", {})
        if number not in files:
            files[number] = open(self.shards[number], "rb")  # noqa: SIM115 - one handle per thread and shard
        return files[number]

    def __getitem__(self, index: int):
        number, key, fields = self._index[index]
        example_id = f"{self.shards[number].name}/{key}"
        if isinstance(fields, str):
            return Skipped(fields, example_id)
        handle = self._file(number)

        def read(field):
            offset, size = fields[field]
            handle.seek(offset)
            return handle.read(size)

        image_field = _field(fields, IMAGE_EXTENSIONS)
        if image_field is None:
            return Skipped("image_missing", example_id, f"no {'/'.join(IMAGE_EXTENSIONS)} member")
        example = {"_id": example_id, "image": read(image_field)}
        meta, json_field, txt_field = {}, _field(fields, ("json",)), _field(fields, ("txt",))
        if json_field:
            try:
                meta = json.loads(read(json_field))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return Skipped("bad_record", example_id, "key.json is not JSON")
        caption = read(txt_field).decode("utf-8", errors="replace") if txt_field else meta.get("caption")
        if not isinstance(caption, str) or not caption.strip():
            return Skipped("caption_missing", example_id)
        example["caption"] = caption.strip()
        return example


def _field(fields: dict, extensions) -> str | None:
    """The member whose last extension is the first of ``extensions`` present (``jpg``, or
    ``seg.jpg`` where a key's files have several dots)."""
    for ext in extensions:
        for field in fields:
            if field.rpartition(".")[2] == ext:
                return field
    return None


def _index_shard(path: pathlib.Path) -> dict:
    """``{key: {field: (offset, size)}}`` in member order, or ``{key: "shard_truncated"}``."""
    size = path.stat().st_size
    index: dict = collections.OrderedDict()
    end = 0  # where the last member's data (padded to 512-byte blocks) ends
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                end = member.offset_data + -(-member.size // 512) * 512
                if not member.isfile():
                    continue
                key, field = _split_key(member.name)
                if key not in index:
                    index[key] = {}
                if member.offset_data + member.size > size:
                    index[key] = "shard_truncated"
                    return index
                if isinstance(index[key], dict):
                    index[key][field] = (member.offset_data, member.size)
    except tarfile.ReadError as err:
        if not index:
            raise ValueError(f"{path} is not a tar file ({err}).") from None
        end = size  # cut inside a header: the last key below is incomplete
    if index:
        # A complete archive ends with two zero blocks; without them the shard was cut after (or
        # inside) its last member, and the last key may lack some of its files.
        with open(path, "rb") as f:
            f.seek(end)
            tail = f.read(1024)
        if len(tail) < 1024 or tail.count(0) != 1024:
            index[next(reversed(index))] = "shard_truncated"
    return index


# ----------------------------------------------------------------------------------------------
#                                             CSV / TSV
# ----------------------------------------------------------------------------------------------
class CsvSource:
    """Rows of an image path and a caption; relative paths are under ``image_folder`` (default: the
    CSV's folder). The separator is a tab for ``.tsv`` and a comma otherwise unless given."""

    def __init__(self, path, img_key="filepath", caption_key="title", separator=None, image_folder=None):
        self.path = _path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"input.csv={str(path)!r}: no such file.")
        separator = separator or ("\t" if self.path.suffix.lower() == ".tsv" else ",")
        with open(self.path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter=separator)
            missing = [k for k in (img_key, caption_key) if k not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{self.path} has no column(s) {missing} (its columns: {reader.fieldnames}); set "
                                 "input.csv_img_key and input.csv_caption_key.")
            self._rows = [(row[img_key], row[caption_key]) for row in reader]
        self.image_folder = _path(image_folder) if image_folder else self.path.parent
        self.name = self.path.name

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int):
        image, caption = self._rows[index]
        example_id = f"{self.name}:{index + 2}"  # the file's line (after the header)
        if not caption or not caption.strip():
            return Skipped("caption_missing", example_id)
        data = _read_bytes(self.image_folder / image, example_id)
        if isinstance(data, Skipped):
            return data
        return {"_id": example_id, "image": data, "caption": caption.strip()}


# ----------------------------------------------------------------------------------------------
#                                    Hugging Face datasets parquet
# ----------------------------------------------------------------------------------------------
IMAGE_COLUMNS = ("image", "images", "jpg", "png", "img")
TEXT_COLUMNS = ("messages", "conversations", "texts", "caption", "text", "txt")


class ParquetSource:
    """Rows of local parquet files, a row group read at a time (the last few kept per thread).

    ``image_key``/``text_key``: the columns (default: the first present of ``IMAGE_COLUMNS`` and
    ``TEXT_COLUMNS``). A text column of strings is a ``caption``; of chat messages
    (``{"role", "content"}`` or LLaVA's ``{"from", "value"}``) or the_cauldron's ``texts``
    (``{"user", "assistant"}`` pairs) it is ``conversations``."""

    def __init__(self, files, image_key=None, text_key=None, cache_groups: int = 4):
        import pyarrow.parquet as pq

        patterns = files.split("::") if isinstance(files, str) else list(files)
        self.files = [p for pattern in patterns for p in expand_pattern(pattern)]
        metadata = [pq.ParquetFile(f).metadata for f in self.files]
        names = metadata[0].schema.to_arrow_schema().names
        self.image_key = image_key or next((c for c in IMAGE_COLUMNS if c in names), None)
        self.text_key = text_key or next((c for c in TEXT_COLUMNS if c in names), None)
        if self.image_key not in names or self.text_key not in names:
            raise ValueError(f"{self.files[0]} has columns {names}; set input.parquet_image_key and "
                             "input.parquet_text_key (an image column and a text or messages column).")
        self._groups = []  # (file, row group, first row)
        self._file_starts, start = [], 0
        for f, meta in enumerate(metadata):
            self._file_starts.append(start)
            for g in range(meta.num_row_groups):
                self._groups.append((f, g, start))
                start += meta.row_group(g).num_rows
        self._starts = np.array([s for _, _, s in self._groups] + [start])
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
            handles = self._local.__dict__.setdefault("files", {})
            if f not in handles:
                handles[f] = pq.ParquetFile(self.files[f])
            table = handles[f].read_row_group(g, columns=[self.image_key, self.text_key])
            cache[number] = {k: table.column(k).to_pylist() for k in (self.image_key, self.text_key)}
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
        images, text = group[self.image_key][row], group[self.text_key][row]
        images = images if isinstance(images, list) else [] if images is None else [images]
        loaded = []
        for image in images:
            data = image.get("bytes") if isinstance(image, dict) else image
            if not data and isinstance(image, dict) and image.get("path"):
                data = _read_bytes(self.files[f].parent / image["path"], example_id)
                if isinstance(data, Skipped):
                    return data
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
        conversations = _as_conversations(text)
        if conversations is None:
            return Skipped("bad_record", example_id, f"column {self.text_key!r} is neither text nor messages")
        example.update(images=loaded, conversations=conversations)
        return example


def _as_conversations(value) -> list | None:
    """LLaVA's ``[{"from", "value"}]`` from chat messages or the_cauldron's ``texts``; the image
    goes at the start of the first user turn when no turn names one (the_cauldron's convention)."""
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


# ----------------------------------------------------------------------------------------------
#                                             Mixtures
# ----------------------------------------------------------------------------------------------
def subsample(n: int, rule: str, seed: int = 0) -> np.ndarray:
    """The indices LLaVA-NeXT's ``sampling_strategy`` keeps of ``n``: ``all``, ``first:N``,
    ``end:N``, ``random:N`` or ``random:P%`` (a fixed random subset, sorted)."""
    kind, _, amount = rule.partition(":")
    if kind == "all" and not amount:
        return np.arange(n)
    if kind in ("first", "end", "random") and amount:
        try:
            k = round(n * float(amount[:-1]) / 100) if amount.endswith("%") else int(amount)
        except ValueError:
            k = -1
        if k >= 0:
            k = min(k, n)
            if kind == "first":
                return np.arange(k)
            if kind == "end":
                return np.arange(n - k, n)
            return np.sort(np.random.default_rng(seed).permutation(n)[:k])
    raise ValueError(f"sampling={rule!r}: use 'all', 'first:N', 'end:N', 'random:N' or 'random:P%'.")


class Subset:
    def __init__(self, source, indices: np.ndarray):
        self._source, self._indices = source, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int):
        return self._source[int(self._indices[index])]


class Concat:
    def __init__(self, sources):
        self._sources = list(sources)
        self._starts = np.cumsum([0] + [len(s) for s in self._sources])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int):
        k = int(np.searchsorted(self._starts, index, side="right") - 1)
        return self._sources[k][index - int(self._starts[k])]


# ----------------------------------------------------------------------------------------------
#                                         From the config
# ----------------------------------------------------------------------------------------------
RAW_KEYS = ("data_path", "wds", "csv", "parquet", "mixture")


def raw_format(inp) -> str | None:
    """Which raw format ``inp`` (the config's ``input`` or a mixture entry) names, if any."""
    named = [k for k in RAW_KEYS if inp.get(k)]
    if len(named) > 1:
        raise ValueError(f"input names {named}; set only one of {RAW_KEYS} (several sources go in input.mixture).")
    return named[0] if named else None


def source_from(inp, seed: int = 0):
    """The source a config's ``input`` (or one ``input.mixture`` entry) names.

    ``mixture``: a list of entries, each with one of ``data_path`` (+ ``image_folder``), ``wds``,
    ``csv``, ``parquet`` and optional ``sampling`` (LLaVA-NeXT's rule) and ``weight``. Without
    weights the sources are concatenated (LLaVA-NeXT); with a weight on every entry they are
    interleaved deterministically in those proportions (grain's ``mix``: a source smaller than its
    share repeats)."""
    get = inp.get
    kind = raw_format(inp)
    if kind == "data_path" and str(get("data_path")).endswith((".yaml", ".yml")):
        return Concat([source_from(e, seed + i) for i, e in enumerate(llava_next_yaml(get("data_path"),
                                                                                      get("image_folder")))])
    if kind == "data_path":
        source = LlavaSource(get("data_path"), get("image_folder"))
    elif kind == "wds":
        source = WdsSource(get("wds"))
    elif kind == "csv":
        source = CsvSource(get("csv"), get("csv_img_key") or "filepath", get("csv_caption_key") or "title",
                           get("csv_separator"), get("image_folder"))
    elif kind == "parquet":
        source = ParquetSource(get("parquet"), get("parquet_image_key"), get("parquet_text_key"))
    elif kind == "mixture":
        return _mixture(get("mixture"), seed)
    else:
        raise ValueError(f"input names no raw data: set one of {RAW_KEYS}.")
    if get("sampling") and get("sampling") != "all":
        source = Subset(source, subsample(len(source), get("sampling"), seed))
    return source


def llava_next_yaml(path, image_folder=None) -> list[dict]:
    """The mixture entries of LLaVA-NeXT's ``--data_path`` YAML (``datasets: [{json_path,
    sampling_strategy}]``; relative paths from the YAML's folder, one image folder for all)."""
    import yaml

    path = _path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input.data_path={str(path)!r}: no such file (a LLaVA-NeXT YAML).")
    spec = yaml.safe_load(path.read_text()) or {}
    datasets = spec.get("datasets") if isinstance(spec, dict) else None
    if not isinstance(datasets, list) or not all(isinstance(d, dict) and d.get("json_path") for d in datasets):
        raise ValueError(f"{path}: a LLaVA-NeXT data YAML holds 'datasets:', a list of entries with json_path "
                         "(and optionally sampling_strategy).")
    return [dict(data_path=str(path.parent / _path(d["json_path"])), image_folder=image_folder,
                 sampling=d.get("sampling_strategy") or "all") for d in datasets]


def _mixture(entries, seed: int):
    import grain

    entries = [dict(e) for e in entries]
    for e in entries:
        unknown = set(e) - {*RAW_KEYS, "image_folder", "csv_img_key", "csv_caption_key", "csv_separator",
                            "parquet_image_key", "parquet_text_key", "sampling", "weight"} - {"mixture"}
        if unknown or e.get("mixture"):
            raise ValueError(f"input.mixture entry {e}: unknown key(s) {sorted(unknown) or ['mixture']}.")
    sources = [source_from(e, seed + i) for i, e in enumerate(entries)]
    weights = [e.get("weight") for e in entries]
    if all(w is None for w in weights):
        return Concat(sources)
    if any(w is None or w <= 0 for w in weights):
        raise ValueError(f"input.mixture weights {weights}: give every entry a positive weight, or none.")
    mixed = grain.MapDataset.mix([grain.MapDataset.source(s) for s in sources], [float(w) for w in weights])
    return _MixedSource(mixed)


class _MixedSource:
    """grain's weighted interleave as a plain sequence (so it slices and shuffles like any source)."""

    def __init__(self, mixed):
        self._mixed = mixed

    def __len__(self) -> int:
        return len(self._mixed)

    def __getitem__(self, index: int):
        return self._mixed[index]
