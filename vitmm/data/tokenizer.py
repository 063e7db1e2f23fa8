"""Tokenizers: a byte-level one built in, a closed word vocabulary, and local Hugging Face
``tokenizer.json`` files.

Both share one contract: ``encode(text) -> list[int]`` without special tokens, ``decode``,
``bos_id``/``eos_id``/``pad_id``, ``eos_ids`` (every id that ends a generated answer, ``eos_id``
first) and ``vocab_size``. ``tokenize`` adds BOS/EOS, pads to a fixed
length and truncates explicitly, telling the caller whether it did.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
import re

import numpy as np

TRUNCATIONS = ("right", "error")
PADDINGS = ("pad", "eos")


class ByteTokenizer:
    """UTF-8 bytes as tokens. ``PAD = 0``, byte ``b`` is ``b + 1``, ``BOS = 257``, ``EOS = 258``.

    EOS has the largest id, so CLIP's ``argmax(ids)`` finds the end of text; padding with 0 keeps
    ``ids != pad_id`` a valid mask.
    """

    pad_id = 0
    bos_id = 257
    eos_id = 258
    eos_ids = (258,)
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        data = bytes(int(i) - 1 for i in ids if 1 <= int(i) <= 256)
        return data.decode("utf-8", errors="replace")


class WordTokenizer:
    """Whole words and punctuation marks of a fixed vocabulary as tokens: ``PAD = 0``,
    ``BOS = 1``, ``EOS = 2``, ``UNK = 3`` (any word not in the vocabulary), then the words.

    For closed-vocabulary synthetic text (the scenes questions and answers, ~60 words) where bytes
    would make every sequence four to five times longer. ``from_texts`` builds the vocabulary
    from a corpus, sorted, so the same corpus always gives the same ids. EOS is not the largest id:
    CLIP's ``argmax`` end-of-text pooling needs the byte tokenizer or an EOS-last vocabulary.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3
    eos_ids = (2,)
    _PIECE = re.compile(r"\w+|[^\w\s]")

    def __init__(self, words):
        words = list(words)
        clash = sorted(set(words) & set(self.SPECIALS))
        if clash or len(set(words)) != len(words):
            raise ValueError(f"WordTokenizer words must be unique and not special tokens; got duplicates "
                             f"or {clash}.")
        self.words = [*self.SPECIALS, *words]
        self._ids = {w: i for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words)

    @classmethod
    def from_texts(cls, texts) -> WordTokenizer:
        return cls(sorted({piece for text in texts for piece in cls._PIECE.findall(text)}))

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(piece, self.unk_id) for piece in self._PIECE.findall(text)]

    def decode(self, ids) -> str:
        pieces = [self.words[int(i)] for i in ids if int(i) > self.eos_id and int(i) < self.vocab_size]
        return re.sub(r" ([^\w\s])", r"\1", " ".join(pieces))


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` (``tokenizers`` package; nothing is downloaded).

    Special ids come from the arguments or, when not given, from the usual token names in the
    vocabulary (``<|startoftext|>``/``<|endoftext|>`` for CLIP, ``<s>``/``</s>``/``<pad>``…).
    ``eos_ids``: every id that ends a generated answer (an instruct LM's end of turn too), ``eos_id``
    first whether listed or not.
    """

    _BOS = ("<|startoftext|>", "<s>", "[CLS]", "<bos>")
    _EOS = ("<|endoftext|>", "</s>", "[SEP]", "<eos>")
    _PAD = ("<pad>", "[PAD]", "<|pad|>")

    def __init__(self, path: str | pathlib.Path, bos_id: int | None = None,
                 eos_id: int | None = None, pad_id: int | None = None, chat_template: str | None = None,
                 eos_ids: list[int] | None = None):
        from tokenizers import Tokenizer

        path = pathlib.Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"No tokenizer.json at {path}; pass the path of a local file "
                                    "(vitmm never downloads tokenizers).")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
            cause = " ".join(str(err).split())[:160] or type(err).__name__
            raise ValueError(f"{path} is not a tokenizer.json the tokenizers library reads ({cause}); pass the "
                             "tokenizer.json of a Hugging Face model folder.") from err
        # A tokenizer.json may carry truncation and padding (saved by enable_truncation/enable_padding);
        # transformers resets both on every call, and tokenize() cuts and pads explicitly.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id if bos_id is not None else self._find(self._BOS, "bos")
        self.eos_id = eos_id if eos_id is not None else self._find(self._EOS, "eos")
        self.eos_ids = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in eos_ids or ())]))
        # Without a pad token, pad with EOS (sticky EOS, as open_clip does for CLIP's BPE).
        self.pad_id = pad_id if pad_id is not None else self._find(self._PAD, "pad", self.eos_id)
        self.chat_template = chat_template

    def _find(self, names, what, default=None) -> int:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        if default is not None:
            return default
        raise ValueError(f"tokenizer.json has none of {names} for the {what} token; pass {what}_id=.")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str, keep: tuple[str, ...] = ()) -> tuple[list[int], list[tuple[int, int]]]:
        """``text`` tokenized at once, as ``encode`` does, with each token's character span in it, and
        each string of ``keep`` one token wherever it stands (as a VLM processor registers
        ``<image>``; its id may then be past ``vocab_size``). Tokenizing a whole rendering once is
        what transformers does: a SentencePiece tokenizer prepends ``▁`` to each string it is given,
        so pieces tokenized apart would not add up to it."""
        kept = self.__dict__.setdefault("_kept", {})
        if keep not in kept:
            from tokenizers import AddedToken, Tokenizer

            tok = Tokenizer.from_str(self._tok.to_str())
            tok.post_processor = None  # adds nothing without special tokens, but trims byte-level offsets
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in keep])
            kept[keep] = tok
        encoding = kept[keep].encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids) -> str:
        special = {self.bos_id, self.pad_id, *self.eos_ids}
        return self._tok.decode([int(i) for i in ids if int(i) not in special])

    def token(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary entry or an added token), None when there is none."""
        return self._tok.token_to_id(token)

    def to_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text."""
        return self._tok.to_str()

    def chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """``messages`` (``{"role", "content"}`` dicts) rendered by the LM's chat template. A template
        that shows no text given as a string (transformers' VLM templates: llava-hf's, SmolVLM's)
        gets each turn as parts, split at ``<image>`` (``content_parts``)."""
        if not self.chat_template:
            raise ValueError("This tokenizer has no chat template; convert an LM that has one "
                             "(`python -m vitmm.interop --from hf|gguf`) and use its tokenizer.")
        special = {"bos_token": self.token(self.bos_id), "eos_token": self.token(self.eos_id)}
        if not _takes_strings(self.chat_template, **special):
            messages = [{**m, "content": content_parts(m["content"])} if isinstance(m["content"], str) else m
                        for m in messages]
        return render_chat(self.chat_template, messages, add_generation_prompt, **special)


@functools.lru_cache(maxsize=16)
def _takes_strings(template: str, **special) -> bool:
    """Whether the chat template shows a turn's text given as one string (cached by the template, so
    a tokenizer given another template is probed again)."""
    probe = "vitmm probe 7f3a"
    try:
        shown = render_chat(template, [{"role": "user", "content": probe}], True, **special)
    except Exception:  # noqa: BLE001 - a template that fails on strings wants parts
        return False
    return probe in shown


def content_parts(text: str) -> list[dict]:
    """A turn's text as transformers' content parts: ``{"type": "image"}`` for each ``<image>``
    and ``{"type": "text", "text": …}`` for the text between, its whitespace next to an image
    dropped (a template puts its own space or newline there), in order."""
    pieces = text.split("<image>")
    parts = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
            piece = piece.lstrip()
        if i < len(pieces) - 1:
            piece = piece.rstrip()
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


TEMPLATE_DAY = datetime.date(2024, 7, 26)  # what a chat template's strftime_now formats (``_compiled``)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool, **variables) -> str:
    """A Jinja chat template rendered as transformers renders it (sandboxed, ``trim_blocks`` and
    ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` of one fixed day; ``tools`` and
    ``documents`` None unless given; ``variables`` such as ``bos_token``)."""
    variables = {"tools": None, "documents": None, **variables}
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """A template compiled once (rendering a conversation renders it once per assistant turn)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    class Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}…{% endgeneration %}`` (it marks an assistant turn's
        tokens): its body, rendered as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            return jinja2.nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True),
                                      lineno=lineno)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # transformers' (no escaping)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = tojson
    # strftime_now (Mistral-Small-3's template calls it unguarded) gives one fixed day, not transformers' today: a
    # run's text, hence its tokens, must be the same every day (a resume, a run crossing midnight) and a prompt at
    # inference must be the text the model trained on. The day is Llama 3's templates' own default, so those
    # render as they did when strftime_now was undefined.
    env.globals["strftime_now"] = lambda format: TEMPLATE_DAY.strftime(format)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def get_tokenizer(path: str | None = None, **special_ids):
    """The byte tokenizer, or the ``tokenizer.json`` at ``path``."""
    return HFTokenizer(path, **special_ids) if path else ByteTokenizer()


