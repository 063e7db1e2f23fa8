"""Typed string arguments for config files: ``configs/x.py:variant=B/16,smoke``.

A config's ``get_config(arg)`` declares the few axes a sweep varies with their defaults;
``parse_arg`` turns the string after the colon into a locked ``ConfigDict`` of those types.
Everything else is overridden with ``--config.key=value`` (ml_collections, also locked).
"""

from __future__ import annotations

import ml_collections

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _cast(key: str, text: str, default):
    if isinstance(default, bool):
        lowered = text.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError(f"Config arg {key}={text!r} is not a boolean (use one of {_TRUE + _FALSE}).")
    if default is None or isinstance(default, str):
        return text
    try:
        return type(default)(text)
    except ValueError as err:
        kind = {int: "an integer", float: "a number"}.get(type(default), f"a {type(default).__name__}")
        raise ValueError(f"Config arg {key}={text!r} is not {kind} ({key}={default!r} by default).") from err


def _castable(text: str, default) -> bool:
    try:
        _cast("", text, default)
    except ValueError:
        return False
    return True


def _did_you_mean(name: str, names) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def suggest_keys(key: str, config) -> list[str]:
    """Existing dotted keys of ``config`` close to ``key``: the same last name anywhere
    (``lr`` → ``optim.lr``), or a close spelling (``optim.lrr`` → ``optim.lr``)."""
    import difflib

    from vitmm import tree

    keys = [k.replace("/", ".") for k in tree.flatten(config.to_dict() if hasattr(config, "to_dict") else config)]
    last = key.rsplit(".", 1)[-1]
    same_name = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    return list(dict.fromkeys(same_name + difflib.get_close_matches(key, keys, n=3, cutoff=0.75)))[:4]


def config_spec(argv) -> str | None:
    """``FILE[:ARGS]`` of ``--config`` in a command line, if given."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
        spec = argv[argv.index("--config") + 1]
    return spec


def unknown_override(argv, default: str | None = None, keys_are: str = "") -> str | None:
    """A message for the first ``--config.KEY=…`` of ``argv`` that the config file (``--config``'s, else
    ``default``) does not have, with the existing keys it most resembles, else where ``keys_are`` listed.
    None when every key exists or the file does not load (its own error says why)."""
    from vitmm import tree

    spec = config_spec(argv) or default
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    try:
        config = load(path, arg or None)
    except Exception:  # noqa: BLE001 - the file itself is the problem; the parser's message says so
        return None
    known = {k.replace("/", ".") for k in tree.flatten(config.to_dict())}
    for a in argv:
        if a.startswith("--config.") and "=" in a:
            key = a[len("--config."):].split("=", 1)[0]
            if key not in known and not any(k.startswith(key + ".") for k in known):
                close = suggest_keys(key, config)
                return f"unknown config key {key!r}" + (f"; did you mean {' or '.join(close)}?" if close else
                                                         f"; the keys are {keys_are}.")
    return None


def parse_arg(arg: str | None, presets: dict | None = None, **spec) -> ml_collections.ConfigDict:
    """Parses ``"k1=v1,k2,k3=v3"`` against ``spec`` (name → default, whose type is kept).

    A bare name sets a boolean to True (``smoke``); a single value without a name goes to the
    first key of ``spec``. Unknown names are an error listing the known ones. ``presets`` maps a
    boolean arg to the defaults it changes (``{"smoke": {"steps": 4}}``): a preset that is on sets
    those first and the args given explicitly win, so ``smoke,steps=-5`` means ``steps=-5`` (and is
    refused where steps are checked) rather than a silent 4.
    """
    given = {}
    for i, item in enumerate(filter(None, (arg or "").split(","))):
        if "=" in item:
            key, text = item.split("=", 1)
        elif item in spec and isinstance(spec[item], bool):
            key, text = item, "true"
        elif i == 0 and spec and _castable(item, next(iter(spec.values()))):
            key, text = next(iter(spec)), item  # a bare value for the first arg (configs/x.py:B/16)
        else:
            raise ValueError(f"Cannot parse config arg {item!r} in {arg!r}{_did_you_mean(item, spec)}; "
                             f"known args: {sorted(spec)} (name=value, or a boolean's bare name).")
        key = key.strip()
        if key not in spec:
            raise ValueError(f"Unknown config arg {key!r} in {arg!r}{_did_you_mean(key, spec)}; "
                             f"known args: {sorted(spec)}.")
        given[key] = _cast(key, text.strip(), spec[key])
    values = dict(spec)
    for name, defaults in (presets or {}).items():
        if name not in spec or not isinstance(spec[name], bool) or set(defaults) - set(spec):
            raise TypeError(f"preset {name!r} must be a boolean arg changing known args' defaults")
        if given.get(name, spec[name]):
            values.update(defaults)
    values.update(given)
    config = ml_collections.ConfigDict(values)
    config.lock()
    object.__setattr__(config, "_given", frozenset(given))  # not a key: what ``given`` reports
    return config


def given(arg: ml_collections.ConfigDict) -> frozenset:
    """The names ``parse_arg`` was given explicitly (a preset such as ``smoke`` must leave them)."""
    return getattr(arg, "_given", frozenset())


def load(path, arg: str | None = None, **overrides) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of the config file at ``path``, with dotted-key ``overrides`` applied
    (``{"optim.lr": 0.0}``); for scripts and tests (the command line uses ``--config.k=v``).
    Keys are checked as on the command line: an unknown one is an error naming it."""
    import importlib.util
    import pathlib

    path = pathlib.Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    for key, value in overrides.items():
        *parents, last = key.split(".")
        target = config
        for part in parents:
            target = target[part] if part in target else {}
        if not hasattr(target, "unlocked") or last not in target:
            close = suggest_keys(key, config)
            raise KeyError(f"Unknown config key {key!r} in {path.name}"
                           + (f"; did you mean {' or '.join(close)}?" if close else "."))
        with target.unlocked():
            target[last] = value
    return config
