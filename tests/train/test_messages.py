"""What the trainer says at the end of a run or when it stops: messages a newcomer follows."""

import json
import pathlib

import pytest

from vitmm.train import stopping

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _NoCheckpoints:
    def __init__(self, workdir: pathlib.Path, last=None):
        self.directory, self.last = workdir / "checkpoints", last

    def wait(self):
        pass

    def latest_step(self):
        return self.last


def test_non_finite_without_a_checkpoint_says_rerun_not_resume(tmp_path):
    message = str(stopping.non_finite("param_norm", 2, _NoCheckpoints(tmp_path), checkpoint_every=100))
    assert message.startswith("Non-finite param_norm at step 2; the run stops. No checkpoint had been written yet")
    assert "rerun the same command with a lower learning rate" in message and "from step 0." in message
    assert "resume" not in message.replace("nothing to resume", "") and "allow_config_change" not in message
    # a log past two checkpoint intervals: a rerun in that workdir is refused without --restart
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (2, 4, 6)))
    message = str(stopping.non_finite("loss", 7, _NoCheckpoints(tmp_path), checkpoint_every=2))
    assert "rerun the same command with --restart and a lower learning rate" in message
    assert "(metrics.jsonl logged up to step 6: --restart keeps that log aside)." in message


def test_non_finite_with_a_checkpoint_says_resume(tmp_path):
    message = str(stopping.non_finite("loss", 7, _NoCheckpoints(tmp_path, last=6), checkpoint_every=2))
    assert f"The last good checkpoint (step 6) is kept in {tmp_path}/checkpoints." in message
    assert message.endswith("then resume with --config.allow_config_change=True.")


def test_a_bad_config_arg_is_one_line_without_an_exception_name(tmp_path, capsys):
    """The config file's ValueError is a user error like the others: its message, no ``ValueError:``;
    a config file that is itself broken keeps the name of what broke."""

    from vitmm.train import __main__ as cli

    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(arg=None):\n    return undefined_name\n")
    for config, expected in [
            (f"{ROOT / 'configs/clip_scenes.py'}:stepz=3", "python -m vitmm.train: Unknown config arg 'stepz' in "
                                                           "'stepz=3' (did you mean 'steps'?); known args: ["),
            (str(broken), "python -m vitmm.train: NameError: name 'undefined_name' is not defined")]:
        with pytest.raises(SystemExit) as stop:
            cli.parse_flags(["vitmm.train", f"--config={config}", f"--workdir={tmp_path / 'w'}"])
        assert stop.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert err[0].startswith(expected) and err[1:] == ["(--debug shows the traceback)"], err
    assert not (tmp_path / "w").exists()


def test_a_run_without_held_out_data_still_says_where_its_checkpoints_are_and_what_did_not_run():
    """A LLaVA config without evals.val.data.data_path ended with nothing after the progress bar."""
    from vitmm import config_args
    from vitmm.train import __main__ as cli

    summary = dict(evals={}, final_step=2, checkpoints=[2], workdir="w")
    for name in ("llava_pretrain", "llava_finetune"):
        config = config_args.load(ROOT / "configs" / f"{name}.py", "smoke")
        assert cli.final_report(summary, config).splitlines() == [
            "checkpoints [2] in w",
            "evals.val: no data.data_path (nor wds, csv, parquet), not run; set --config.evals.val.data.data_path "
            "(held-out examples) to evaluate"]
        config = config_args.load(ROOT / "configs" / f"{name}.py", "smoke", **{"evals.val.data.data_path": "v.json"})
        ran = dict(summary, evals={"val/loss": 1.5})
        assert cli.final_report(ran, config) == cli.summary_table(ran)  # the table, ending in the checkpoints line
        assert cli.final_report(ran, config).splitlines()[-1] == "checkpoints [2] in w"


def _vlm_config(tmp_path, **overrides):
    from vitmm import config_args

    (tmp_path / "saved_tower").mkdir(exist_ok=True)
    return config_args.load(ROOT / "configs/vlm_scenes.py", "smoke",
                            **{"input.data_dir": str(tmp_path), "init.vision": str(tmp_path / "saved_tower"),
                               **overrides})


def test_config_json_shows_the_tower_and_lm_a_vlm_was_built_with(tmp_path):
    """config.json showed the config's placeholder model.vision while the run used init.vision's tower."""
    from vitmm.train import workdir as workdir_lib

    c = _vlm_config(tmp_path)
    built = {"vision": {**c.model.vision.to_dict(), "width": 32, "depth": 3}, "lm": {"width": 64, "depth": 2}}
    task = type("Task", (), built)
    workdir_lib.write_config(tmp_path, c, task)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["vision"] == built["vision"]  # from init.vision
    assert saved["model"]["lm"] == json.loads(c.model.lm.to_json_best_effort())  # no init.lm: the config's own
    assert saved["init"]["vision"] == str(tmp_path / "saved_tower") and saved["total_steps"] == c.total_steps
    workdir_lib.write_config(tmp_path, c)  # a task without parts of its own (contrastive): the config as it is
    assert json.loads((tmp_path / "config.json").read_text())["model"]["vision"]["width"] == c.model.vision.width


def test_a_loaded_tower_made_for_another_image_size_is_said(tmp_path, capsys, monkeypatch):
    """The run feeds 64x64 images to a tower converted for 48x64: said, as an imported VLM's start says it."""
    from vitmm.train import tasks, vlm_start

    c = _vlm_config(tmp_path, **{"input.image_size": 64})
    tower = dict(c.model.vision.to_dict())
    folder = {"model": {"image": tower}, "input": {"image_size": [48, 64]}}
    monkeypatch.setattr(tasks.ckpt_lib, "load_config", lambda path: folder)
    vlm_start.vlm_parts(c, say=True)
    assert capsys.readouterr().out.splitlines() == [
        f"input.image_size 64: the tower saved in {tmp_path / 'saved_tower'} was made for input.image_size [48, 64]; "
        "the run feeds it 64 (its positions fitted to that grid)"]
    folder["input"]["image_size"] = [64, 64]  # the same size, either way written: nothing to say
    vlm_start.vlm_parts(c, say=True)
    assert capsys.readouterr().out == ""


def test_a_missing_init_lm_folder_is_said_to_be_missing(tmp_path):
    """init.lm=a folder that is not there said '… has no tokenizer.json; convert the LM', not that it is missing."""
    from vitmm.train import tasks, vlm_start

    c = _vlm_config(tmp_path, **{"init.lm": str(tmp_path / "gone")})
    expected = (f"init.lm={tmp_path / 'gone'} does not exist; the run reads its lm settings (and at the start its "
                "weights) from that folder: restore it there, or pass --config.init.lm=its new place.")
    for read in (tasks.tokenizer_for, vlm_start.vlm_parts):
        with pytest.raises(FileNotFoundError) as err:
            read(c)
        assert str(err.value) == expected
