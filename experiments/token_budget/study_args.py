"""The budget study's ``--set KEY=VALUE`` values and its saved settings (``study.py``).

A key under ``overrides``, ``test_overrides`` or ``tune.overrides`` is a ``vitmm.train``
``--config.*`` pass-through, so it may name a key that the study file does not set (e.g.
``overrides.model.max_len``); it is checked against the train config instead (``check``). Any
other key must be one of the study file's. A bad key is one line on stderr and exit 2, as
``python -m vitmm.train`` answers bad input.
"""

from __future__ import annotations

import json
import pathlib
import sys

import ml_collections

from vitmm import config_args

PASS_THROUGH = ("tune.overrides", "test_overrides", "overrides")  # the longest first


def fail(message: str):
    print(f"python -m experiments.token_budget: {message}", file=sys.stderr)
    sys.exit(2)


def _subtree(key: str) -> str | None:
    """The pass-through subtree ``key`` lies under, if any."""
    return next((p for p in PASS_THROUGH if key.startswith(p + ".")), None)


def apply(config, overrides: dict, name: str):
    """``config`` with the ``{dotted key: value}`` of ``--set`` applied: a key under a pass-through
    subtree may be new (its missing parents made), any other must exist."""
    for key, value in overrides.items():
        subtree = _subtree(key)
        depth = subtree.count(".") + 1 if subtree else None
        *parents, last = key.split(".")
        target = config
        for i, part in enumerate(parents):
            if not isinstance(target, ml_collections.ConfigDict):
                break
            if part not in target and depth is not None and i >= depth:
                with target.unlocked():
                    target[part] = ml_collections.ConfigDict()
            target = target[part] if part in target else None
        if not isinstance(target, ml_collections.ConfigDict) or (last not in target and subtree is None):
            close = config_args.suggest_keys(key, config)
            fail(f"unknown study key {key!r} in {name}" + (f"; did you mean {' or '.join(close)}?" if close else "")
                 + f" (new keys may go under {', '.join(PASS_THROUGH)} only)")
        try:
            with target.unlocked():
                target[last] = value
        except (TypeError, ValueError) as err:
            fail(f"--set {key}={value!r}: {err}")
    return config


def _leaves(tree, prefix: str = "") -> list[str]:
    """The dotted keys of a nested dict or ConfigDict, None values left out (as ``study.dotted``
    does: they are not passed to the trainer)."""
    tree = tree.to_dict() if hasattr(tree, "to_dict") else dict(tree)
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict):
            keys += _leaves(value, f"{prefix}{key}.")
        elif value is not None:
            keys.append(f"{prefix}{key}")
    return keys


def check(study, train_cfg, name: str) -> None:
    """Refuses a pass-through key that ``vitmm.train`` would refuse: one its config lacks."""
    for subtree in PASS_THROUGH:
        values = study
        for part in subtree.split("."):
            values = values[part]
        for key in _leaves(values):
            *parents, last = key.split(".")
            target = train_cfg
            for part in parents:
                target = target[part] if isinstance(target, ml_collections.ConfigDict) and part in target else None
            if not isinstance(target, ml_collections.ConfigDict) or last not in target:
                close = [f"{subtree}.{k}" for k in config_args.suggest_keys(key, train_cfg)]
                fail(f"{subtree}.{key} (in {name} or --set): {study.train_config} has no key {key!r}"
                     + (f"; did you mean {' or '.join(close)}?" if close else ""))


def saved(out: pathlib.Path, overrides: dict):
    """The study a finished sitting saved in ``OUT/setup.json`` (``--set`` values applied on top),
    or None where there is none."""
    path = out / "setup.json"
    if not path.is_file():
        return None
    study = ml_collections.ConfigDict(json.loads(path.read_text())["study"])
    print(f"the study's settings from {path}")
    return apply(study, overrides, str(path))
