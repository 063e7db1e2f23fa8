"""A run refused as it starts leaves nothing behind: not its workdir, nor the parents it made."""

import pathlib

import pytest

from vitmm import config_args
from vitmm.train import trainer
from vitmm.train import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_workdir_that_is_a_file_is_said_so(tmp_path):
    """It said ``cannot write there (File exists)``."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(workdir_lib.NotWritable) as err:
        workdir_lib.make(tmp_path / "f")
    assert str(err.value) == f"--workdir {tmp_path / 'f'} is a file; choose a folder."


def test_make_returns_the_topmost_folder_it_made(tmp_path):
    assert workdir_lib.make(tmp_path / "a" / "b" / "c") == tmp_path / "a"
    assert workdir_lib.make(tmp_path / "a" / "b" / "c") is None  # there already
    workdir_lib.remove_if_empty(tmp_path / "a" / "b" / "c", up_to=tmp_path / "a")
    assert list(tmp_path.iterdir()) == []
    workdir_lib.make(tmp_path / "a" / "b")
    (tmp_path / "a" / "kept.txt").write_text("x")  # written meanwhile by someone else: kept, with its folder
    workdir_lib.remove_if_empty(tmp_path / "a" / "b", up_to=tmp_path / "a")
    assert [p.name for p in tmp_path.rglob("*")] == ["a", "kept.txt"]


def test_a_refused_run_leaves_no_parent_folders(tmp_path):
    """``--workdir new/a/b`` refused for a missing tokenizer left ``new/a`` behind."""
    config = config_args.load(ROOT / "configs/clip_scenes.py", "smoke",
                              **{"tokenizer": str(tmp_path / "none.json"), "input.data_dir": str(tmp_path / "data")})
    with pytest.raises(FileNotFoundError, match="No tokenizer.json"):
        trainer.train(config, tmp_path / "new" / "a" / "b")
    assert not (tmp_path / "new").exists()
