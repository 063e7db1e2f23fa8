"""GGUF language models (llama.cpp's format) → vitmm ``LM``, its tokenizer and chat template.

    kwargs, params, tokenizer, chat_template = gguf_lm.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = LM(**kwargs).apply({"params": params}, ids)

Llama-architecture files (``general.architecture = llama``: Llama, SmolLM/SmolLM2, TinyLlama).
Tensors are dequantized to float32 with the ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1 and the K-quants it reads). llama.cpp's converter stores the rows of the Q and K
projections in its interleaved rotary order (per head, the two halves of each rotation pair
side by side); they are put back in Hugging Face's half-split order, which is vitmm's, so
attention is right — shapes alone would fit either way. The tokenizer is rebuilt from the
metadata as a ``tokenizers`` byte-level BPE (``tokenizer.ggml.model = gpt2``) with the control
tokens kept whole, as transformers' GGUF loading builds it; the ``tokenizer.chat_template``
string is returned as is. Parity with transformers' own GGUF loading is tested on a tiny file.
"""

from __future__ import annotations

import pathlib

import numpy as np

ARCHITECTURES = ("llama",)
TOKENIZERS = ("gpt2",)


def _reader(path):
    import gguf

    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (vitmm only reads local files; nothing is downloaded).")
    try:
        return path, gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - a file that is not GGUF, or cut short
        raise ValueError(f"{path} could not be read as GGUF ({type(err).__name__}: {err}).") from err


def read_metadata(path: str | pathlib.Path) -> tuple[dict, list[str]]:
    """``(metadata, tensor names)`` without dequantizing anything."""
    _, reader = _reader(path)
    return {name: field.contents() for name, field in reader.fields.items()}, [t.name for t in reader.tensors]


def read(path: str | pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(metadata, {name: float32 array})`` of a GGUF file, every tensor dequantized, in PyTorch's
    ``[out, in]`` order."""
    from gguf.quants import dequantize

    path, reader = _reader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        try:
            tensors[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as err:
            raise ValueError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                             f"dequantize ({err}); requantize the file to Q8_0, Q4_1 or F16.") from None
    return metadata, tensors


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
    head_dim = int(get("rope.dimension_count", width // heads))
    if head_dim * heads != width:
        raise ValueError(f"{src}: rope.dimension_count {head_dim} × {heads} heads ≠ width {width}; partial "
                         "rotary dimensions are not supported.")
    if get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{src}: RoPE scaling {get('rope.scaling.type')!r} is not supported.")
    return dict(vocab_size=len(metadata["tokenizer.ggml.tokens"]), width=width, depth=int(get("block_count")),
                num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
                mlp_dim=int(get("feed_forward_length")), rope_theta=float(get("rope.freq_base", 10_000.0)),
                norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), act="silu",
                tie_embeddings="output.weight" not in tensor_names)


def tokenizer(metadata: dict, src=None):
    """The ``tokenizers.Tokenizer`` the metadata describes (byte-level BPE), control tokens whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in TOKENIZERS:
        raise ValueError(f"{src}: tokenizer.ggml.model {kind!r} is not supported; vitmm builds {TOKENIZERS}.")
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError(f"{src}: a byte-level BPE vocabulary without tokenizer.ggml.merges cannot be rebuilt.")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == 3 and set(t) <= alphabet | set("<>|_")]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    return tok


def load(src: str | pathlib.Path):
    """``(LM kwargs, params, tokenizer, chat template or None)`` of a Llama-architecture GGUF."""
    import jax.numpy as jnp

    from vitmm.interop.common import StateDict, finish
    from vitmm.models.lm import LM

    metadata, tensors = read(src)
    kwargs = lm_kwargs(metadata, src, tuple(tensors))
    sd = StateDict(tensors, str(src))
    heads, kv = kwargs["num_heads"], kwargs["num_kv_heads"]
    linear = lambda name: {"kernel": sd.take(name).T}  # noqa: E731
    params = {"token_embedding": {"embedding": sd.take("token_embd.weight")},
              "final_norm": {"scale": sd.take("output_norm.weight")}}
    for i in range(kwargs["depth"]):
        b = f"blk.{i}"
        params[f"block_{i:02d}"] = {
            "attn_norm": {"scale": sd.take(f"{b}.attn_norm.weight")},
            "mlp_norm": {"scale": sd.take(f"{b}.ffn_norm.weight")},
            "attn": {"q": {"kernel": unpermute(sd.take(f"{b}.attn_q.weight"), heads).T},
                     "k": {"kernel": unpermute(sd.take(f"{b}.attn_k.weight"), kv).T},
                     "v": linear(f"{b}.attn_v.weight"), "o": linear(f"{b}.attn_output.weight")},
            "mlp": {"gate": linear(f"{b}.ffn_gate.weight"), "up": linear(f"{b}.ffn_up.weight"),
                    "down": linear(f"{b}.ffn_down.weight")}}
    if not kwargs["tie_embeddings"]:
        params["head"] = linear("output.weight")
    params = finish(sd, LM(**kwargs), params, (jnp.zeros((1, 4), jnp.int32),), "a vitmm LM (GGUF llama)")
    return kwargs, params, tokenizer(metadata, src), metadata.get("tokenizer.chat_template")
