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
    return ml_collections.ConfigDict({"task": task, "init": {init_key: str(folder)},
                                      "input": {"image_mean": None, "image_std": None, **inp}})


def test_a_partial_override_keeps_the_users_half_and_fills_the_other_from_the_checkpoint(tmp_path):
    assert pp_template.image_normalization(_config(tmp_path)) == (CLIP_MEAN, CLIP_STD)
    assert pp_template.image_normalization(_config(tmp_path, image_std=(0.2,) * 3)) == (CLIP_MEAN, (0.2,) * 3)
    assert pp_template.image_normalization(_config(tmp_path, image_mean=(0.4,) * 3)) == ((0.4,) * 3, CLIP_STD)
