"""How a VLM run lays out flat sequences (``input.sequences``, ``data.sequences``): what an image
slot holds, the rows' sizes, and the run's M-RoPE, packed-tower and AnyRes settings, read once from
its task so that training, held-out losses and ``vitmm.chat`` make sequences the same way."""

from __future__ import annotations

import dataclasses

from vitmm.data import preprocess, sequences


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    per_image: int  # visual tokens an image slot holds (an AnyRes view's; 0 with the tower's patches packed)
    length: int  # positions a row
    max_images: int  # image slots a row (AnyRes views; images with the tower packed)
    tower_length: int = 0  # the tower's patches a row when packed (0: square images in slots)
    mrope_grid: tuple[int, int] | None = None  # an image's tokens as rows × cols, with M-RoPE
    tower: dict | None = None  # patch, prefix tokens and merge of a packed tower (``to_sequence``)
    anyres: dict | None = None  # pinpoints, tile and the connector's tile grid (``to_sequence``)

    @classmethod
    def of(cls, task, num_visual: int | None = None, mrope_grid=None) -> SequenceLayout | None:
        """The layout of a ``tasks.VLMTask`` (its ``num_visual`` and ``mrope_grid`` as
        ``init_params`` sets them, or given: a task loaded for ``vitmm.chat``); None when the run
        does not train on flat sequences."""
        sq = task.config.input.get("sequences")
        if not (sq and sq.get("length")):
            return None
        from vitmm.models import connectors
        from vitmm.models.patch_embed import to_pair
        from vitmm.models.vit import ViT

        tower, anyres, per_image = None, None, task.num_visual if num_visual is None else num_visual
        vit = ViT(**task.vision)
        if sq.get("tower_length"):
            tower = {"patch": to_pair(vit.arch().patch_size)[0], "class_token": vit.class_token,
                     "num_registers": vit.num_registers, "merge": task.config.model.connector.get("merge") or 1}
            per_image, runs = 0, tower["merge"] ** 2
            if sq.tower_length % runs:  # the connector merges each run of merge² packed patches
                raise ValueError(f"input.sequences.tower_length={sq.tower_length} is not a multiple of merge²={runs} "
                                 f"(the connector's merge={tower['merge']} takes the packed patches {runs} at a time): "
                                 f"set it to {-(-sq.tower_length // runs) * runs}.")
        if task.model.anyres is not None:
            if task.model.anyres.get("max_patches"):
                raise ValueError("input.sequences (flat sequences) take AnyRes views without max_patches (LLaVA-"
                                 "OneVision's downsampling mixes tokens); set input.sequences.length=0.")
            tile = task.model.anyres["tile"]
            grid = tuple(connectors.token_grid(task.config.model.connector.to_dict(), vit.grid((tile, tile))))
            anyres, per_image = {**task.model.anyres, "tile_grid": grid}, grid[0] * grid[1]
        return cls(per_image, sq.length, sq.get("max_images", 1), sq.get("tower_length", 0),
                   task.mrope_grid if mrope_grid is None else mrope_grid, tower, anyres)

    def split_affine(self, spec: str) -> tuple[str, SequenceLayout]:
        """With AnyRes: ``spec`` without its final ``normalize``/``value_range`` and a layout that
        applies it to the views, which are cut from the uint8 image (padding black whether the host
        or the device normalises); else ``(spec, self)``."""
        if self.anyres is None:
            return spec, self
        host, affine = preprocess.split_image_affine(spec)
        if affine is None:  # normalised on the device (input.device_normalize), or not at all
            return spec, self
        return host, dataclasses.replace(self, anyres={**self.anyres, "affine": affine})

    def sequence(self, ex: dict) -> dict:
        """A pp'd example's flat sequence (``data.sequences.to_sequence``)."""
        return sequences.to_sequence(ex, self.per_image, self.mrope_grid, self.tower, self.anyres)

    def prompt(self, ex: dict) -> dict:
        """A prepared prompt's flat sequence (``data.sequences.prompt_sequence``)."""
        return sequences.prompt_sequence(ex, self.per_image, self.mrope_grid, self.tower, self.anyres)

    def row(self, ex: dict) -> dict:
        """A pp'd example alone in a row (held-out batches). One that does not fit is a bad example
        (``too_long_for_row``): evaluation masks it out and counts it, as training skips it."""
        from vitmm.data.skips import BadExample

        seq = self.sequence(ex)
        try:
            return sequences.one_row(seq, self.length, self.max_images, self.tower_length)
        except sequences.RowOverflow as err:
            raise BadExample("too_long_for_row", str(err)) from None

    def batches(self, source, pp_fn, **kwargs):
        """``data.sequences.packed_batches`` of ``source`` through ``pp_fn`` in this layout."""
        return sequences.packed_batches(source, pp_fn, num_visual=self.per_image, length=self.length,
                                        max_images=self.max_images, mrope_grid=self.mrope_grid, tower=self.tower,
                                        tower_length=self.tower_length, anyres=self.anyres, **kwargs)
