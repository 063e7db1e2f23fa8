"""A run pins what it reads from its init folders besides their weights (vitmm.train.sources): the
copies are what a resumed run, chat, serve and export read; a folder changed in place is said, not
used. (The whole path, with the folders moved away, is tested in test_vlm_training.)"""

import json

import ml_collections
import pytest

from vitmm import checkpoint as ckpt_lib
from vitmm.train import sources


def _folder(path, settings, tokenizer=None):
    path.mkdir(parents=True)
    (path / ckpt_lib.PINNED_SETTINGS).write_text(json.dumps(settings))  # reads as a run's saved config
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(tokenizer)
    return path


def test_pin_read_and_compare(tmp_path, capsys):
    lm = _folder(tmp_path / "lm", {"model": {"lm": {"width": 8}}, "chat_template": "{{ x }}"}, tokenizer="v1")
    weights_only = tmp_path / "ckpt"
    weights_only.mkdir()  # an init.checkpoint without a saved config: nothing to pin
    config = ml_collections.ConfigDict({"init": {"lm": str(lm), "checkpoint": str(weights_only)}})
    work = tmp_path / "w"
    assert sources.pin(work, config) == ["lm"] and sources.pin(work, config) == []  # once
    assert json.loads((work / "sources/lm/settings.json").read_text()) == {"model": {"lm": {"width": 8}},
                                                                          "chat_template": "{{ x }}"}
    assert (work / "sources/lm/tokenizer.json").read_text() == "v1"

    pinned = sources.with_pinned(config, work)
    assert sources.folder(pinned, "lm") == str(work / "sources/lm") and sources.folder(config, "lm") == str(lm)
    assert ckpt_lib.load_config(sources.folder(pinned, "lm"))["model"]["lm"] == {"width": 8}
    assert "pinned" not in sources.without_pinned(pinned).init and "pinned" not in config.init
    assert sources.changed_since_pinned(pinned) == []

    (lm / "tokenizer.json").write_text("v2")  # converted again in place
    assert sources.changed_since_pinned(pinned) == [
        f"init.lm={lm} has changed since this run started; the run keeps the settings it started with "
        f"({work / 'sources/lm'})."]
    (lm / "tokenizer.json").rename(tmp_path / "gone.json")
    (lm / ckpt_lib.PINNED_SETTINGS).unlink()
    lm.rmdir()
    assert sources.changed_since_pinned(pinned) == []  # moved away: no difference to report

    again = _folder(tmp_path / "lm", {"model": {"lm": {"width": 16}}}, tokenizer="v3")  # a fresh start re-pins
    assert sources.pin(work, config, replace=True) == ["lm"]
    assert ckpt_lib.load_config(work / "sources/lm")["model"]["lm"] == {"width": 16} and again.is_dir()


def test_an_imported_vlms_tokenizer_is_read_from_the_pinned_copy(tmp_path):
    imported = _folder(tmp_path / "imported", {"task": "vlm", "tokenizer": str(tmp_path / "imported/tokenizer.json")},
                       tokenizer="tok")
    config = ml_collections.ConfigDict({"init": {"checkpoint": str(imported)}, "tokenizer": str(imported /
                                                                                                "tokenizer.json")})
    sources.pin(tmp_path / "w", config)
    pinned = sources.with_pinned(config, tmp_path / "w")
    assert sources.tokenizer_file(pinned) == str(tmp_path / "w/sources/checkpoint/tokenizer.json")
    assert sources.tokenizer_file(config) == config.tokenizer
    with pinned.unlocked():
        pinned.tokenizer = str(tmp_path / "other.json")  # a tokenizer of the run's own: kept
    assert sources.tokenizer_file(pinned) == str(tmp_path / "other.json")


def test_an_init_folder_without_settings_for_vision_or_lm_is_an_error(tmp_path):
    (tmp_path / "lm").mkdir()
    config = ml_collections.ConfigDict({"init": {"lm": str(tmp_path / "lm")}})
    with pytest.raises(FileNotFoundError, match="No checkpoint in"):
        sources.pin(tmp_path / "w", config)
    assert not (tmp_path / "w/sources/lm").exists()
