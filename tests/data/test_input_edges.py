"""Edge cases of the raw readers and image decoding found in review: each pins what the reader's
docstring promises against a small file written here."""

import io

import numpy as np
from PIL import Image

from vitmm.data import formats
from vitmm.data.images import decode_image


def _png(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def test_a_multi_dot_field_stands_in_only_for_keys_whose_files_all_have_several_dots(tmp_path, write_tar):
    """webdataset matches whole field names: beside ``key.jpg`` a ``key.ocr.txt`` is not the caption
    (``key.json``'s is), and beside ``key.txt`` a ``key.depth.jpg`` is not the photo (none: skipped as
    ``image_missing``), as ``format_wds._field`` says."""
    white = _png(np.full((4, 4, 3), 255, np.uint8))
    source = formats.WdsSource(write_tar(tmp_path / "a.tar", [
        ("0.jpg", white), ("0.json", b'{"caption": "a white square"}'), ("0.ocr.txt", b"OCR TEXT"),
        ("1.depth.jpg", white), ("1.txt", b"a square")]))
    assert source[0]["caption"] == "a white square"
    assert source[1].reason == "image_missing"
    alone = formats.WdsSource(write_tar(tmp_path / "b.tar", [("x.y.png", white), ("x.y.txt", b"a white square")]))[0]
    assert decode_image(alone["image"]).min() == 255 and alone["caption"] == "a white square"


def _png16_rgb(values: np.ndarray) -> bytes:
    """A 16-bit RGB PNG, written by hand (PIL cannot write one)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    h, w, _ = values.shape
    rows = b"".join(b"\0" + values[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def test_16_bit_colour_pngs_come_within_one_level_of_the_greyscale_mapping():
    """PIL reads a 16-bit colour PNG at its high byte (``images``' docstring says so): within one
    level of value / 257, what 16-bit greyscale files and uint16 arrays get."""
    from vitmm.data import images

    values = np.array([[[0, 383, 32767], [32896, 65535, 1000], [65280, 65281, 129]]], np.uint16)
    got = decode_image(_png16_rgb(values)).astype(int)
    np.testing.assert_array_equal(got, values >> 8)
    assert np.abs(got - images.array_to_rgb(values)).max() == 1


def test_flat_anyres_sequences_refuse_a_draft_decode(monkeypatch):
    """With ``input.sequences`` and ``model.anyres`` the views are cut by ``data.sequences`` (no
    ``anyres`` op for ``parse`` to see), from the decoded size: a draft decode is refused there too."""
    import ml_collections
    import pytest

    from vitmm.train import inputs
    from vitmm.train.sequence_layout import SequenceLayout

    layout = SequenceLayout(576, 2048, 1, 0, None, None, {"tile": 336, "pinpoints": [(336, 672)]})
    monkeypatch.setattr(SequenceLayout, "of", classmethod(lambda cls, task: layout))
    config = ml_collections.ConfigDict({"input": {"pp": "decode(draft=336)|keep('image')", "image_size": 336,
                                                  "sequences": {"length": 2048}}, "model": {}, "seed": 0,
                                        "batch_size": 2})
    task = type("Task", (), {"num_visual": 576})()
    with pytest.raises(ValueError, match=r"^decode\(draft=336\) decodes a JPEG at a reduced size.*model.anyres.*"
                                         r"drop draft from input.pp"):
        inputs._sequences(config, config.input.pp, None, task)


def test_a_16_bit_greyscale_png_with_a_transparent_value_goes_onto_white():
    """A 16-bit greyscale PNG's tRNS value is transparency as an 8-bit one's is: composited onto white
    with ``alpha="white"`` (it was ignored: the 16-bit mapping returned first), dropped by default."""
    values = np.array([[30000, 1000], [30000, 65535]], np.uint16)
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, "PNG", transparency=30000)
    mapped = np.round(values / 257).astype(np.uint8)
    np.testing.assert_array_equal(decode_image(buf.getvalue())[..., 0], mapped)
    np.testing.assert_array_equal(decode_image(buf.getvalue(), alpha="white")[..., 0],
                                  np.where(values == 30000, 255, mapped))
