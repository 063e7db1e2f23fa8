"""A decoder-only language model in the Llama family: vitmm's small from-scratch LM, and the shape
of the pretrained Llama / SmolLM2 / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma checkpoints
``vitmm.interop.hf_lm`` loads.

RMSNorm before each sub-layer, rotary positions (half-split pairing, as Hugging Face), a gated
MLP, a final RMSNorm and an output head. What the families differ in are fields:
``num_kv_heads`` (grouped-query attention), ``head_dim`` (Gemma's is not width/heads),
``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3), ``sliding_window`` (Mistral, Phi-3; Gemma 2 on
``window_layers``), ``post_norms``, ``query_scale``, ``attn_softcap``, ``logit_softcap`` (Gemma 2), ``rope_theta``
and ``rope_scaling`` (Llama 3's frequency rescaling; linear), ``local_rope_theta`` (Gemma 3: the window
layers' own RoPE base, unscaled; its q/k norms scale by 1 + w as its other norms), ``norm_eps``,
``norm_offset`` (Gemma's RMSNorm scales by 1 + w), ``embed_scale`` (Gemma multiplies embeddings by √width), ``act``
(``silu``; Gemma ``gelu_tanh``) and ``tie_embeddings`` (the head is the embedding matrix). Takes
token ids or ready-made input embeddings (the VLM passes visual tokens that way), an optional
padding mask and positions (a ragged batch), and a causal or prefix-LM mask.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from vitmm.models import common, layers, rope

ACTIVATIONS = ("silu", "gelu_tanh")


def attention_mask(length: int, prefix_len: jnp.ndarray | int | None = None) -> jnp.ndarray:
    """Boolean ``[B or 1, 1, T, T]``: causal, plus full attention inside the first ``prefix_len``
    positions when given (prefix-LM: image and prompt see each other both ways)."""
    i = jnp.arange(length)
    causal = i[:, None] >= i[None, :]
    if prefix_len is None:
        return causal[None, None]
    prefix_len = jnp.asarray(prefix_len).reshape(-1, 1, 1, 1)
    both_in_prefix = (i[None, None, :, None] < prefix_len) & (i[None, None, None, :] < prefix_len)
    return causal[None, None] | both_in_prefix


def segment_mask(segment_ids: jnp.ndarray, prefix_mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """Boolean ``[B, 1, T, T]`` for packed rows: a token sees the earlier tokens of its own segment
    (``segment_ids [B, T]``, one number per packed example, 0 on padding, which sees only padding),
    and with ``prefix_mask [B, T]`` (True on each example's prefix) the prefix tokens of its segment
    both ways: a prefix-LM per example."""
    segment_ids = jnp.asarray(segment_ids)
    i = jnp.arange(segment_ids.shape[1])
    mask = (i[:, None] >= i[None, :])[None]
    if prefix_mask is not None:
        prefix_mask = jnp.asarray(prefix_mask, bool)
        mask = mask | (prefix_mask[:, :, None] & prefix_mask[:, None, :])
    return (mask & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]


class RMSNorm(nn.Module):
    """``x / rms(x) · w`` in float32 (``offset=True``: ``· (1 + w)`` with ``w`` starting at 0, Gemma)."""

    eps: float = 1e-6
    offset: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        return (y * (scale + 1.0 if self.offset else scale)).astype(x.dtype)


class SwiGLU(nn.Module):
    """``down(act(gate(x)) · up(x))``, bias-free; output width ``out_dim`` (default: the input's)."""

    mlp_dim: int
    dtype_mm: str = "float32"
    out_dim: int | None = None
    act: str = "silu"

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: layers.Dense(n, use_bias=False, dtype=self.dtype_mm,  # noqa: E731
                                             kernel_init=common.trunc_normal(0.02), name=name)
        act = nn.silu if self.act == "silu" else (lambda y: jax.nn.gelu(y, approximate=True))
        hidden = act(dense(self.mlp_dim, "gate")(x)) * dense(self.mlp_dim, "up")(x)
        return dense(self.out_dim or x.shape[-1], "down")(hidden)


def attend(q, k, v, mask, scale: float | None = None, softcap: float | None = None, implementation=None):
    """Softmax attention of ``q [B, T, H, d]`` over ``k, v [B, S, KV, d]`` (grouped-query heads)
    under ``mask [B|1, 1, T, S]``, scores scaled by ``scale`` (default ``d^-1/2``); ``softcap``
    (Gemma 2): the scores become ``cap · tanh(scores / cap)`` before the mask. ``implementation``:
    ``jax.nn.dot_product_attention``'s (None: XLA's, which holds every score; ``"cudnn"``: cuDNN's
    fused kernel on a GPU, which holds none: bfloat16 or float16 inputs, no ``softcap``)."""
    if softcap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
    if implementation == "cudnn":
        raise ValueError("attn_impl='cudnn' has no soft-capped scores (Gemma 2's attn_softcap); leave attn_impl "
                         "unset for this LM.")
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * (scale or q.shape[-1] ** -0.5)
    scores = softcap * jnp.tanh(scores / softcap)
    weights = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", weights, v)


class LMAttention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections, grouped-query heads and RoPE."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    dtype_mm: str = "float32"
    qk_norm: float | None = None  # Qwen3: RMSNorm of each head's queries and keys (this eps) before RoPE
    scale: float | None = None  # the scores' scale (default head_dim^-1/2; Gemma 2: query_pre_attn_scalar^-1/2)
    softcap: float | None = None  # Gemma 2: cap · tanh(scores / cap)
    norm_offset: bool = False  # Gemma 3's q/k norms scale by 1 + w
    attn_impl: str | None = None  # jax.nn.dot_product_attention's implementation for training (see attend)

    @nn.compact
    def __call__(self, x, angles, mask, cache=None):
        """With ``cache = (k, v, slot)`` (``[B, S, kv_heads, hd]`` each, and the slot the first
        of these ``T`` tokens goes to), the new keys and values are written there and the
        queries attend over the whole cache; returns ``(out, (k, v))``."""
        b, t, width = x.shape
        dense = lambda n, bias, name: layers.Dense(n, use_bias=bias, dtype=self.dtype_mm, name=name,  # noqa: E731
                                                   kernel_init=common.trunc_normal(0.02))
        q = dense(self.num_heads * self.head_dim, self.qkv_bias, "q")(x).reshape(b, t, self.num_heads, self.head_dim)
        k = dense(self.num_kv_heads * self.head_dim, self.qkv_bias, "k")(x).reshape(b, t, self.num_kv_heads,
                                                                                   self.head_dim)
        v = dense(self.num_kv_heads * self.head_dim, self.qkv_bias, "v")(x).reshape(b, t, self.num_kv_heads,
                                                                                   self.head_dim)
        if self.qk_norm is not None:
            q = RMSNorm(self.qk_norm, self.norm_offset, name="q_norm")(q)
            k = RMSNorm(self.qk_norm, self.norm_offset, name="k_norm")(k)
        q, k = rope.rotate(q, angles), rope.rotate(k, angles)
        if cache is not None:
            k_cache, v_cache, slot = cache
            k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, slot, 0, 0))
            v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, slot, 0, 0))
        dtype = jnp.dtype(self.dtype_mm)
        impl = self.attn_impl if cache is None else None  # decoding: one query a step, XLA's attention
        out = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype), mask, self.scale, self.softcap, impl)
        out = dense(width, False, "o")(out.reshape(b, t, self.num_heads * self.head_dim))
        return out if cache is None else (out, (k, v))


