"""Files of raw data: paths with ``~``, image bytes read or skipped with a reason, and shard
patterns (webdataset's braces, globs) expanded to the files they name."""

from __future__ import annotations

import collections
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
                found = sorted(glob.glob(name))
                if not found:  # one misspelled glob of several must not drop its files silently
                    raise FileNotFoundError(f"{key}={pattern!r}: {name!r} matches no file.")
                paths.extend(pathlib.Path(p) for p in found)
            else:
                paths.append(pathlib.Path(name))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing or not paths:
        what = f"{len(missing)} of {len(paths)} files do not exist (first: {missing[0]})." if missing else \
            "no files match."
        raise FileNotFoundError(f"{key}={pattern!r}: {what}")
    return paths


def _handles_per_thread() -> int:
    """A 64th of the process's open-file limit (16 under the common 1,024, hundreds where it is
    raised), at least 8: room for many reader threads, and few reopenings under a global shuffle."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(8, (soft if soft != resource.RLIM_INFINITY else 65536) // 64)


HANDLES_PER_THREAD = _handles_per_thread()


def thread_handle(local, key, opener, limit: int | None = None):
    """This thread's open handle for ``key`` (``opener()`` the first time), at most ``limit``
    (``HANDLES_PER_THREAD``) kept open per thread, the least recently used closed first: a reader
    of thousands of shards must not hold a file open for each."""
    handles = local.__dict__.setdefault("handles", collections.OrderedDict())
    if key not in handles:
        handles[key] = opener()
        while len(handles) > (limit or HANDLES_PER_THREAD):
            handles.popitem(last=False)[1].close()
    handles.move_to_end(key)
    return handles[key]
