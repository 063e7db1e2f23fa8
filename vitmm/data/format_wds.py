"""webdataset tar shards in img2dataset's layout (``key.jpg|png|webp``, ``key.txt``, ``key.json``),
indexed once and read by member offsets (``formats`` has the overview)."""

from __future__ import annotations

import collections
import json
import pathlib
import tarfile
import threading

from vitmm.data import file_io
from vitmm.data.skips import Skipped


def split_key(name: str) -> tuple[str, str]:
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
        self.pattern, self.shards = pattern, file_io.expand_pattern(pattern)
        self._index = []  # (shard number, key, {field: (offset, size)} or a skip reason)
        for number, shard in enumerate(self.shards):
            self._index.extend((number, key, fields) for key, fields in _index_shard(shard))
        self.name = pathlib.Path(pattern).name
        self._local = threading.local()

    def __len__(self) -> int:
        return len(self._index)

    def __getstate__(self):  # picklable for worker processes: handles are opened where they are used
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state):
        self.__dict__.update(state, _local=threading.local())

    def _file(self, number: int):
        return file_io.thread_handle(self._local, number, lambda: open(self.shards[number], "rb"))  # noqa: SIM115

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

        wanted = (file_io.IMAGE_EXTENSIONS, ("json",), ("txt",))
        image_field, json_field, txt_field = found = [_field(fields, exts) for exts in wanted]
        for field, exts in zip(found, wanted, strict=True):
            if isinstance(field, list):
                return Skipped("bad_record", example_id, f"members {', '.join(f'key.{f}' for f in field)} and no "
                               f"key.{'|'.join(exts)}: which one is meant is not clear")
        if image_field is None:
            return Skipped("image_missing", example_id, f"no {'/'.join(file_io.IMAGE_EXTENSIONS)} member")
        example = {"_id": example_id, "image": read(image_field)}
        meta = {}
        if json_field:
            try:
                meta = json.loads(read(json_field))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return Skipped("bad_record", example_id, "key.json is not JSON")
            if not isinstance(meta, dict):
                return Skipped("bad_record", example_id, "key.json is not a JSON object")
        try:  # (as open_clip's webdataset decoder: a caption that is not UTF-8 loses its example, counted)
            caption = read(txt_field).decode("utf-8") if txt_field else meta.get("caption")
        except UnicodeDecodeError as err:
            return Skipped("bad_record", example_id, f"key.{txt_field} is not UTF-8 text (byte {err.start}); "
                           "re-encode the captions as UTF-8")
        if not isinstance(caption, str) or not caption.strip():
            return Skipped("caption_missing", example_id)
        example["caption"] = caption.strip()
        return example


def _field(fields: dict, extensions) -> str | list | None:
    """The field of ``fields`` that ``extensions`` name, as webdataset matches fields (whole names:
    ``jpg`` is the image, ``depth.jpg`` another field): the first of ``extensions`` that is a field
    itself; else, for keys whose files all have several dots (``x.y.png``), the one field whose last
    extension is among them; several such fields and none exact (``depth.jpg`` and ``seg.png``) are
    ambiguous: the list of them, which the caller skips as a ``bad_record`` naming them."""
    exact = next((ext for ext in extensions if ext in fields), None)
    if exact is not None or not all("." in field for field in fields):
        return exact
    dotted = [field for field in fields if "." in field and field.rpartition(".")[2] in extensions]
    return dotted if len(dotted) > 1 else dotted[0] if dotted else None


def _index_shard(path: pathlib.Path) -> list[tuple[str, dict | str]]:
    """``[(name, {field: (offset, size)} or a skip reason)]``, an example each, in member order.
    Members group as webdataset's ``group_by_keys`` groups them: a new example starts where the key
    differs from the previous member's or the field is already in the current example, so a key
    repeated later in a shard (tars joined end to end) is another example, not an overwrite. Its
    ``name`` is the key, with ``#2``, ``#3``… on its later examples, so each example's id is unique
    and the same on every read. ``"shard_truncated"`` marks the example a cut shard ends in. Past a
    damaged header the reading goes on at the next whole one (tar files joined end to end too); the
    bytes it could not read count as one ``shard_unreadable`` example each stretch."""
    size = path.stat().st_size
    index: list = []  # [key, fields or a skip reason]
    end = 0  # where the last member's data (padded to 512-byte blocks) ends
    try:
        with tarfile.open(path, "r:", ignore_zeros=True) as tar, open(path, "rb") as raw:
            seen = False
            for member in tar:
                seen = True
                if member.offset > end and _damaged(raw, end, member.offset):
                    index.append([f"@{end}", "shard_unreadable"])  # skipped bytes that were neither padding nor headers
                end = member.offset_data + -(-member.size // 512) * 512
                if not member.isfile():
                    continue
                key, field = split_key(member.name)
                current = index[-1] if index else None
                if current is None or current[0] != key or not isinstance(current[1], dict) or field in current[1]:
                    current = [key, {}]
                    index.append(current)
                if member.offset_data + member.size > size:
                    current[1] = "shard_truncated"
                    return _named(index)
                current[1][field] = (member.offset_data, member.size)
            if not seen and _damaged(raw, 0, size):  # (read past every block: no header anywhere)
                raise tarfile.ReadError("no tar header in it")
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
            cut = _cut_header_key(tail)
            if cut is not None and cut != index[-1][0]:  # cut inside the next example's header: the last one is whole
                index.append([cut, "shard_truncated"])
            else:
                index[-1][1] = "shard_truncated"
    return _named(index)


def _named(index: list) -> list[tuple[str, dict | str]]:
    """``index`` with each key's later examples named ``key#2``, ``key#3``…"""
    count, used, named = collections.Counter(), set(), []
    for key, fields in index:
        name = key
        while name in used:  # (a key that itself ends in #2 takes the next free number)
            count[key] += 1
            name = f"{key}#{count[key] + 1}"
        used.add(name)
        named.append((name, fields))
    return named


def _damaged(f, start: int, stop: int) -> bool:
    """Whether the 512-byte blocks ``[start, stop)`` that tarfile passed over hold anything but
    zero blocks (an archive's end, joined tars) and whole headers with their data that are no
    member (a pax global header, as ``git archive`` writes)."""
    while start < stop:
        f.seek(start)
        block = f.read(512)
        if len(block) < 512:
            return block.count(0) != len(block)
        if block.count(0) == 512:
            start += 512
            continue
        try:
            header = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            return True
        start += 512 + -(-header.size // 512) * 512
    return False


def _cut_header_key(tail: bytes) -> str | None:
    """The key of the member whose header ``tail`` (the bytes after the last whole member) begins,
    when its name field (the header's first 100 bytes, NUL-padded) is there whole; else None."""
    name = tail[:100]
    if not tail or (len(name) < 100 and b"\0" not in name):
        return None
    name = name.split(b"\0", 1)[0]
    try:
        return split_key(name.decode("utf-8"))[0] if name else None
    except UnicodeDecodeError:
        return None
