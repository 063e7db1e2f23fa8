"""The images' normalisation a run's pp and evaluators use: the user's, else what the tower's
checkpoint records, each of mean and std on its own."""

import json

import ml_collections

from vitmm import checkpoint as ckpt_lib
from vitmm.train import pp_template

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _config(tmp_path, task="vlm", init_key="vision", **inp):
    folder = tmp_path / "tower"
    folder.mkdir(exist_ok=True)
    (folder / ckpt_lib.PINNED_SETTINGS).write_text(json.dumps({"input": {"image_mean": CLIP_MEAN,
                                                                         "image_std": CLIP_STD}}))
    return ml_collections.ConfigDict({"task": task, "init": {init_key: str(folder)}, "model": {},
                                      "input": {"image_mean": None, "image_std": None, **inp}})


def test_a_partial_override_keeps_the_users_half_and_fills_the_other_from_the_checkpoint(tmp_path):
    assert pp_template.image_normalization(_config(tmp_path)) == (CLIP_MEAN, CLIP_STD)
    assert pp_template.image_normalization(_config(tmp_path, image_std=(0.2,) * 3)) == (CLIP_MEAN, (0.2,) * 3)
    assert pp_template.image_normalization(_config(tmp_path, image_mean=(0.4,) * 3)) == ((0.4,) * 3, CLIP_STD)


def test_a_two_tower_run_from_a_converted_clip_normalises_as_it_records_and_evaluates_the_same(tmp_path):
    """``{normalize}`` is CLIP's statistics for ``init.checkpoint`` = a converted CLIP, and stays
    ``value_range(-1, 1)`` (vitmm's configs' numbers) without one; evaluators repeat the run's op."""
    pp = "decode|resize(8)|{normalize}|keep('image')"
    converted = _config(tmp_path, task="contrastive", init_key="checkpoint", pp=pp, image_size=8)
    assert pp_template.value_op(converted) == f"normalize({CLIP_MEAN}, {CLIP_STD})"
    stock = ml_collections.ConfigDict({"task": "contrastive", "init": {"checkpoint": None},
                                       "input": {"pp": pp, "image_size": 8}, "model": {}})
    assert pp_template.value_op(stock) == "value_range(-1, 1)"
    own = ml_collections.ConfigDict({**stock.to_dict(), "input": {"pp": "decode|normalize(0.4, std=0.2)",
                                                                  "image_size": 8}})
    assert pp_template.value_op(own) == "normalize(0.4, std=0.2)"
