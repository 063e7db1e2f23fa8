"""What a VLM run reads from its ``init.vision`` / ``init.lm`` folders besides their weights, pinned
into its workdir: ``W/sources/<vision|lm>/settings.json`` (the config that folder was saved with:
how the tower or LM is built, the images' normalisation, the special tokens and chat template) and
the LM's ``tokenizer.json``, written at the run's first start.

The weights come from those folders once, at step 0; everything after (a resume, ``vitmm.chat``,
``vitmm.serve``, ``vitmm.export``, an lmms-eval task) reads the settings here, so a run outlives
the folders it started from and a folder converted again in place cannot change a resumed run.
``config.init.pinned`` (where this process reads them, set by ``with_pinned``) is never saved.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil

from vitmm import checkpoint as ckpt_lib

FOLDERS = ("vision", "lm", "checkpoint")  # init.checkpoint: an imported VLM's settings and tokenizer
SETTINGS = ckpt_lib.PINNED_SETTINGS


def _folder(workdir, key: str) -> pathlib.Path:
    return pathlib.Path(workdir).expanduser() / "sources" / key


def pin(workdir, config, replace: bool = False) -> list[str]:
    """Writes ``W/sources/<key>/`` for each ``init.<key>`` the run names and the workdir does not hold
    yet, or (``replace``: a start with no checkpoint, whose weights were just read from the folders)
    holds from an earlier start; each folder appears whole (written aside, then renamed). Returns the
    keys pinned now."""
    pinned = []
    for key in FOLDERS:
        source, target = config.init.get(key), _folder(workdir, key)
        if replace:
            shutil.rmtree(target, ignore_errors=True)
        if not source or (target / SETTINGS).is_file():
            continue
        source = pathlib.Path(source).expanduser()
        try:
            settings = ckpt_lib.load_config(source)
        except (FileNotFoundError, ValueError):
            if key == "checkpoint":  # weights only (no saved config): nothing the run reads from it again
                continue
            raise
        tokenizer = _tokenizer(key, source, settings)
        tmp = target.with_name(f".{key}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / SETTINGS).write_text(json.dumps(settings, indent=1))
        if tokenizer.is_file():
            shutil.copy(tokenizer, tmp / "tokenizer.json")
        tmp.rename(target)
        pinned.append(key)
    return pinned


def _tokenizer(key: str, source: pathlib.Path, settings: dict) -> pathlib.Path:
    """The tokenizer ``pin`` copies from ``init.<key>`` = ``source`` saved with ``settings``, and
    ``changed_since_pinned`` compares with: for ``init.checkpoint`` (an imported VLM, or a run started
    from one) the file its config names, which step 0 used; else, or if that file is gone, the folder's."""
    named = settings.get("tokenizer") if key == "checkpoint" else None
    named = pathlib.Path(named).expanduser() if named else None
    return named if named is not None and named.is_file() else source / "tokenizer.json"


def with_pinned(config, workdir):
    """``config`` (a copy) reading its init folders' settings from ``W/sources`` where pinned there."""
    found = {key: str(_folder(workdir, key)) for key in FOLDERS if (_folder(workdir, key) / SETTINGS).is_file()}
    if not found:
        return config
    config = copy.deepcopy(config)
    with config.unlocked():
        config.init.pinned = found
    return config


def without_pinned(config):
    """``config`` as the run was given it: what checkpoints and ``config.json`` record."""
    if not config.get("init", {}).get("pinned"):
        return config
    config = copy.deepcopy(config)
    with config.unlocked():
        del config.init["pinned"]
    return config


def folder(config, key: str) -> str | None:
    """Where ``config`` reads the settings of ``init.<key>`` from: its pinned copy, else the folder."""
    return (config.get("init", {}).get("pinned") or {}).get(key) or config.get("init", {}).get(key)


def existing_folder(config, key: str) -> str | None:
    """``folder(config, key)``, refused in one line naming ``init.<key>`` when it is not there (moved or
    mistyped), before any of its files is looked for."""
    source = folder(config, key)
    if source and not pathlib.Path(source).expanduser().is_dir():
        raise FileNotFoundError(f"init.{key}={source} does not exist; the run reads its {key} settings (and at the "
                                f"start its weights) from that folder: restore it there, or pass "
                                f"--config.init.{key}=its new place.")
    return source


def tokenizer_file(config) -> str | None:
    """``config.tokenizer``; the pinned copy when it is the tokenizer of the imported VLM the run
    started from (``init.checkpoint``)."""
    path, pinned = config.get("tokenizer"), (config.get("init", {}).get("pinned") or {}).get("checkpoint")
    if path and pinned:
        named = json.loads((pathlib.Path(pinned) / SETTINGS).read_text()).get("tokenizer")
        if named == path and (pathlib.Path(pinned) / "tokenizer.json").is_file():
            return str(pathlib.Path(pinned) / "tokenizer.json")
    return path


def run_config(workdir, step: int | None = None):
    """The config a ``vitmm.train`` workdir (or ``vitmm.interop`` folder) was saved with, reading its
    init folders' settings from the copies pinned in it."""
    import ml_collections

    return with_pinned(ml_collections.ConfigDict(ckpt_lib.load_config(workdir, step)), workdir)


def changed_since_pinned(config) -> list[str]:
    """A line for each init folder whose saved settings now differ from the copy the run pinned (the
    run keeps its copy); a folder that is gone is no difference."""
    lines = []
    for key, pinned in (config.init.get("pinned") or {}).items():
        source = config.init.get(key)
        if not source or not pathlib.Path(source).expanduser().is_dir():
            continue
        try:
            now = ckpt_lib.load_config(source)
        except Exception:  # noqa: BLE001 - a folder that no longer reads is no difference to report
            continue
        kept = json.loads((pathlib.Path(pinned) / SETTINGS).read_text())
        tokenizers = [_tokenizer(key, pathlib.Path(source).expanduser(), now), pathlib.Path(pinned) / "tokenizer.json"]
        if now != kept or len({t.read_bytes() if t.is_file() else b"" for t in tokenizers}) > 1:
            lines.append(f"init.{key}={source} has changed since this run started; the run keeps the settings it "
                         f"started with ({pinned}).")
    return lines
