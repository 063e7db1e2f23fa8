"""GGUF language models (llama.cpp's format) → vitmm ``LM``, its tokenizer and chat template.

    kwargs, params, tokenizer, chat_template = gguf_lm.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = LM(**kwargs).apply({"params": params}, ids)

Architectures (``general.architecture``): ``llama`` (Llama 3, SmolLM/SmolLM2), ``qwen2`` (q/k/v
biases), ``qwen3`` (per-head q/k norms, its ``attention.key_length`` head size), ``phi3`` (Phi-4;
fused q/k/v and gate/up, split; its sliding window) and ``gemma2`` (norms stored as 1 + w, read back
as Gemma's; the sub-layers' output norms, soft caps, a window on every other layer, the query scaled
by the head size as llama.cpp does for Gemma 2's 2B and 9B) and ``gemma3`` (its text model: Gemma
2's layout without soft caps, q/k norms, every sixth layer global, the others windowed with RoPE
base 10,000, as llama.cpp runs it) — but see below for which files of these load. Tensors are
dequantized to float32 with the ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and
the K-quants it reads). For ``llama`` llama.cpp's converter stores the rows of the Q and K
projections in its interleaved rotary order (per head, the two halves of each rotation pair side by
side); they are put back in Hugging Face's half-split order, which is vitmm's, so attention is right
— shapes alone would fit either way (Qwen's files keep the half-split order). Llama 3's RoPE
rescaling comes as llama.cpp writes it, a ``rope_freqs`` tensor of per-frequency factors
(``rope_scaling={"rope_type": "factors", ...}``; transformers' GGUF loading drops it, vitmm keeps
it: tested against the original checkpoint's logits); a ``linear`` ``rope.scaling.type`` (llama,
gemma3) divides the frequencies by ``rope.scaling.factor``, other types are refused. The tokenizer
is rebuilt from the metadata as a ``tokenizers`` byte-level BPE (``tokenizer.ggml.model = gpt2``) after the split its
``tokenizer.ggml.pre`` names (Llama 3's, Qwen2's or GPT-2's; another is refused), with the control
and user-defined tokens kept whole, as transformers' GGUF loading builds it; the
``tokenizer.chat_template`` string is returned as is. Parity with transformers' own GGUF loading is
tested on a tiny file.

Which files load: those with a ``gpt2`` vocabulary, which llama.cpp writes for Llama 3, SmolLM,
Qwen2/2.5/3 and Phi-4 (``phi3`` architecture), split by a rule vitmm rebuilds (``PRE_SPLITS``: Llama
3's, Qwen2's, GPT-2's). llama.cpp writes a SentencePiece vocabulary
(``tokenizer.ggml.model = llama``) for Gemma 2 and 3, Phi-3 and Llama-2-style models (TinyLlama,
Mistral); vitmm does not rebuild it, so those files are refused, from the metadata and before any
tensor is dequantized: convert their Hugging Face folders (``--from hf``). The ``gemma2``/``gemma3``
tensor layouts above are tested on files written with a ``gpt2`` vocabulary, which no llama.cpp
conversion of a Gemma has.
"""

from __future__ import annotations

import math
import mmap
import pathlib
import struct

import numpy as np

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
INTERLEAVED = ("llama",)  # the architectures whose Q/K rows llama.cpp stores in its rotary order
TOKENIZERS = ("gpt2",)
# How the text is split before the merges apply, by llama.cpp's ``tokenizer.ggml.pre`` name: the
# split each family's own tokenizer.json makes (Llama 3's is tiktoken's cl100k rule: digits in runs
# of at most three, a letter run taking one leading non-letter, contractions in any case; Qwen2's the
# same with single digits). GPT-2's byte-level rule for ``gpt-2``, ``smollm`` (whose vocabulary has no
# multi-digit tokens) and files that name none.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT,
              "smaug-bpe": LLAMA3_SPLIT, "falcon3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT,
              "deepseek-r1-qwen": QWEN2_SPLIT, "gpt-2": None, "smollm": None, "default": None}
NFC_PRE = ("qwen2", "deepseek-r1-qwen")  # Qwen2's tokenizer normalizes to NFC first (transformers' Qwen2Tokenizer)
_AGAIN = "download or copy it again"


class _Cut(Exception):
    """The file ends before what its header announces."""


