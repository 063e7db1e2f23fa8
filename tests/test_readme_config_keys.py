"""README.md's "Config keys" table against the shipped training configs, mechanically (< 2 s: no JAX
program is built).

* Every key the table names exists in a shipped config (the key or a group it heads), or is one the
  code reads that no config sets (``READ_NOT_SET``, each checked to appear in ``vitmm/``).
* Every key a shipped config sets (at its default arg and ``smoke``) is named in the table: top-level
  keys and those of ``input``, ``optim``, ``init``, ``lora``, ``multihost``, ``model`` (its tower and
  LM dicts as groups: their constructors refuse a field they lack), the sub-dicts' fields and every
  evaluator's settings and ``data`` keys (named anywhere in the section), or in ``ALLOWED`` with a
  reason.
"""

import functools
import pathlib
import re

from vitmm import config_args, tree

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_TRAINING = ("__init__", "common", "frontend_demo")  # frontend_demo: vitmm.demo's config, its own args
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py") if p.stem not in NOT_TRAINING)

# Keys the code reads that no shipped config sets (so the table's row is not checked against one).
READ_NOT_SET = {"model.lm.mrope_section": "mrope_section", "evals.<name>.type": "type"}
# Keys shipped configs set that the table need not name, with the reason.
ALLOWED: dict = {}
# Groups whose fields the table leaves to the config ("see the config") and a constructor checks.
FIELD_GROUPS = ("model.image", "model.text", "model.vision", "model.lm", "model.connector", "model.anyres")
# Sub-dicts whose fields the table lists in the row's text rather than as keys of their own.
LISTED_FIELDS = ("input.data", "input.packing", "input.sequences", "input.scenes_any")


@functools.lru_cache(maxsize=1)
def section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("\n## Config keys\n", 1)[1].split("\n## ", 1)[0]


@functools.lru_cache(maxsize=1)
def table_keys() -> frozenset:
    """The backticked keys of each row's first cell; ``(+ `a`, `b`)`` and bare names after a dotted key
    take its group (``input.csv (+ `csv_img_key`)`` → ``input.csv_img_key``)."""
    keys = set()
    for row in section().splitlines():
        if not row.startswith("| `"):
            continue
        group = ""
        for name in re.findall(r"`([^`]+)`", row.split(" | ", 1)[0]):
            if "." in name:
                group = name.rsplit(".", 1)[0] if not name.startswith("evals.") else "evals.<name>"
                keys.add(name)
            else:
                keys.add(f"{group}.{name}" if group else name)
    return frozenset(keys)


@functools.lru_cache(maxsize=1)
def shipped() -> dict:
    """``{"configs/x.py:arg": {dotted key: value}}`` for every training config, default and smoke."""
    out = {}
    for path in CONFIGS:
        for arg in (None, "smoke") if "smoke" in path.read_text() else (None,):
            config = config_args.load(path, arg)
            out[f"{path.name}:{arg}"] = {k.replace("/", "."): v for k, v in tree.flatten(config.to_dict()).items()}
    return out


def all_keys() -> set:
    return {k for flat in shipped().values() for k in flat}


def test_the_table_parses():
    assert {"seed", "optim.lr", "input.csv_img_key", "multihost.process_id", "model.image.attn_impl"} <= table_keys()
    assert len(CONFIGS) >= 10 and len(shipped()) >= 2 * len(CONFIGS) - 2


def test_every_key_the_table_names_is_set_by_a_config_or_read_by_the_code():
    keys = all_keys()
    sources = "\n".join(p.read_text() for p in (ROOT / "vitmm").rglob("*.py"))
    missing = []
    for key in sorted(table_keys()):
        if key in READ_NOT_SET:
            assert re.search(rf"[\"'.]{READ_NOT_SET[key]}\b", sources), f"{key}: nothing in vitmm/ reads it"
            continue
        pattern = re.compile(re.escape(key).replace(re.escape("<name>"), r"[^.]+") + r"(\.|$)")
        if not any(pattern.match(k) for k in keys):
            missing.append(key)
    assert not missing, f"README's Config keys names keys no shipped config sets: {missing}"


def _named(key: str, keys: frozenset, text: str) -> bool:
    parts = key.split(".")
    if parts[0] == "evals":  # evals.<name>.SETTING[.data field...]: each named in the section (the raw-data
        return all(f"`{p}`" in text or f"input.{p}" in keys for p in parts[2:])  # keys as input's)
    for group in FIELD_GROUPS:
        if key.startswith(group + "."):
            return group in keys
    for group in LISTED_FIELDS:
        if key.startswith(group + "."):
            return group in keys or key in keys or f"`{parts[-1]}`" in text
    return key in keys


def test_every_key_a_shipped_config_sets_is_in_the_table():
    keys, text = table_keys(), section()
    unnamed = {}
    for config, flat in shipped().items():
        for key in flat:
            if key not in ALLOWED and not _named(key, keys, text):
                unnamed.setdefault(key, config)
    assert not unnamed, ("keys shipped configs set that README's Config keys does not name (add them to the table, "
                         f"or to ALLOWED with the reason): {unnamed}")


def test_allowed_keys_are_still_set():
    stale = sorted(set(ALLOWED) - all_keys())
    assert not stale, f"{stale} are allowed but no shipped config sets them: drop them from ALLOWED"


def test_evaluator_data_holds_only_what_the_readers_read():
    """An evaluator's ``data`` is read by ``pipeline.source_for`` and ``eval_embeddings.Embeddings``: a TFDS
    dataset (``split`` also for raw data, should the user point it at one), ``scenes_any``, or raw files.
    The training reader's own keys (``max_skipped_share``, ``workers``, ``device_normalize``) once sat
    there, copied with ``common.raw_input``, read by nothing."""
    from vitmm.data import formats

    read = {"name", "split", "data_dir", "keys", "pp", "captions", "scenes_any", *formats.RAW_KEYS,
            *formats.RAW_OPTIONS}
    unread = {f"{config}: {key}" for config, flat in shipped().items() for key in flat
              if key.startswith("evals.") and ".data." in key and key.split(".data.", 1)[1].split(".")[0] not in read}
    assert not unread, sorted(unread)
