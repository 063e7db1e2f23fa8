"""Edge cases of the raw readers and image decoding found in review: each pins what the reader's
docstring promises against a small file written here."""

import io
import tarfile

import numpy as np
from PIL import Image

from vitmm.data import formats
from vitmm.data.images import decode_image


def _png(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def _tar(path, members) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_a_multi_dot_field_stands_in_only_for_keys_whose_files_all_have_several_dots(tmp_path):
    """webdataset matches whole field names: beside ``key.jpg`` a ``key.ocr.txt`` is not the caption
    (``key.json``'s is), and beside ``key.txt`` a ``key.depth.jpg`` is not the photo (none: skipped as
    ``image_missing``), as ``format_wds._field`` says."""
    white = _png(np.full((4, 4, 3), 255, np.uint8))
    source = formats.WdsSource(_tar(tmp_path / "a.tar", [
        ("0.jpg", white), ("0.json", b'{"caption": "a white square"}'), ("0.ocr.txt", b"OCR TEXT"),
        ("1.depth.jpg", white), ("1.txt", b"a square")]))
    assert source[0]["caption"] == "a white square"
    assert source[1].reason == "image_missing"
    alone = formats.WdsSource(_tar(tmp_path / "b.tar", [("x.y.png", white), ("x.y.txt", b"a white square")]))[0]
    assert decode_image(alone["image"]).min() == 255 and alone["caption"] == "a white square"