class _Header:
    """A cursor over a GGUF file's header (github.com/ggml-org/ggml/blob/master/docs/gguf.md) that
    raises ``_Cut`` at the end of the file instead of reading past it."""

    SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by value type
    STRING, ARRAY, UINT32 = 8, 9, 4

    def __init__(self, buf, path):
        self.buf, self.path, self.pos, self.order = buf, path, 0, "<"

    def take(self, fmt: str) -> tuple:
        n = struct.calcsize(self.order + fmt)
        self.skip(n)
        return struct.unpack_from(self.order + fmt, self.buf, self.pos - n)

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Cut
        self.pos += n

    def string(self) -> bytes:
        (n,) = self.take("Q")
        self.skip(n)
        return bytes(self.buf[self.pos - n : self.pos])

    def skip_value(self, kind: int) -> None:
        if kind in self.SCALAR_BYTES:
            self.skip(self.SCALAR_BYTES[kind])
        elif kind == self.STRING:
            self.skip(self.take("Q")[0])
        elif kind == self.ARRAY:
            item, count = self.take("IQ")
            if item in self.SCALAR_BYTES:
                self.skip(count * self.SCALAR_BYTES[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"{self.path} is not a readable GGUF file: metadata value type {kind} at byte "
                             f"{self.pos:,} is not one GGUF has; {_AGAIN}.")


def _check_complete(path: pathlib.Path) -> None:
    """``ValueError`` in one line for a file cut short (an interrupted download or copy), before
    any reading: the header and tensor infos are walked and the end of the last tensor's data
    compared with the file's size (the gguf package would fail on a reshape deep in numpy)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes): truncated, not a GGUF file; {_AGAIN}.")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header, part, tensors = _Header(buf, path), "the magic number", []
        try:
            header.skip(4)
            if buf[:4] != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file: it starts with {buf[:4]!r}, not b'GGUF'.")
            part = "the version and counts"
            (version,) = header.take("I")
            if version & 0xFFFF == 0:  # written on a machine of the other byte order
                header.order = ">"
                (version,) = struct.unpack(">I", buf[4:8])
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported; the gguf package reads 2 and 3.")
            num_tensors, num_fields = header.take("QQ")
            part, alignment = "the metadata", 32
            for _ in range(num_fields):
                key, (kind,) = header.string(), header.take("I")
                if key == b"general.alignment" and kind == header.UINT32:
                    (alignment,) = header.take("I")
                else:
                    header.skip_value(kind)
            part = "the tensor infos"
            for _ in range(num_tensors):
                name = header.string().decode("utf-8", "replace")
                (ndim,) = header.take("I")
                shape = header.take(f"{ndim}Q")
                kind, offset = header.take("IQ")
                tensors.append((name, kind, offset, math.prod(shape)))
        except _Cut:
            raise ValueError(f"{path} is truncated or not a GGUF file: its {size:,} bytes end inside the header "
                             f"({part}); {_AGAIN}.") from None
    alignment = max(int(alignment), 1)
    start = -(-header.pos // alignment) * alignment  # the tensor data begins aligned after the header
    spans = []  # (first byte, end, name) of each tensor's data
    for name, kind, offset, count in tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has ggml type {kind}, which the gguf package does not know; "
                             "the file is corrupt or newer than the package.") from None
        spans.append((start + offset, start + offset + count * type_size // block, name))
    need = max((end for _, end, _ in spans), default=0)
    if need > size:
        name = min(span for span in spans if span[1] > size)[2]
        raise ValueError(f"{path} is truncated: it has {size:,} bytes but the {len(tensors)} tensors its header "
                         f"lists need {need:,} (tensor {name} runs past the end); {_AGAIN}.")


def _reader(path):
    import gguf

    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (vitmm only reads local files; nothing is downloaded).")
    _check_complete(path)
    try:
        return path, gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - a file that is not GGUF, or cut short
        raise ValueError(f"{path} could not be read as GGUF ({type(err).__name__}: {err}).") from err


def _metadata(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def read_metadata(path: str | pathlib.Path) -> tuple[dict, list[str]]:
    """``(metadata, tensor names)`` without dequantizing anything."""
    _, reader = _reader(path)
    return _metadata(reader), [t.name for t in reader.tensors]


def read(path: str | pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(metadata, {name: float32 array})`` of a GGUF file, every tensor dequantized, in PyTorch's
    ``[out, in]`` order."""
    path, reader = _reader(path)
    return _metadata(reader), _dequantize(path, reader)


def _dequantize(path: pathlib.Path, reader) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        try:
            tensors[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as err:
            raise ValueError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                             f"dequantize ({err}); requantize the file to Q8_0, Q4_1 or F16.") from None
    return tensors


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order → Hugging Face's (the inverse of its converter's ``permute``)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def lm_kwargs(metadata: dict, src, tensor_names=()) -> dict:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{src}: architecture {arch!r} is not supported; vitmm reads {ARCHITECTURES}.")
    get = lambda key, default=None: metadata.get(f"{arch}.{key}", default)  # noqa: E731
    for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        if get(key) is None:
            raise ValueError(f"{src}: the metadata has no {arch}.{key}; the file is incomplete.")
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{src} carries no tokenizer (tokenizer.ggml.tokens); vitmm needs the vocabulary.")
    width, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", width // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{src}: rope.dimension_count {get('rope.dimension_count')} ≠ the head size {head_dim}; "
                         "partial rotary dimensions are not supported.")
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none") and not (arch in ("llama", "gemma3") and scaling == "linear"):
        raise ValueError(f"{src}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported; vitmm reads "
                         "'linear' for llama and gemma3. To run it at its original context length, drop the key: "
                         f"gguf-new-metadata --remove-metadata {arch}.rope.scaling.type IN.gguf OUT.gguf (the gguf "
                         "package's script).")
    depth = int(get("block_count"))
    gemma = arch in ("gemma2", "gemma3")
    window = get("attention.sliding_window")
    extra = {"qk_norm": True} if arch in ("qwen3", "gemma3") else {}
    if window and arch in ("phi3", "gemma2", "gemma3"):
        extra["sliding_window"] = int(window)
    # Queries scaled by the head size, except in the 27B models (46 / 62 layers), scaled by width / heads
    # (llama.cpp's rule; transformers' query_pre_attn_scalar 144 and 168)
    query_scale = float(width // heads) if (arch, depth) in (("gemma2", 46), ("gemma3", 62)) else float(head_dim)
    if arch == "gemma2":  # llama.cpp's Gemma 2: a window on the even layers, soft caps
        extra.update(post_norms=True, window_layers=tuple(range(0, depth, 2)), query_scale=query_scale,
                     attn_softcap=get("attn_logit_softcapping"), logit_softcap=get("final_logit_softcapping"))
    if arch == "gemma3":  # every sixth layer global; the others windowed, RoPE base 10,000 (llama.cpp's)
        extra.update(post_norms=True, window_layers=tuple(i for i in range(depth) if (i + 1) % 6),
                     query_scale=query_scale, local_rope_theta=10_000.0)
    if scaling == "linear":  # llama.cpp divides each frequency by the factor (transformers' "linear")
        if not get("rope.scaling.factor"):
            raise ValueError(f"{src}: {arch}.rope.scaling.type is 'linear' but the metadata has no "
                             f"{arch}.rope.scaling.factor; the file is incomplete.")
        if "rope_freqs.weight" in tensor_names:
            raise ValueError(f"{src}: both a rope_freqs tensor and {arch}.rope.scaling.type 'linear'; vitmm "
                             "runs one RoPE rescaling or the other, not both.")
        extra["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return dict(vocab_size=len(metadata["tokenizer.ggml.tokens"]), width=width, depth=depth,
                num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
                head_dim=None if head_dim * heads == width else head_dim,
                mlp_dim=int(get("feed_forward_length")), rope_theta=float(get("rope.freq_base", 10_000.0)),
                norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), act="gelu_tanh" if gemma else "silu",
                tie_embeddings="output.weight" not in tensor_names, qkv_bias=arch == "qwen2",
                norm_offset=gemma, embed_scale=gemma, **extra)


