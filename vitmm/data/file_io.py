"""Files of raw data: paths with ``~``, image bytes read or skipped with a reason, and shard
patterns (webdataset's braces, globs) expanded to the files they name."""

from __future__ import annotations

import glob
import os
import pathlib

from vitmm.data.skips import Skipped

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


def path(p) -> pathlib.Path:
    return pathlib.Path(os.path.expanduser(str(p)))


def read_bytes(path: pathlib.Path, example_id: str) -> bytes | Skipped:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return Skipped("image_missing", example_id, str(path))
    except OSError as err:
        return Skipped("image_unreadable", example_id, f"{path}: {err}")


def expand_pattern(pattern: str, key: str = "input.wds") -> list[pathlib.Path]:
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
        what = f"{len(missing)} of {len(paths)} files do not exist (first: {missing[0]})." if missing else \
            "no files match."
        raise FileNotFoundError(f"{key}={pattern!r}: {what}")
    return paths
