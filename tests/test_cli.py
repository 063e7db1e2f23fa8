"""What every command checks of the folder it writes (``vitmm.cli.new_output_folder``), and the
commands that use it refusing in one line with exit 2 and nothing written."""

import pathlib

import pytest

from vitmm import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_new_output_folder_is_new_or_empty_and_writable(tmp_path):
    assert cli.new_output_folder(tmp_path / "a" / "b") == tmp_path / "a" / "b"  # created later, by the command
    (tmp_path / "empty").mkdir()
    assert cli.new_output_folder(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "data.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"--out .*/full is not empty; choose a new folder"):
        cli.new_output_folder(tmp_path / "full")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--out .*/file is a file; choose a folder"):
        cli.new_output_folder(tmp_path / "file")
    with pytest.raises(ValueError, match=r"cannot write there \(.*/file is a file\)"):
        cli.new_output_folder(tmp_path / "file" / "below", flag="--workdir")


@pytest.mark.parametrize("argv, message", [
    (["examples", "--format", "llava", "--out", "{full}"], "is not empty; choose a new folder."),
    (["examples", "--format", "wds", "--out", "{tmp}/new", "--num", "-5"], "--num -5 (at least 1)"),
])
def test_data_examples_refuses_in_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    from vitmm.data.__main__ import main

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "run.json").write_text("{}")
    argv = [a.replace("{full}", str(tmp_path / "full")).replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's error: exit 2
        code = stop.code
    assert code == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"] and [p.name for p in (tmp_path / "full").iterdir()] \
        == ["run.json"]


def test_a_folder_of_what_the_command_writes_there_is_written_again(tmp_path, capsys):
    """Parquet splits sit side by side in one folder (the Hub's layout): another split is written
    beside the first; the same split again is refused."""
    from vitmm.data.__main__ import main

    out = str(tmp_path / "pq")
    args = ["examples", "--format", "parquet", "--out", out, "--num", "4", "--resolution", "16"]
    assert main(args) == 0 and main([*args, "--split", "validation"]) == 0
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == ["train-00000-of-00001.parquet",
                                                                   "validation-00000-of-00001.parquet"]
    assert main(args) == 2 and "is not empty" in capsys.readouterr().err
    assert cli.new_output_folder(tmp_path / "pq", reusable=lambda names: all(n.endswith(".parquet") for n in names))
