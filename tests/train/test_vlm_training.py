"""VLM training through the same loop: stages freeze what they should, the tower comes from a
CLIP run of `vitmm.train`, and the QA evaluator reports accuracy per question kind."""

import pathlib

import jax
import numpy as np
import pytest

from vitmm import config_args
from vitmm.train import checkpoint as ckpt_lib
from vitmm.train import config_base, trainer


def _config(name, arg, data_dir, **overrides):
    path = pathlib.Path(__file__).resolve().parents[2] / "configs" / f"{name}.py"
    return config_base.with_data_dir(config_args.load(path, arg, **overrides), data_dir)


def test_stages_train_what_they_should_from_a_clip_tower(tmp_path, data_dir, clip_smoke_run):
    clip_dir = str(clip_smoke_run.workdir)
    clip_img = ckpt_lib.load_params(clip_dir)["img"]

    stage1 = _config("vlm_scenes", "smoke,connector=pool,budget=4", data_dir,
                     **{"init.vision": clip_dir, "init.allow_random_tower": False})
    summary = trainer.train(stage1, tmp_path / "s1")
    assert {"qa/accuracy", "qa/acc_exists", "qa/examples"} <= set(summary["evals"])
    assert all(np.isfinite(h["loss"]) and 0 <= h["token_acc"] <= 1 for h in summary["history"])
    params = ckpt_lib.load_params(tmp_path / "s1")
    jax.tree.map(np.testing.assert_array_equal, params["tower"], clip_img)  # frozen, from CLIP

    # Stage 2 starts from stage 1; the LM now trains, the tower still does not.
    stage2 = _config("vlm_scenes", "smoke,connector=pool,budget=4,stage=2", data_dir,
                     **{"init.vision": clip_dir, "init.checkpoint": str(tmp_path / "s1"),
                        "init.allow_random_tower": False})
    trainer.train(stage2, tmp_path / "s2")
    after = ckpt_lib.load_params(tmp_path / "s2")
    jax.tree.map(np.testing.assert_array_equal, after["tower"], clip_img)
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), after["language"], params["language"])
    assert any(jax.tree.leaves(moved))


def test_stage1_keeps_the_language_model_fixed(tmp_path, data_dir):
    c = _config("vlm_scenes", "smoke,connector=mlp", data_dir, total_steps=2)
    with c.unlocked():
        c.evals = type(c.evals)()
    stopped = trainer.train(c, tmp_path / "a", stop_at=1)
    first = ckpt_lib.load_params(tmp_path / "a")
    trainer.train(c, tmp_path / "a")
    second = ckpt_lib.load_params(tmp_path / "a")
    assert stopped["final_step"] == 1
    jax.tree.map(np.testing.assert_array_equal, second["language"], first["language"])
    changed = jax.tree.map(lambda x, y: bool(np.any(x != y)), second["project"], first["project"])
    assert all(jax.tree.leaves(changed))


def test_a_vlm_needs_a_pretrained_tower(tmp_path, data_dir):
    c = _config("vlm_scenes", "smoke", data_dir, **{"init.allow_random_tower": False})
    with pytest.raises(ValueError, match="init.vision=WORKDIR"):
        trainer.train(c, tmp_path)
