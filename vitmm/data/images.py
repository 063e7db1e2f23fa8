"""Image files as researchers have them (JPEG, PNG, WebP, ...) → uint8 RGB ``[H, W, 3]``.

EXIF orientation is applied (a phone's portrait photo stands up, as transformers' ``load_image``
does; LLaVA's ``Image.open``, open_clip's webdataset decode and big_vision's ``tf.io.decode_image``
do not, so such photos differ from those pipelines); greyscale, palette and CMYK
images become RGB the way PIL's ``convert("RGB")`` does it. Transparency (an alpha band or a
palette's transparent colour) is either dropped (``alpha="drop"``, the default: what LLaVA's and
open_clip's training code do, and what runs trained here see) or composited onto white
(``alpha="white"``: what Hugging Face's processors do, ``convert_to_rgb``; imported VLMs' pp use
it). 16-bit greyscale images map their full range onto 8 bits (value / 257, the same for every
image), where PIL would clip them at 255; 16-bit colour PNGs PIL itself reads at 8 bits, their high
byte (value // 256, within one level of value / 257). Images already in arrays (a dataset's decoded
features) come to the same uint8 RGB by ``array_to_rgb``.
"""

from __future__ import annotations

import io
import math
import os
import warnings

import numpy as np
from PIL import Image, ImageOps

from vitmm.data.skips import BadExample

ALPHA = ("drop", "white")


def decode_image(data: bytes, draft: int | None = None, alpha: str = "drop") -> np.ndarray:
    """uint8 RGB ``[H, W, 3]`` from encoded bytes; ``BadExample("image_unreadable")`` if they
    do not decode. ``draft``: a JPEG may be decoded at a reduced scale (1/2, 1/4, 1/8) as long as
    both sides stay at least ``draft`` pixels (libjpeg's DCT scaling: much faster for large photos
    that are resized down anyway to a fixed size; ``preprocess.parse`` refuses it before an op that
    sizes the image from its own size, ``preprocess.SIZED_FROM_INPUT``). ``alpha``: ``"drop"`` or ``"white"`` (see
    the module docstring), or ``"keep"``: RGBA ``[H, W, 4]`` for a transparent image, for the run's
    pp ``decode`` to treat as it was trained (what ``vitmm.chat`` and the server read files with)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. PIL's palette-transparency note; the pixels are what count
            image = Image.open(io.BytesIO(data))
            if draft and image.format == "JPEG":
                image.draft("RGB", (draft, draft))
            image = ImageOps.exif_transpose(image)
            return np.asarray(_to_rgb(image, alpha))
    except BadExample:
        raise
    except Image.UnidentifiedImageError:
        raise BadExample("image_unreadable", f"not an image file PIL can read ({data[:8]!r}…)") from None
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds (OSError, SyntaxError, ValueError, bombs)
        raise BadExample("image_unreadable", f"{type(err).__name__}: {err}") from None


def check_alpha(alpha: str) -> str:
    if alpha not in ALPHA:
        raise ValueError(f"alpha={alpha!r}: choose 'drop' (LLaVA/open_clip) or 'white' (Hugging Face's processors).")
    return alpha


def on_white(image: Image.Image) -> Image.Image:
    """A transparent image composited onto white, as transformers' ``convert_to_rgb`` does."""
    image = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")


def _to_rgb(image: Image.Image, alpha: str = "drop") -> Image.Image:
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit (PNG, TIFF): its full range onto 8 bits, one
        # mapping for every image (PIL's convert would clip at 255: nearly every 16-bit image white)
        values = np.asarray(image, np.float64) / 257.0
        grey = Image.fromarray(np.round(np.clip(values, 0, 255)).astype(np.uint8))
        clear = image.info.get("transparency")  # (a tRNS value: its pixels are transparent)
        if alpha != "drop" and isinstance(clear, int):
            grey.putalpha(Image.fromarray(np.where(np.asarray(image) == clear, 0, 255).astype(np.uint8)))
            return on_white(grey) if alpha == "white" else grey.convert("RGBA")
        return grey.convert("RGB")
    if image.mode == "F":  # floats: clipped to 0-255 as PIL's convert does (negative values wrapped before)
        return Image.fromarray(np.round(np.clip(np.asarray(image, np.float64), 0, 255)).astype(np.uint8)).convert("RGB")
    if alpha != "drop" and ("A" in image.getbands() or image.info.get("transparency") is not None):
        return on_white(image) if alpha == "white" else image.convert("RGBA")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert("RGB")