@dataclasses.dataclass(frozen=True)
class Tokenized:
    ids: np.ndarray  # int32 [max_len]
    length: int  # tokens before padding, specials included
    truncated: bool


def tokenize(tokenizer, text: str, max_len: int, *, add_bos: bool = True, add_eos: bool = True,
             padding: str = "pad", truncation: str = "right") -> Tokenized:
    """``text`` → fixed-length ids ``[BOS] tokens [EOS] PAD…``.

    ``truncation="right"`` cuts the text tokens so that BOS/EOS still fit (EOS stays the last
    real token, which EOT/last pooling relies on) and reports ``truncated=True``;
    ``"error"`` raises instead. ``padding="eos"`` pads with EOS ("sticky EOS", which SigLIP's
    ``last`` pooling relies on).
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"Unknown truncation={truncation!r}; choose one of {TRUNCATIONS}.")
    if padding not in PADDINGS:
        raise ValueError(f"Unknown padding={padding!r}; choose one of {PADDINGS}.")
    body = tokenizer.encode(text)
    room = max_len - int(add_bos) - int(add_eos)
    if room < 0:
        raise ValueError(f"max_len={max_len} leaves no room for BOS/EOS.")
    truncated = len(body) > room
    if truncated:
        if truncation == "error":
            raise ValueError(f"Text of {len(body)} tokens does not fit max_len={max_len} "
                             f"({room} after BOS/EOS): {text[:60]!r}…; raise max_len or use "
                             "truncation='right'.")
        body = body[:room]
    ids = ([tokenizer.bos_id] if add_bos else []) + body + ([tokenizer.eos_id] if add_eos else [])
    fill = tokenizer.pad_id if padding == "pad" else tokenizer.eos_id
    out = np.full(max_len, fill, np.int32)
    out[: len(ids)] = ids
    return Tokenized(out, len(ids), truncated)