def check_tokenizer(metadata: dict, src=None) -> None:
    """A ``ValueError`` for a vocabulary vitmm cannot rebuild: llama.cpp's SentencePiece one
    (``llama``), which its converter writes for Gemma (2, 3), Phi-3 and Llama-2-style models
    (TinyLlama, Mistral); those load from their Hugging Face folders."""
    kind = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if kind in TOKENIZERS and pre not in PRE_SPLITS:
        raise ValueError(f"{src}: tokenizer.ggml.pre {pre!r} (how the text is split before the merges) is not one "
                         f"vitmm rebuilds ({sorted(PRE_SPLITS)}); a wrong split gives other token ids without an "
                         "error. Convert the model's Hugging Face folder instead: python -m vitmm.interop --from hf "
                         "--src FOLDER.")
    if kind not in TOKENIZERS:
        spm = (" (SentencePiece, which llama.cpp writes for Gemma 2/3, Phi-3 and Llama-2-style models such as "
               "TinyLlama and Mistral)" if kind == "llama" else "")
        raise ValueError(f"{src}: tokenizer.ggml.model {kind!r}{spm} is not supported; vitmm rebuilds {TOKENIZERS} "
                         "(byte-level BPE: Llama 3, SmolLM, Qwen2/2.5/3). Convert the model's Hugging Face "
                         "folder instead: python -m vitmm.interop --from hf --src FOLDER.")


