"""A small vision-language model: ViT tower → connector → decoder LM.

    vlm = VLM(vision=dict(width=128, depth=4, ...), connector={"name": "pool", "budget": 16},
              lm=dict(width=256, depth=4, num_heads=4))
    logits = vlm.apply(variables, images, ids)      # [B, 1 + M + (L - 1), vocab]

Sequence: ``ids[:p] [M visual tokens] ids[p:]`` with ``p = image_pos`` per example: 1 by
default (``[BOS] image text…``, LLaVA's layout with the image first), or where a chat template's
``<image>`` placeholder stood (``qa_tokens(..., chat=True)``). Under the causal mask the text
before the image cannot see it, so the last visual position predicts ``ids[p]`` and every other
text position ``i`` predicts ``ids[i + 1]`` (``text_logits``).

``vision_layer`` picks the tower output. For ``n >= 2``, ``-n`` is exactly Hugging Face's
``hidden_states[-n]``: ``-2`` the second-to-last block's output (LLaVA's feature layer), ``-n``
block ``depth - n``, ``-(depth + 1)`` the encoder's input (after ``pre_norm``). ``-1`` is
vitmm's ``encoded``: the last block after the tower's final norm (HF's ``hidden_states[-1]``
only for towers without one, e.g. ``fc_norm=True``). ``use_cls`` prepends the CLS
token, projected by its own linear layer, to the connector's output (the grid-based connectors
only take patch tokens). ``prefix_lm`` lets BOS, the image and the prompt attend to each other
both ways (pass ``prompt_len``); otherwise attention is causal throughout.

``mrope=True`` gives the LM Qwen2-VL's 3D positions (the LM built with ``mrope_section``; a
grid-shaped connector, ``connectors.token_grid``): visual token ``(i, j)`` of an image at
``p`` sits at ``(p, p + i, p + j)``, text before it at ``p' = (p', p', p')`` and text after it
continues from ``p + max(rows, cols)`` (``rope.mrope_positions``, tested against transformers).
With a tower that resamples its positions (``dynamic_img_size`` or sin-cos) and the patch merger,
that is Qwen2-VL's native-resolution path: every image at its own grid, the token count
``num_visual_tokens(image_hw)``.

``anyres={"pinpoints": [(h, w), …], "tile": side}`` is LLaVA-NeXT's AnyRes (``models.anyres``):
images at their own size become a base view and ``tile``-pixel tiles of the best candidate
resolution, each through the tower and a grid-shaped connector; the tiles' tokens are
reassembled, cut to the image, and each row ends with a learned newline token.

``num_visual_tokens(image_hw)`` is exact on every path (square inputs, native resolution, AnyRes):
it is what the LM receives for an image of that size (tested against the real shapes). Images with
different counts share a batch through ``visual_mask`` (``__call__``): each example's visual tokens
left-padded, the padding masked out of attention and positions.

``packed(images, tokens, visual, segment_ids, positions)`` takes flat sequences (``data.sequences``):
any number of images per example, each where its ``<image>`` stood, and several examples packed
in one row, each attending to itself only (``lm.segment_mask``) with positions restarting at each.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from vitmm.models import anyres as anyres_lib
from vitmm.models import common, connectors, layers
from vitmm.models import packing as packing_lib
from vitmm.models.lm import LM
from vitmm.models.vit import ViT


class VLM(nn.Module):
    vision: dict
    connector: dict
    lm: dict
    vision_layer: int = -1
    use_cls: bool = False
    mrope: bool = False
    anyres: dict | None = None

    def setup(self):
        self.tower = ViT(**self.vision)
        self.language = LM(**self.lm)
        self.project = connectors.build(self.connector, out_dim=self.language.width)
        if self.use_cls:
            self.cls_proj = layers.Dense(self.language.width, kernel_init=common.trunc_normal(0.02))
        if self.anyres is not None:
            if self.use_cls or self.mrope:
                raise ValueError("anyres works without use_cls and mrope.")
            anyres_lib.check_pinpoints(self.anyres["pinpoints"], self.anyres["tile"])
            self.image_newline = self.param("image_newline", common.trunc_normal(0.02), (self.language.width,))

    def num_visual_tokens(self, image_hw) -> int:
        if self.anyres is not None and self.anyres.get("max_patches"):
            return len(anyres_lib.downsampled(image_hw, self.anyres["pinpoints"], self.anyres["tile"],
                                              self._tile_grid(), self.anyres["max_patches"])[0])
        if self.anyres is not None:
            return anyres_lib.num_tokens(image_hw, self.anyres["pinpoints"], self.anyres["tile"], self._tile_grid())
        grid = self.tower.grid(image_hw)
        return connectors.num_visual_tokens(self.connector, grid) + int(self.use_cls)

    def _tile_grid(self) -> tuple[int, int]:
        tile = self.anyres["tile"]
        rows_cols = connectors.token_grid(self.connector, self.tower.grid((tile, tile)))
        if rows_cols is None:
            raise ValueError(f"anyres needs a grid-shaped connector; {self.connector.get('name')!r} hands the LM "
                             "learned queries with no place in the image.")
        return rows_cols

    def _view_tokens(self, views):
        """Each AnyRes view's grid of tokens ``[B, V, gh, gw, D]`` from ``views [B, V, t, t, C]``."""
        b, n = views.shape[:2]
        patches, _, grid = self.features(views.reshape(b * n, *views.shape[2:]))
        tokens = self.project(patches, grid)
        return tokens.reshape(b, n, *self._tile_grid(), tokens.shape[-1])

    def _anyres_tokens(self, images, layout=None):
        """AnyRes (``models.anyres``): ``[B, M, D]`` for images of one size ``[B, H, W, C]``, or for
        views made on the host (the ``anyres`` preprocessing op: ``[B, V, t, t, C]``, each image's
        ``layout [B, M]``)."""
        pinpoints, tile = self.anyres["pinpoints"], self.anyres["tile"]
        if (images.ndim == 5) != (layout is not None):
            raise ValueError(f"AnyRes takes images [B, H, W, C], or views [B, V, {tile}, {tile}, C] with their layout "
                             f"(the `anyres` preprocessing op); got images of shape {images.shape} and "
                             f"{'a' if layout is not None else 'no'} layout.")
        if layout is not None:
            layout = (jnp.asarray(layout[0], jnp.int32), jnp.asarray(layout[1])) if isinstance(layout, tuple | list) \
                else jnp.asarray(layout, jnp.int32)
            return anyres_lib.gather(self._view_tokens(images), layout, self.image_newline)
        if self.anyres.get("max_patches"):  # LLaVA-OneVision's downsampling, laid out for this one size
            tokens = self._view_tokens(anyres_lib.views(images, pinpoints, tile))
            index, weights = anyres_lib.downsampled(images.shape[1:3], pinpoints, tile, tokens.shape[2:4],
                                                    self.anyres["max_patches"])
            b = images.shape[0]
            return anyres_lib.gather(tokens, (jnp.broadcast_to(index, (b, *index.shape)),
                                              jnp.broadcast_to(weights, (b, *weights.shape))), self.image_newline)
        return anyres_lib.assemble(self._view_tokens(anyres_lib.views(images, pinpoints, tile)), images.shape[1:3],
                                   pinpoints, tile, self.image_newline)

    def positions(self, batch: int, text_len: int, grid, image_pos=None):
        """The LM positions of the sequence ``ids[:p] visual ids[p:]`` for the tower's patch
        ``grid``: None (0 … T-1) unless ``mrope``, then ``[3, B, T]`` (see the module docstring)."""
        if not self.mrope:
            return None
        if self.language.mrope_section is None or self.use_cls:
            raise ValueError("mrope=True needs an LM with mrope_section and use_cls=False.")
        rows_cols = connectors.token_grid(self.connector, tuple(grid))
        if rows_cols is None:
            raise ValueError(f"mrope=True needs a grid-shaped connector; {self.connector.get('name')!r} "
                             "hands the LM learned queries with no place in the image.")
        m = rows_cols[0] * rows_cols[1]
        j = jnp.arange(text_len + m)[None]
        p = jnp.ones((batch, 1), jnp.int32) if image_pos is None else jnp.asarray(image_pos, jnp.int32).reshape(-1, 1)
        k = j - p
        image = (k >= 0) & (k < m)
        after = j - m + max(rows_cols)
        rows = jnp.where(image, p + k // rows_cols[1], jnp.where(k < 0, j, after))
        cols = jnp.where(image, p + k % rows_cols[1], jnp.where(k < 0, j, after))
        first = jnp.where(image, p, jnp.where(k < 0, j, after))
        return jnp.broadcast_to(jnp.stack([first, rows, cols]), (3, batch, text_len + m))

    def rope_delta(self, grid) -> int:
        """What decoding adds to a sequence index to get its position under ``mrope``."""
        rows_cols = connectors.token_grid(self.connector, tuple(grid))
        return max(rows_cols) - rows_cols[0] * rows_cols[1]

    def _grid(self, images, features):
        """The tower's patch grid, which only M-RoPE's positions read (None without ``mrope``: an
        AnyRes image need not be a whole number of patches)."""
        if not self.mrope:
            return None
        return tuple(features[2]) if features is not None else self.tower.grid(images.shape[1:3])

    def _layer(self, out: dict) -> jnp.ndarray:
        """The chosen layer's token sequence of a tower output (``vision_layer``)."""
        depth = self.tower.arch().depth
        if self.vision_layer == -1:
            return out["encoded"]
        index = depth + self.vision_layer  # HF's hidden_states[index + 1] is block_{index}
        if not -1 <= index < depth - 1:
            raise ValueError(f"vision_layer={self.vision_layer} does not exist in a {depth}-block tower: "
                             f"choose -1 (encoded) or -2 … -{depth + 1} (as HF's hidden_states[-n]).")
        return out["encoder_input"] if index == -1 else out[f"block_{index:02d}"]

    def features(self, images: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray | None, tuple[int, int]]:
        """Patch tokens ``[B, N, C]`` of the chosen layer, the CLS token if any, and the grid."""
        _, out = self.tower(images)
        grid = tuple(out["stem"].shape[1:3])
        seq = self._layer(out)
        cls = seq[:, 0] if self.tower.class_token else None
        patches = out["patch_tokens"] if self.vision_layer == -1 else seq[:, self.tower.num_prefix_tokens:]
        if self.use_cls and cls is None:
            raise ValueError("use_cls=True needs a tower with class_token=True.")
        return patches, cls, grid

    def visual_tokens(self, images: jnp.ndarray, features=None, layout=None) -> jnp.ndarray:
        """``[B, M, D]`` tokens for the LM (``features`` may be precomputed tower outputs; ``layout``:
        AnyRes views made on the host)."""
        if self.anyres is not None:
            return self._anyres_tokens(images, layout)
        if layout is not None:
            raise ValueError("layout is AnyRes's (the `anyres` preprocessing op); this VLM has anyres=None.")
        patches, cls, grid = features if features is not None else self.features(images)
        tokens = self.project(patches, grid)
        if self.use_cls:
            tokens = jnp.concatenate([self.cls_proj(cls)[:, None], tokens], axis=1)
        return tokens

    def sequence(self, images, ids, image_pos=None, features=None, layout=None) -> tuple[jnp.ndarray, int]:
        """The LM's input embeddings ``[B, L + M, D]`` (visual tokens before ``ids[:, image_pos]``)
        and ``M``."""
        visual = self.visual_tokens(images, features, layout)
        text = self.language.embed(ids)
        visual = visual.astype(text.dtype)
        m = visual.shape[1]
        if image_pos is None:
            return jnp.concatenate([text[:, :1], visual, text[:, 1:]], axis=1), m
        j = jnp.arange(ids.shape[1] + m)[None]
        p = jnp.asarray(image_pos, jnp.int32).reshape(-1, 1)
        from_text = jnp.take_along_axis(text, jnp.clip(jnp.where(j < p, j, j - m), 0, ids.shape[1] - 1)[..., None], 1)
        from_image = jnp.take_along_axis(visual, jnp.clip(j - p, 0, m - 1)[..., None], 1)
        return jnp.where(((j >= p) & (j < p + m))[..., None], from_image, from_text), m

    def __call__(self, images, ids, prompt_len=None, prefix_lm: bool = False, features=None, image_pos=None,
                 visual_mask=None, layout=None, text_logits_at=None, hidden: bool = False):
        """Logits for the sequence ``ids[:p] visual ids[p:]`` (``p = image_pos``, default 1:
        ``ids[:, 0]`` is then BOS).

        ``visual_mask [B, M]`` (True: a real visual token) lets one batch hold images with
        different token counts (e.g. precomputed ``features`` of images at their own sizes), each
        example's visual tokens left-padded to ``M``: padding first, so that the last visual
        position, which predicts ``ids[p]``, is a real token. Padding is kept out of attention
        and out of the positions, so each example gets its unpadded sequence's text logits
        (tested). ``layout``: AnyRes views made on the host (the ``anyres`` op) as ``images``.

        ``text_logits_at [B, K]`` (text positions): only the logits ``text_logits`` would give at
        those positions, ``[B, K, vocab]`` — position ``i`` predicts ``ids[:, i + 1]`` — with the
        LM's head run there alone. ``hidden``: the LM's final-normed states in place of logits
        (``head`` makes them logits; ``losses.chunked_lm_loss``)."""
        x, m = self.sequence(images, ids, image_pos, features, layout)
        positions = self.positions(ids.shape[0], ids.shape[1], self._grid(images, features), image_pos)
        pad_mask = None
        if visual_mask is not None:
            pad_mask = self._shown(visual_mask, ids.shape[1], m, image_pos)
            positions = jnp.cumsum(pad_mask, axis=1) - 1
        rows = None if text_logits_at is None else text_rows(text_logits_at, m, image_pos)
        return self.language(embeds=x, prefix_len=_prefix(prefix_lm, prompt_len, m), positions=positions,
                             pad_mask=pad_mask, logits_at=rows, hidden=hidden)

    def head(self, x: jnp.ndarray) -> jnp.ndarray:
        """The LM's output head on ``hidden=True``'s states: float32 logits."""
        return self.language.logits(x)

    def packed(self, images, tokens, visual, segment_ids, positions, prefix_mask=None, logits_at=None,
               hidden: bool = False):
        """Logits ``[R, T, vocab]`` of packed rows (``data.sequences``): ``images [R, N, H, W, C]``
        (a row's image slots, unused ones zero), ``tokens [R, T]`` the text ids, ``visual [R, T]``
        which visual token sits at each position (``n · M + j``: token ``j`` of the row's image
        ``n``; -1 on text), ``segment_ids``/``positions [R, T]`` the examples and their positions
        (0 on padding), ``prefix_mask [R, T]`` each example's prefix for a prefix-LM (else causal).
        Position ``t`` predicts the token at ``t + 1`` of its example. With ``mrope``, ``positions``
        are ``[3, R, T]`` (``data.sequences.mrope_positions``); with ``anyres`` the slots hold AnyRes
        views and ``visual`` -2 is the newline token."""
        x = self._sequence_embeds(images, tokens, visual)
        return self.language(embeds=x, positions=positions, segment_ids=segment_ids, prefix_mask=prefix_mask,
                             logits_at=logits_at, hidden=hidden)

    def prefill_sequences(self, images, tokens, visual, lengths, cache, prefix_lm: bool = False, positions=None):
        """``prefill`` for prompts as flat sequences (``data.sequences.prompt_sequence``: any number
        of images each, ``images [B, N, H, W, C]``, ``tokens``/``visual [B, T]`` left-aligned,
        ``lengths [B]``): ``(logits [B, vocab] after each prompt, cache)``; decoding continues at
        position ``lengths`` (with ``mrope``, ``positions [3, B, T]`` and, in the cache, each row's
        ``rope_delta``: its next position minus its length)."""
        if self.mrope != (positions is not None):
            raise ValueError("prefill_sequences takes M-RoPE positions [3, B, T] exactly when mrope=True.")
        x = self._sequence_embeds(images, tokens, visual)
        end = jnp.asarray(lengths, jnp.int32)
        valid = jnp.arange(x.shape[1])[None] < end[:, None]
        logits, cache = self.language(embeds=x, pad_mask=valid, prefix_len=end if prefix_lm else None,
                                      positions=positions, cache=cache, logits_at=(end - 1)[:, None])
        if positions is not None:
            last = jnp.max(jnp.where(valid[None], positions, -1), axis=(0, 2))
            cache["rope_delta"] = (last + 1 - end).astype(jnp.int32)
        return logits[:, 0], cache

    def token_grid(self, image_hw) -> tuple[int, int] | None:
        """An image's visual tokens as rows × columns (None for learned queries)."""
        return connectors.token_grid(self.connector, self.tower.grid(tuple(image_hw)))

    def _sequence_embeds(self, images, tokens, visual):
        """Input embeddings of flat sequences: the text's, with row image ``n``'s visual token
        ``j`` where ``visual`` is ``n · M + j``; or, for images at their own sizes packed for the
        tower (``images`` a ``models.packing.Packed`` batch of rows), the connector's output of the
        row's tower token ``visual`` (a token-wise connector: one token a patch)."""
        if isinstance(images, packing_lib.Packed):
            _, out = self.tower(images)
            flat = self._packed_project(self._layer(out))
        elif self.anyres is not None:  # each slot an AnyRes view (a tile-sized square), its tokens in its grid
            views = self._view_tokens(images)
            flat = views.reshape(views.shape[0], -1, views.shape[-1])
        else:
            r, n = images.shape[:2]
            flat = self.visual_tokens(images.reshape(r * n, *images.shape[2:]))
            flat = flat.reshape(r, n * flat.shape[1], flat.shape[2])
        text = self.language.embed(tokens)
        picked = jnp.take_along_axis(flat, jnp.maximum(visual, 0)[..., None], 1).astype(text.dtype)
        x = jnp.where((visual >= 0)[..., None], picked, text)
        if self.anyres is not None:  # data.sequences.NEWLINE (-2): the learned newline ending each row of tokens
            x = jnp.where((visual == -2)[..., None], self.image_newline.astype(x.dtype), x)
        return x

    def _packed_project(self, seq):
        """The connector on a packed row's tower tokens ``[R, L, C]``: token-wise ones per token;
        ``patch_merger``/``pixel_shuffle`` with a fixed ``merge=k`` on each run of ``k²`` tokens (an
        image's patches in merge-window order, ``data.sequences``), the same neighbours concatenated
        in the same order as on a square grid."""
        name, k = self.connector.get("name"), self.connector.get("merge")
        if self.use_cls or not (name in ("identity", "linear", "mlp") or
                                (name in ("patch_merger", "pixel_shuffle") and k)):
            raise ValueError(f"images packed at their own sizes take a token-wise connector (identity, linear, mlp) or "
                             f"patch_merger/pixel_shuffle with a fixed merge=k, and use_cls=False; this VLM has "
                             f"{name!r}{'' if k is None else f' with merge={k}'}.")
        r, length, c = seq.shape
        if name in ("identity", "linear", "mlp"):
            return self.project(seq, (1, length))
        # run m's token (a, b) goes to row a, column m·k + b of a k × L/k grid, whose k × k blocks are the runs
        grid_order = seq.reshape(r, length // k**2, k, k, c).transpose(0, 2, 1, 3, 4).reshape(r, length, c)
        return self.project(grid_order, (k, length // k))

    def _shown(self, visual_mask, text_len: int, m: int, image_pos=None) -> jnp.ndarray:
        """``[B, L + M]``: False on the visual padding ``visual_mask [B, M]`` marks, True elsewhere."""
        if self.mrope:
            raise ValueError("visual_mask works with 1D positions only (mrope=False).")
        visual_mask = jnp.asarray(visual_mask, bool)
        j = jnp.arange(text_len + m)[None]
        p = jnp.ones((visual_mask.shape[0], 1), jnp.int32) if image_pos is None else \
            jnp.asarray(image_pos, jnp.int32).reshape(-1, 1)
        shown = jnp.take_along_axis(visual_mask, jnp.clip(j - p, 0, m - 1), 1)
        return jnp.where((j >= p) & (j < p + m), shown, True)

    def prefill(self, images, ids, prompt_len, cache, image_pos=None, prefix_lm: bool = False, visual_mask=None,
                layout=None):
        """Writes the prompts ``ids[:, :prompt_len]`` (right-padded) and the image into the KV
        ``cache`` (``lm.init_cache``): ``(logits [B, vocab] after each prompt, cache)``. With
        ``visual_mask`` (as in ``__call__``) the padding stays out of the cache's valid slots and of
        the positions: decoding continues at ``prompt_len + visual_mask.sum(-1)``."""
        x, m = self.sequence(images, ids, image_pos, layout=layout)
        end = jnp.asarray(prompt_len, jnp.int32) + m  # each row's sequence length
        valid = jnp.arange(x.shape[1])[None] < end[:, None]
        grid = self._grid(images, None)
        positions = self.positions(ids.shape[0], ids.shape[1], grid, image_pos)
        if visual_mask is not None:
            valid = valid & self._shown(visual_mask, ids.shape[1], m, image_pos)
            positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
        logits, cache = self.language(embeds=x, pad_mask=valid, prefix_len=_prefix(prefix_lm, prompt_len, m),
                                      positions=positions, cache=cache, logits_at=(end - 1)[:, None])
        if self.mrope:  # decoding's positions: sequence index + delta
            cache["rope_delta"] = jnp.asarray(self.rope_delta(grid), jnp.int32)
        return logits[:, 0], cache

    def step(self, token, position, cache):
        """One decoding step: ``token [B]`` at sequence ``position [B]`` → ``(logits [B, vocab], cache)``."""
        delta = cache.get("rope_delta")
        shifted = position if delta is None else position + delta
        logits, cache = self.language(token[:, None], positions=shifted[:, None], cache=cache)
        if delta is not None:
            cache["rope_delta"] = delta
        return logits[:, -1], cache


def _prefix(prefix_lm: bool, prompt_len, num_visual: int):
    """The bidirectional prefix (image + prompt) of ``prefix_lm``, in sequence positions."""
    if not prefix_lm:
        return None
    if prompt_len is None:
        raise ValueError("prefix_lm=True needs prompt_len (the prompt's tokens, BOS included).")
    return num_visual + jnp.asarray(prompt_len)


def text_logits(logits: jnp.ndarray, num_visual: int, image_pos=None) -> jnp.ndarray:
    """``[B, L, vocab]`` aligned with the text ids ``[B, L]``: position ``i`` predicts
    ``ids[:, i + 1]``. The predictor of ``ids[:, p]`` (``p = image_pos``, default 1) is the last
    visual position, since the text before the image cannot see it; the logits of the other
    visual positions and of ``ids[:, p - 1]`` are dropped."""
    if image_pos is None:
        return logits[:, num_visual:]
    rows = text_rows(jnp.arange(logits.shape[1] - num_visual)[None], num_visual, image_pos)
    return jnp.take_along_axis(logits, rows[..., None], 1)


def text_rows(i: jnp.ndarray, num_visual: int, image_pos=None) -> jnp.ndarray:
    """The sequence rows of text positions ``i`` (``[B, K]`` or ``[1, K]``): the rows of
    ``text_logits``, i.e. the last visual row for ``ids[:, p - 1]``, which predicts ``ids[:, p]``."""
    i = jnp.asarray(i, jnp.int32)
    if image_pos is None:
        return i + num_visual
    return jnp.where(i < jnp.asarray(image_pos, jnp.int32).reshape(-1, 1) - 1, i, i + num_visual)