def pad_to_square(image: np.ndarray, fill) -> np.ndarray:
    """LLaVA's ``expand2square``: the image centred on a square of its longer side, filled with
    ``fill`` (uint8 RGB, LLaVA uses the tower's mean colour)."""
    h, w = image.shape[:2]
    if h == w:
        return image
    side = max(h, w)
    out = np.empty((side, side, image.shape[2]), image.dtype)
    out[:] = np.asarray(fill, image.dtype)
    top, left = (side - h) // 2, (side - w) // 2
    out[top:top + h, left:left + w] = image
    return out


RESAMPLING = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
              "lanczos": Image.Resampling.LANCZOS}


def resize(image: np.ndarray, size: tuple[int, int], method: str = "bilinear") -> np.ndarray:
    """``image`` resized to ``size`` (height, width) with PIL's ``method``: uint8 as it is, float
    one channel at a time in PIL's 32-bit float mode (e.g. images already normalised)."""
    if method not in RESAMPLING:
        raise ValueError(f"resize method {method!r}: choose one of {tuple(RESAMPLING)}.")
    if image.shape[:2] == tuple(size):
        return image
    if image.dtype.kind == "f":
        channels = [np.asarray(Image.fromarray(np.ascontiguousarray(image[..., c], np.float32), mode="F").resize(
            (size[1], size[0]), RESAMPLING[method])) for c in range(image.shape[-1])]
        return np.stack(channels, axis=-1).astype(image.dtype)
    return np.asarray(Image.fromarray(image).resize((size[1], size[0]), RESAMPLING[method]))