def tokenizer(metadata: dict, src=None):
    """The ``tokenizers.Tokenizer`` the metadata describes (byte-level BPE after the split its
    ``tokenizer.ggml.pre`` names: ``PRE_SPLITS``), control tokens whole and special, user-defined
    ones (Qwen3's ``<think>``) whole and not special, as llama.cpp and the model's own
    ``tokenizer.json`` match them. transformers' GGUF loading differs by design on one point: it
    drops control tokens spelled outside the byte alphabet as mislabels, so it splits
    DeepSeek-R1-Distill-Qwen's ``<｜begin▁of▁sentence｜>`` into bytes; vitmm keeps them whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    check_tokenizer(metadata, src)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]  # none: whole tokens
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if PRE_SPLITS[pre] is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    # Every control token, whatever its characters: llama.cpp writes added tokens as they read, not in the
    # byte alphabet (DeepSeek-R1-Distill-Qwen's <｜begin▁of▁sentence｜>), and matches each by its text, as the
    # model's own tokenizer.json does. Each is already in the vocabulary, so it takes no new id.
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == 3 and t]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == 4]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def load(src: str | pathlib.Path):
    """``(LM kwargs, params, tokenizer, chat template or None)`` of a GGUF of ``ARCHITECTURES``."""
    import jax.numpy as jnp

    from vitmm.interop.common import StateDict, finish
    from vitmm.models.lm import LM

    path, reader = _reader(src)
    metadata = _metadata(reader)
    # everything the metadata can refuse, before a tensor is dequantized (a 9B file is ~37 GB in float32)
    kwargs = lm_kwargs(metadata, src, tuple(t.name for t in reader.tensors))
    check_tokenizer(metadata, src)
    tensors = _dequantize(path, reader)
    sd = StateDict(tensors, str(src))
    if sd.has("rope_freqs.weight"):  # Llama 3's rescaling, one factor a frequency
        kwargs["rope_scaling"] = {"rope_type": "factors",
                                  "factors": tuple(float(f) for f in sd.take("rope_freqs.weight").reshape(-1))}
    heads, kv = kwargs["num_heads"], kwargs["num_kv_heads"]
    arch = metadata["general.architecture"]
    order = unpermute if arch in INTERLEAVED else (lambda w, heads: w)

    def linear(name, bias=False):
        out = {"kernel": sd.take(f"{name}.weight").T}
        if bias:
            out["bias"] = sd.take(f"{name}.bias")
        return out

    if arch in ("gemma2", "gemma3"):  # its norms were stored as 1 + w
        sd.tensors = {k: v - 1 if k.endswith("norm.weight") else v for k, v in sd.tensors.items()}
    params = {"token_embedding": {"embedding": sd.take("token_embd.weight")},
              "final_norm": {"scale": sd.take("output_norm.weight")}}
    for i in range(kwargs["depth"]):
        b = f"blk.{i}"
        if arch == "phi3":  # fused q/k/v and gate/up, as Phi-3's own checkpoints: one tensor each a role
            head_dim = kwargs["head_dim"] or kwargs["width"] // heads
            q, k, v = np.split(sd.take(f"{b}.attn_qkv.weight"), np.cumsum([heads * head_dim, kv * head_dim]))
            gate, up = np.split(sd.take(f"{b}.ffn_up.weight"), 2)
            sd.tensors.update({f"{b}.attn_q.weight": q, f"{b}.attn_k.weight": k, f"{b}.attn_v.weight": v,
                               f"{b}.ffn_gate.weight": gate, f"{b}.ffn_up.weight": up})
        bias = kwargs["qkv_bias"]
        attn = {"q": linear(f"{b}.attn_q", bias), "k": linear(f"{b}.attn_k", bias), "v": linear(f"{b}.attn_v", bias),
                "o": linear(f"{b}.attn_output")}
        for role, n in (("q", heads), ("k", kv)):  # rows (and biases) back in Hugging Face's rotary order
            attn[role] = {k: order(v.T, n).T if k == "kernel" else order(v, n) for k, v in attn[role].items()}
        if kwargs.get("qk_norm"):
            attn.update({f"{r}_norm": {"scale": sd.take(f"{b}.attn_{r}_norm.weight")} for r in "qk"})
        norms = {"attn_norm": "attn_norm", "mlp_norm": "ffn_norm"}
        if kwargs.get("post_norms"):
            norms.update(attn_post_norm="post_attention_norm", mlp_post_norm="post_ffw_norm")
        params[f"block_{i:02d}"] = {
            **{ours: {"scale": sd.take(f"{b}.{theirs}.weight")} for ours, theirs in norms.items()}, "attn": attn,
            "mlp": {"gate": linear(f"{b}.ffn_gate"), "up": linear(f"{b}.ffn_up"), "down": linear(f"{b}.ffn_down")}}
    if not kwargs["tie_embeddings"]:
        params["head"] = linear("output")
    params = finish(sd, LM(**kwargs), params, (jnp.zeros((1, 4), jnp.int32),), f"a vitmm LM (GGUF {arch})")
    return kwargs, params, tokenizer(metadata, src), metadata.get("tokenizer.chat_template")