class LMBlock(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    norm_eps: float = 1e-6
    norm_offset: bool = False
    qkv_bias: bool = False
    act: str = "silu"
    dtype_mm: str = "float32"
    qk_norm: bool = False
    post_norms: bool = False  # Gemma 2: each sub-layer's output normalised too, before the residual add
    scale: float | None = None
    softcap: float | None = None
    attn_impl: str | None = None

    @nn.compact
    def __call__(self, x, angles, mask, cache=None):
        norm = lambda name: RMSNorm(self.norm_eps, self.norm_offset, name=name)  # noqa: E731
        attn = LMAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_bias, self.dtype_mm,
                           self.norm_eps if self.qk_norm else None, self.scale, self.softcap, self.norm_offset,
                           self.attn_impl, name="attn")(norm("attn_norm")(x), angles, mask, cache)
        attn, kv = (attn, None) if cache is None else attn
        x = x + (norm("attn_post_norm")(attn) if self.post_norms else attn)
        y = SwiGLU(self.mlp_dim, self.dtype_mm, act=self.act, name="mlp")(norm("mlp_norm")(x))
        x = x + (norm("mlp_post_norm")(y) if self.post_norms else y)
        return x if cache is None else (x, kv)


class LM(nn.Module):
    """``__call__(ids=None, embeds=None, prefix_len=None, pad_mask=None, positions=None) ->
    logits [B, T, vocab]`` (float32).

    ``pad_mask [B, T]`` (True: a real token) keeps padding out of every attention;
    ``positions [B, T]`` are the RoPE positions (default ``0 … T-1``; for left padding pass the
    count of real tokens before each one); with ``mrope_section`` (Qwen2-VL's multimodal RoPE,
    e.g. ``(16, 24, 24)``) they may be ``[3, B, T]`` (``mrope_positions``). ``embed(ids)`` gives
    the input embeddings, so a caller can splice other tokens in. ``segment_ids [B, T]`` packs
    several sequences in a row (``segment_mask``; pass their own ``positions``, restarting at each).
    """

    vocab_size: int = 259
    width: int = 256
    depth: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # default: num_heads
    head_dim: int | None = None  # default: width // num_heads
    mlp_dim: int | None = None  # default: 8/3 width, rounded down to a multiple of 8
    qkv_bias: bool = False
    rope_theta: float = 10_000.0
    rope_scaling: dict | None = None
    mrope_section: tuple[int, int, int] | None = None
    norm_eps: float = 1e-6
    norm_offset: bool = False
    embed_scale: bool = False
    act: str = "silu"
    tie_embeddings: bool = False
    dtype_mm: str = "float32"
    qk_norm: bool = False  # Qwen3: each head's queries and keys RMS-normalised before RoPE
    sliding_window: int | None = None  # Mistral, Phi-3: a query sees the last N real tokens only (itself included)
    window_layers: tuple[int, ...] | None = None  # the layers with the window (None: all; Gemma 2: every other)
    post_norms: bool = False  # Gemma 2: attention and MLP outputs normalised before their residual adds
    query_scale: float | None = None  # Gemma 2's query_pre_attn_scalar: scores scaled by its ^-1/2
    attn_softcap: float | None = None  # Gemma 2: attention scores capped as cap · tanh(s / cap)
    logit_softcap: float | None = None  # Gemma 2: the output logits capped the same way
    local_rope_theta: float | None = None  # Gemma 3: the window layers' RoPE base (rope_scaling not applied)
    attn_impl: str | None = None  # training's attention: None (XLA) or "cudnn" (fused, a GPU's; see attend)
    remat_policy: str | None = "none"  # a jax.checkpoint_policies name: each block's activations recomputed in the
    # backward pass (None: "none")

    def setup(self):
        common.check_choice("act", self.act, ACTIVATIONS)
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={kv}.")
        if self.attn_impl not in (None, "xla", "cudnn"):
            raise ValueError(f"attn_impl={self.attn_impl!r}: the LM's attention is None (XLA), 'xla' or 'cudnn'.")
        if self.head_dim is None and self.width % self.num_heads:
            raise ValueError(f"width={self.width} is not divisible by num_heads={self.num_heads}; set head_dim.")
        self.token_embedding = nn.Embed(self.vocab_size, self.width, embedding_init=common.trunc_normal(0.02))
        block = LMBlock
        if self.remat_policy not in (None, "none"):  # checkpointing: what the policy does not save is recomputed
            if not hasattr(jax.checkpoint_policies, self.remat_policy):
                raise ValueError(f"remat_policy={self.remat_policy!r}: 'none' or a name in jax.checkpoint_policies, "
                                 "e.g. 'nothing_saveable'.")
            block = nn.remat(LMBlock, policy=getattr(jax.checkpoint_policies, self.remat_policy))
        self.blocks = [block(self.num_heads, kv, self.attn_head_dim, self.mlp_dim or int(8 * self.width / 3) // 8 * 8,
                             self.norm_eps, self.norm_offset, self.qkv_bias, self.act, self.dtype_mm,
                             self.qk_norm, self.post_norms, self.query_scale and self.query_scale ** -0.5,
                             self.attn_softcap, self.attn_impl, name=f"block_{i:02d}") for i in range(self.depth)]
        self.final_norm = RMSNorm(self.norm_eps, self.norm_offset)
        if not self.tie_embeddings:
            self.head = layers.Dense(self.vocab_size, use_bias=False, kernel_init=common.trunc_normal(0.02))

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.width // self.num_heads

    def embed(self, ids: jnp.ndarray) -> jnp.ndarray:
        x = self.token_embedding(ids)
        if self.embed_scale:  # Gemma: √width, rounded to the activations' dtype as Hugging Face does
            x = x * jnp.asarray(math.sqrt(self.width), x.dtype)
        return x

    def __call__(self, ids: jnp.ndarray | None = None, embeds: jnp.ndarray | None = None, prefix_len=None,
                 pad_mask: jnp.ndarray | None = None, positions: jnp.ndarray | None = None, cache: dict | None = None,
                 logits_at: jnp.ndarray | None = None, segment_ids: jnp.ndarray | None = None,
                 prefix_mask: jnp.ndarray | None = None, hidden: bool = False):
        """Logits ``[B, T, vocab]``; with ``cache`` (``init_cache``), ``(logits, cache)``: the ``T``
        new tokens are written at ``cache["slot"]`` onward and attend to every valid earlier slot
        (``positions`` default to those slots; tokens past the cache's end are an error, NaN logits
        under ``jit``).
        ``logits_at [B, K]`` (positions in ``0 … T-1`` of the new tokens): the head runs at those
        positions only and the logits are ``[B, K, vocab]`` (a loss on a few tokens of a large
        vocabulary, or a prefill that needs each prompt's last position). ``segment_ids`` and
        ``prefix_mask``: packed rows (``segment_mask``), without ``prefix_len`` or ``cache``.
        ``hidden``: the final-normed states ``[B, T, D]`` instead, for ``logits`` to turn into
        logits a chunk at a time (``losses.chunked_lm_loss``)."""
        if (ids is None) == (embeds is None):
            raise ValueError("Pass exactly one of ids [B, T] or embeds [B, T, D].")
        if cache is not None:
            _check_room(cache, (ids if embeds is None else embeds).shape[1])
        x = self.embed(ids) if embeds is None else embeds
        b, t = x.shape[:2]
        if positions is None:  # the tokens' slots: after the cache's earlier ones when decoding
            positions = jnp.arange(t)[None] + (0 if cache is None else cache["slot"])
        if self.mrope_section is not None:
            angles = rope.mrope_angles(positions, self.attn_head_dim, self.mrope_section, self.rope_theta,
                                       self.rope_scaling)
        else:
            angles = rope.rope_angles(positions, self.attn_head_dim, self.rope_theta, self.rope_scaling)
        local = angles if self.local_rope_theta is None else rope.rope_angles(positions, self.attn_head_dim,
                                                                         self.local_rope_theta)
        new_valid = jnp.ones((b, t), bool) if pad_mask is None else pad_mask.astype(bool)
        if segment_ids is not None:
            if cache is not None or prefix_len is not None:
                raise ValueError("segment_ids (packed rows) take prefix_mask, not prefix_len, and no cache.")
            mask = segment_mask(segment_ids, prefix_mask) & new_valid[:, None, None, :]
        elif cache is None:
            mask = attention_mask(t, prefix_len) & new_valid[:, None, None, :]
        else:  # a key slot is visible if it holds a real token at or before the query's slot (or in the prefix)
            slot = cache["slot"]
            valid = jax.lax.dynamic_update_slice(cache["valid"], new_valid, (0, slot))
            slots = jnp.arange(valid.shape[1])[None, None, None, :]
            mask = slots <= (slot + jnp.arange(t))[None, None, :, None]
            if prefix_len is not None:
                mask = mask | (slots < jnp.reshape(jnp.asarray(prefix_len), (-1, 1, 1, 1)))
            mask = mask & valid[:, None, None, :]
        windowed = mask
        if self.sliding_window:  # by token: the real tokens between query and key, not the slots (a right-padded
            # prompt leaves a gap of empty cache slots before the first generated token)
            index = jnp.cumsum(new_valid if cache is None else valid, axis=1) - 1  # [B, S]
            query = index if cache is None else jax.lax.dynamic_slice_in_dim(index, cache["slot"], t, axis=1)
            windowed = mask & (query[:, :, None] - index[:, None, :] < self.sliding_window)[:, None]
        layers_kv = []
        for i, block in enumerate(self.blocks):
            in_window = self.window_layers is None or i in self.window_layers
            layer_mask, layer_angles = (windowed, local) if in_window else (mask, angles)
            if cache is None:
                x = block(x, layer_angles, layer_mask)
            else:
                x, kv = block(x, layer_angles, layer_mask, (cache["k"][i], cache["v"][i], cache["slot"]))
                layers_kv.append(kv)
        if logits_at is not None:
            x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[..., None], 1)
        x = self.final_norm(x)
        if hidden and cache is None:
            return x
        logits = self.logits(x)
        if cache is None:
            return logits
        # Past the cache's end dynamic_update_slice would write the new keys over its last slots: no
        # error under jit, only wrong logits, so they are NaN there instead (outside jit: _check_room).
        logits = jnp.where(cache["slot"] + t > cache["valid"].shape[1], jnp.nan, logits)
        return logits, {"k": [kv[0] for kv in layers_kv], "v": [kv[1] for kv in layers_kv], "valid": valid,
                        "slot": cache["slot"] + t}

    def logits(self, x: jnp.ndarray) -> jnp.ndarray:
        """The output head on final-normed states (``hidden=True``'s): float32 logits, soft-capped
        where the LM caps them."""
        logits = (self.token_embedding.attend(x) if self.tie_embeddings else self.head(x)).astype(jnp.float32)
        if self.logit_softcap:
            logits = self.logit_softcap * jnp.tanh(logits / self.logit_softcap)
        return logits


