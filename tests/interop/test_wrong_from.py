"""``python -m vitmm.interop`` given the wrong ``--from``: one line that names the ``--from`` the file
looks like (by its file names and headers, no weights read), exit 2, nothing written."""

import pathlib

import pytest

from vitmm.interop import __main__ as cli

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "interop"


@pytest.mark.parametrize("given, src, looks", [
    ("timm", "hf_clip", "hf"),
    ("open_clip", "hf_clip", "hf"),
    ("big_vision", "hf_clip/model.safetensors", "hf"),
    ("hf", "timm_vit/model.safetensors", "timm"),
    ("hf", "timm_vit", "timm"),
    ("hf", "open_clip", "open_clip"),
    ("timm", "open_clip/open_clip_model.safetensors", "open_clip"),
    ("timm", "bv_vit/model.npz", "big_vision"),
    ("big_vision", "gguf_llama/tiny.gguf", "gguf"),
    ("gguf", "hf_gemma", "hf"),
])
def test_a_wrong_from_names_the_one_the_file_looks_like(tmp_path, capsys, given, src, looks):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--from", given, "--src", str(FIXTURES / src), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("python -m vitmm.interop: "), err
    assert err[0].endswith(f" (--src looks like a --from {looks} checkpoint: rerun with --from {looks}.)"), err[0]
    assert list(tmp_path.iterdir()) == []


def test_no_hint_where_the_from_is_right_or_the_file_unknown(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    for given, src in [("timm", tmp_path / "notes.txt"), ("timm", FIXTURES / "timm_vit" / "model.safetensors")]:
        with pytest.raises(SystemExit):
            cli.main(["--from", given, "--src", str(src), "--out", str(tmp_path / "notes.txt"), "--tower", "both"])
        assert "looks like" not in capsys.readouterr().err
