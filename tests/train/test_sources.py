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


def test_an_init_checkpoint_naming_a_tokenizer_elsewhere_is_unchanged_until_that_file_changes(tmp_path):
    """A stage-1 workdir of an imported VLM names the imported folder's tokenizer and holds none: pin
    copies the named one, and changed_since_pinned compares with the same file (it once compared with
    the workdir's own, absent, and said "has changed" on every resume)."""
    (tmp_path / "imported").mkdir()
    named = tmp_path / "imported/tokenizer.json"
    named.write_text("tok")
    stage1 = _folder(tmp_path / "s1", {"task": "vlm", "tokenizer": str(named)})
    config = ml_collections.ConfigDict({"init": {"checkpoint": str(stage1)}})
    assert sources.pin(tmp_path / "w", config) == ["checkpoint"]
    pinned = sources.with_pinned(config, tmp_path / "w")
    assert sources.changed_since_pinned(pinned) == []
    named.write_text("tok2")
    assert [line.split(" has ")[0] for line in sources.changed_since_pinned(pinned)] == [f"init.checkpoint={stage1}"]


def test_an_init_folder_without_settings_for_vision_or_lm_is_an_error(tmp_path):
    (tmp_path / "lm").mkdir()
    config = ml_collections.ConfigDict({"init": {"lm": str(tmp_path / "lm")}})
    with pytest.raises(FileNotFoundError, match="No checkpoint in"):
        sources.pin(tmp_path / "w", config)
    assert not (tmp_path / "w/sources/lm").exists()


def _vlm(data_dir, tower, **overrides):
    from vitmm import config_args
    from vitmm.train import trainer

    c = config_args.load(trainer.pathlib.Path(__file__).resolve().parents[2] / "configs/vlm_scenes.py",
                         "smoke,connector=pool,budget=4", **{"input.data_dir": data_dir, "init.vision": str(tower),
                                                             "init.allow_random_tower": False, **overrides})
    with c.unlocked():
        c.evals = ml_collections.ConfigDict()
    return c


def test_a_fresh_start_pins_the_folders_again_and_an_unpinned_folder_may_not_change(tmp_path, clip_smoke_run):
    """--restart over checkpoints none of which reads starts at step 0 from the folders as they are
    now, and pins them so; a workdir written before pinning keeps refusing another init.vision."""
    import shutil

    from vitmm.train import trainer
    from vitmm.train import workdir as workdir_lib

    tower, work = tmp_path / "tower", tmp_path / "vlm"
    shutil.copytree(clip_smoke_run.workdir, tower, ignore=shutil.ignore_patterns("lock"))
    config = _vlm(clip_smoke_run.data_dir, tower)
    trainer.train(config, work, stop_at=1)
    (work / "sources").rename(tmp_path / "pins")  # as a workdir from before pinning
    shutil.copytree(tower, tmp_path / "other")
    with pytest.raises(workdir_lib.ConfigChanged, match="would change init/vision"):
        trainer.train(_vlm(clip_smoke_run.data_dir, tmp_path / "other"), work, stop_at=2)
    (tmp_path / "pins").rename(work / "sources")

    saved = ckpt_lib.load_config(tower)  # the tower's folder written again with other image statistics
    saved["input"]["image_mean"], saved["input"]["image_std"] = [0.1, 0.2, 0.3], [0.5, 0.5, 0.5]
    again = ckpt_lib.Checkpointer(tower, keep=5, async_save=False)
    again.save(100, {"params": ckpt_lib.load_params(tower)}, {}, {"step": 100, "config": json.dumps(saved)})
    again.close()
    for step in ckpt_lib.step_folders(work):  # and every checkpoint of the run damaged
        for part in (work / "checkpoints" / str(step)).iterdir():
            shutil.rmtree(part) if part.is_dir() else part.unlink()
    assert trainer.train(config, work, stop_at=1, restart=True)["final_step"] == 1
    assert ckpt_lib.load_config(work / "sources/vision")["input"]["image_mean"] == [0.1, 0.2, 0.3]


def test_an_init_checkpoint_of_weights_without_a_saved_config_is_not_pinned(tmp_path):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "weights/checkpoints", item_handlers={
            "state": ocp.StandardCheckpointHandler()}) as mngr:  # weights saved without vitmm's meta item
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": {"w": jnp.ones(2)}})))
    with pytest.raises(ValueError, match="carries no config"):
        ckpt_lib.load_config(tmp_path / "weights")
    config = ml_collections.ConfigDict({"init": {"checkpoint": str(tmp_path / "weights")}})
    assert sources.pin(tmp_path / "w", config) == []
    # nor an imported VLM's: a VLM run (and its --dry_run) starts from it as weights, its own config's model
    # (from_imported_vlm once read its config first and refused the run with "carries no config")
    from vitmm.train import imported_vlm

    vlm = ml_collections.ConfigDict({"task": "vlm", "init": {"checkpoint": str(tmp_path / "weights")}})
    assert imported_vlm.from_imported_vlm(vlm) is vlm