def _check_room(cache: dict, t: int) -> None:
    """A ``ValueError`` when ``t`` new tokens do not fit the cache after its slot (where the slot is
    known outside ``jit``; inside, the logits come back NaN)."""
    slot, length = cache["slot"], cache["valid"].shape[1]
    if not isinstance(slot, jax.core.Tracer) and int(slot) + t > length:
        raise ValueError(f"{t} new token(s) at cache slot {int(slot)} do not fit a cache of {length} slots; "
                         "make the cache longer (init_cache's length: prompt + new tokens).")


def init_cache(lm_config: dict, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty KV cache of ``length`` slots for ``LM(**lm_config)``: per layer ``k`` and ``v``
    ``[B, length, kv_heads, head_dim]``, which slots hold real tokens, and the next free slot."""
    model = LM(**lm_config)
    kv = model.num_kv_heads or model.num_heads
    zeros = lambda: jnp.zeros((batch, length, kv, model.attn_head_dim), dtype)  # noqa: E731
    return {"k": [zeros() for _ in range(model.depth)], "v": [zeros() for _ in range(model.depth)],
            "valid": jnp.zeros((batch, length), bool), "slot": jnp.zeros((), jnp.int32)}


def forward_flops(lm_config: dict, seq_len: int) -> float:
    """Forward FLOPs of one sequence of ``seq_len`` input embeddings through the LM (XLA's count
    of the lowered program, ``common.lowered_flops``: blocks, final norm and the vocabulary head)."""
    model = LM(**lm_config)
    x = jnp.zeros((1, seq_len, model.width), jnp.float32)
    _, flops = common.traced_cost(lambda k, x: model.init(k, embeds=x), lambda p, x: model.apply(p, embeds=x), x)
    return flops
