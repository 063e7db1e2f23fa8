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

Each reader family is a module of its own (``format_llava``, ``format_wds``, ``format_tables``;
``file_io`` for paths, image bytes and shard patterns); this one builds the sources a config names
and mixes them.
"""

from __future__ import annotations

import math

import numpy as np

from vitmm.data import file_io
from vitmm.data.format_llava import LlavaSource
from vitmm.data.format_tables import CsvSource, ParquetSource
from vitmm.data.format_wds import WdsSource

__all__ = ["LlavaSource", "WdsSource", "CsvSource", "ParquetSource", "raw_format", "source_from", "subsample"]


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
            k = math.ceil(n * float(amount[:-1]) / 100) if amount.endswith("%") else int(amount)  # (LLaVA-NeXT: ceil)
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
# The options of those sources (``source_from``): what else a raw ``input``, evaluator ``data`` or mixture entry reads.
RAW_OPTIONS = ("image_folder", "csv_img_key", "csv_caption_key", "csv_separator", "parquet_image_key",
               "parquet_text_key", "sampling")


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
    interleaved deterministically in those proportions (``Mixed``: every example of every source is
    read each pass, a source smaller than its share repeats)."""
    get = inp.get
    kind = raw_format(inp)
    if kind == "data_path" and str(get("data_path")).endswith((".yaml", ".yml")):
        return _mixture(llava_next_yaml(get("data_path"), get("image_folder")), seed)
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
    sampling_strategy}]``; relative paths from the YAML's folder, one image folder for all), with
    vitmm's optional ``weight`` per entry (all or none: interleaved in those proportions, as
    ``input.mixture``'s weights, which a command line cannot set)."""
    import yaml

    path = file_io.path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input.data_path={str(path)!r}: no such file (a LLaVA-NeXT YAML).")
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"input.data_path={str(path)!r} is not a readable YAML file ({cause}).") from None
    datasets = spec.get("datasets") if isinstance(spec, dict) else None
    if not isinstance(datasets, list) or not all(isinstance(d, dict) and d.get("json_path") for d in datasets):
        raise ValueError(f"{path}: a LLaVA-NeXT data YAML holds 'datasets:', a list of entries with json_path "
                         "(and optionally sampling_strategy).")
    return [dict(data_path=str(path.parent / file_io.path(d["json_path"])), image_folder=image_folder,
                 sampling=d.get("sampling_strategy") or "all", **({"weight": d["weight"]} if "weight" in d else {}))
            for d in datasets]


def _mixture(entries, seed: int):
    entries = [dict(e) for e in entries]
    for e in entries:
        unknown = set(e) - {*RAW_KEYS, *RAW_OPTIONS, "weight"} - {"mixture"}
        if unknown or e.get("mixture"):
            raise ValueError(f"input.mixture entry {e}: unknown key(s) {sorted(unknown) or ['mixture']}.")
    sources = [source_from(e, seed + i) for i, e in enumerate(entries)]
    weights = [e.get("weight") for e in entries]
    if all(w is None for w in weights):
        return Concat(sources)
    if any(w is None or w <= 0 for w in weights):
        raise ValueError(f"input.mixture weights {weights}: give every entry a positive weight, or none.")
    return Mixed(sources, [float(w) for w in weights])


class Mixed:
    """Sources interleaved in proportion to ``weights``, deterministically, as a plain sequence (it
    slices and shuffles like any source). A block of ``BLOCK`` positions gives each source its share
    of slots, spread evenly (largest remainder); source ``s``'s ``n``-th slot overall reads its
    example ``n mod len(s)``. The length runs to where the source with the most examples for its
    share has been read once, so every example of every source is read each pass (a smaller share
    repeats). grain's ``mix`` instead stops at the first source to run out: of a 100-example source
    mixed 1:1 with a 5-example one, it read the same 5 each pass."""

    BLOCK = 1000

    def __init__(self, sources: list, weights: list[float]):
        total = sum(weights)
        exact = [self.BLOCK * w / total for w in weights]
        slots = [int(x) for x in exact]
        for i in sorted(range(len(exact)), key=lambda i: slots[i] - exact[i])[: self.BLOCK - sum(slots)]:
            slots[i] += 1  # largest remainders
        if any(n == 0 for n in slots):
            raise ValueError(f"input.mixture weights {weights}: a share below 1/{self.BLOCK} of the mixture; "
                             "raise the smallest weight.")
        empty = [i for i, src in enumerate(sources) if len(src) == 0]
        if empty:
            raise ValueError(f"input.mixture entry {empty[0]} has no examples (after its sampling rule); drop it or "
                             "give it data.")
        self._sources, self._slots = sources, slots
        # where each source's slots fall in a block: evenly spread (its k-th slot near (k + 0.5) / n of it)
        order = sorted((((k + 0.5) / n, i, k) for i, n in enumerate(slots) for k in range(n)))
        self._pattern = [(i, k) for _, i, k in order]
        at = {ik: slot for slot, ik in enumerate(self._pattern)}
        # up to the position of the last example of the source that reaches its end last
        self._len = max((len(src) - 1) // n * self.BLOCK + at[(i, (len(src) - 1) % n)] + 1
                        for i, (src, n) in enumerate(zip(sources, slots, strict=True)))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int):
        block, slot = divmod(int(index), self.BLOCK)
        i, k = self._pattern[slot]
        source = self._sources[i]
        return source[(block * self._slots[i] + k) % len(source)]
