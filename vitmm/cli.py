"""What every command checks of the folder it will write, before it writes anything.

``new_output_folder(path)``: the folder a command creates (``--out``), refused in one line when it
is a file, when it already holds something (a new output never mixes into an old one), or when it
cannot be created there (a read-only disk, a file on the way, no permission).
"""

from __future__ import annotations

import os
import pathlib


def new_output_folder(path, flag: str = "--out", reusable=None) -> pathlib.Path:
    """``path`` (expanded, absolute) when a command may create it and write into it; otherwise
    ``FileExistsError`` (not empty) or ``ValueError`` (a file; not writable), naming ``flag``.
    ``reusable(names)``: True for a folder holding only what the command itself writes there
    (written again, e.g. another split beside the first)."""
    out = pathlib.Path(path).expanduser().absolute()
    if out.is_file():
        raise ValueError(f"{flag} {out} is a file; choose a folder.")
    if out.is_dir():
        names = {p.name for p in out.iterdir()}
        if names and not (reusable is not None and reusable(names)):
            raise FileExistsError(f"{flag} {out} is not empty; choose a new folder.")
        if not os.access(out, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {out}: cannot write there (permission denied); choose another folder.")
        return out
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {out}: cannot write there ({parent} is a file); choose another folder.")
    if not os.access(parent, os.W_OK | os.X_OK) or _read_only(parent):
        raise ValueError(f"{flag} {out}: cannot write there ({parent} is read-only); choose another folder.")
    return out


def _read_only(folder: pathlib.Path) -> bool:
    """A read-only file system (root ignores permissions, not ``ro`` mounts)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False