def smart_size(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: ``(height, width)``, multiples of ``factor``, the nearest to
    ``(h, w)`` (Python's rounding, halves to even), scaled down (floor) or up (ceil) with the aspect
    kept when their pixels fall outside ``[min_pixels, max_pixels]``. An aspect ratio over 200
    (which Qwen2-VL's processor refuses too) is a ``BadExample("image_aspect")``: counted and
    skipped in training, a 400 at the server, not a stopped run."""
    if max(h, w) / min(h, w) > 200:
        raise BadExample("image_aspect", f"an image of {h}x{w} pixels: its aspect ratio must be below 200 "
                                         "(Qwen2-VL's limit); crop or pad it")
    nh, nw = round(h / factor) * factor, round(w / factor) * factor
    if nh * nw > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        nh = max(factor, math.floor(h / beta / factor) * factor)
        nw = max(factor, math.floor(w / beta / factor) * factor)
    elif nh * nw < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        nh, nw = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return int(nh), int(nw)


def shorter_side_size(hw: tuple[int, int], size: int) -> tuple[int, int]:
    """``(height, width)`` with the shorter side ``size`` and the longer ``int(size * long / short)``
    (rounded down, as transformers' CLIP-style image processors compute it)."""
    h, w = hw
    short, long = min(h, w), max(h, w)
    new_long = int(size * long / short)
    return (new_long, size) if w <= h else (size, new_long)


_IMAGE_TAKEN = "The image must be uint8 [H, W, 3] ([H, W], [H, W, 1] and [H, W, 4] are made RGB) or a PIL image"


def caller_image(image) -> np.ndarray:
    """An image a caller hands ``vitmm.chat`` / ``vitmm.serve`` as the uint8 array a run's pp takes:
    a uint8 ``[H, W, 3]`` array (greyscale and RGBA are made RGB by the pp) or a PIL image (made RGB
    as image files are). Anything else is a ``ValueError`` in one line naming what came and the fix,
    not pixels guessed at."""
    read = "read the file with vitmm.data.images.decode_image(open(path, 'rb').read())"
    if isinstance(image, str | bytes | os.PathLike):
        got = f"{len(image):,} bytes" if isinstance(image, bytes) else f"the path {str(image)!r}"
        raise ValueError(f"{_IMAGE_TAKEN}; got {got}: {read}.")
    if isinstance(image, Image.Image):  # transparency kept: the pp's decode treats it as the run was trained
        image = np.asarray(_to_rgb(image, alpha="keep"))
    try:
        array = np.asarray(image)
    except ValueError:  # a ragged nested list
        array = np.asarray(None)
    if array.dtype == object:
        raise ValueError(f"{_IMAGE_TAKEN}; got a {type(image).__name__}: pass pixels, or {read}.")
    got = f"{array.dtype} {array.shape}"
    if array.dtype.kind == "f":
        raise ValueError(f"{_IMAGE_TAKEN}; got {got}: float pixels have no agreed range, scale them to 0..255 and "
                         "cast with .astype(np.uint8).")
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (1, 3, 4))):
        if array.ndim == 3 and array.shape[0] in (1, 3, 4):
            fix = "channels go last, e.g. image.transpose(1, 2, 0)"
        elif array.ndim == 3:
            fix = f"{array.shape[-1]} channels, pass 1, 3 or 4"
        else:
            fix = "pass one image, not a batch" if array.ndim > 3 else "pass rows × columns (× channels)"
        raise ValueError(f"{_IMAGE_TAKEN}; got {got}: {fix}.")
    if array.dtype != np.uint8:
        raise ValueError(f"{_IMAGE_TAKEN}; got {got}: cast values in 0..255 with .astype(np.uint8).")
    if array.size == 0:
        raise ValueError(f"{_IMAGE_TAKEN}; got {got}, which has no pixels.")
    return array


def array_to_rgb(image: np.ndarray, alpha: str = "drop") -> np.ndarray:
    """uint8 RGB ``[H, W, 3]`` from grayscale ``[H, W]``/``[H, W, 1]``, RGB or RGBA (its alpha
    dropped, or the image composited onto white with ``alpha="white"``)."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"Expected an image [H, W], [H, W, 1|3|4], got shape {image.shape}.")
    image = _to_uint8(image)
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    elif image.shape[-1] == 4 and alpha == "white":
        image = np.asarray(on_white(Image.fromarray(np.ascontiguousarray(image), "RGBA")))
    elif image.shape[-1] == 4:
        image = image[..., :3]
    return np.ascontiguousarray(image)


def _to_uint8(image: np.ndarray) -> np.ndarray:
    """uint8 pixels from an array of another dtype: uint16 as 16-bit greyscale image files (value /
    257, ``data.images``; colour files: within one level); floats as transformers' ``to_pil_image``
    reads them (whole numbers in 0..255 as they are, else values in [0, 1] times 255), rounded; other
    integers in 0..255 as they are."""
    if image.dtype == np.uint8:
        return image
    if image.dtype == np.uint16:
        return np.round(image / 257.0).astype(np.uint8)
    values = np.asarray(image, np.float64)
    whole = np.array_equal(values, np.round(values))
    if image.dtype.kind == "f" and not whole and values.min() >= 0 and values.max() <= 1:
        values = values * 255.0
    elif values.size and (values.min() < 0 or values.max() > 255 or (image.dtype.kind == "f" and not whole)):
        raise ValueError(f"A {image.dtype} image with values in [{values.min():g}, {values.max():g}]: give uint8 "
                         "(0..255), uint16, or floats in [0, 1] or whole numbers in 0..255.")
    return np.round(values).astype(np.uint8)
