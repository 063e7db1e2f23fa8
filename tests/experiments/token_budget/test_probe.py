"""The linear probes of the token-budget tower (experiments/token_budget/probe.py): labels read from
the scene generator, probes that find a label that is in the features and not one that is not,
and the command line on a tiny random tower."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.token_budget import probe
from vitmm import checkpoint as ckpt_lib
from vitmm.data import pipeline, scenes
from vitmm.models.vit import ViT

DATA = "scenes/easy-heldout_32_12_8_8_s0"  # a few images, made in seconds


def test_labels_are_the_scene_facts():
    """A hand-made scene: two shapes in one region (left out of that region's probe), one alone."""
    objs = [dict(shape=["circle", "star", "star"], color=["red", "blue", "red"],
                 region=["top left", "top left", "bottom right"])]
    labels = probe.scene_labels(scenes.DIFFICULTIES["hard"], objs)
    value = {g: {h: (c[y[0]], bool(m[0])) for h, c, y, m in heads} for g, heads in labels.items()}
    assert [h for h, (c, _) in value["shape present"].items() if c == "yes"] == ["circle", "star"]
    assert [h for h, (c, _) in value["colour present"].items() if c == "yes"] == ["red", "blue"]
    assert value["object count"]["count"] == (3, True)
    assert value["shape at region"]["bottom right"] == ("star", True)
    assert value["colour at region"]["bottom right"] == ("red", True)
    assert value["shape at region"]["top left"][1] is False and value["shape at region"]["center"] == ("none", True)
    assert value["shape at region (occupied)"]["center"][1] is False
    assert value["shape at region (occupied)"]["bottom right"] == ("star", True)


def test_records_are_matched_to_the_generators_scenes(tmp_path):
    """TFDS stores a build shuffled: each record's objects are the generated scene's with its pixels."""
    diff, objs = probe.scene_objects(DATA, "validation", 8, str(tmp_path))
    source = pipeline.get_source(DATA, "validation", str(tmp_path), keys=("objects",))
    assert diff == scenes.DIFFICULTIES["easy-heldout"] and len(objs) == 8
    for i, o in enumerate(objs):
        stored = source[i]["objects"]
        assert o["shape"] == [scenes.SHAPES[k] for k in stored["shape"]]
        assert o["region"] == [scenes.REGIONS[k] for k in stored["region"]]
    labels = probe.scene_labels(diff, objs)
    assert [h for h, *_ in labels["shape at region"]] == list(scenes.REGIONS_2X2)  # easy's questions' layout


def test_a_probe_finds_a_label_in_the_features_and_nothing_in_noise():
    rng = np.random.default_rng(0)
    n = {"train": 300, "validation": 100, "test": 400}
    y = {s: (rng.random(k) < 0.3).astype(int) for s, k in n.items()}
    c = {s: rng.integers(0, 3, k) for s, k in n.items()}
    labels = {s: {"shape present": [("x", ("no", "yes"), y[s], np.ones(k, bool))],
                  "object count": [("count", (1, 2, 3), c[s], np.ones(k, bool))]} for s, k in n.items()}
    signal = {s: np.concatenate([y[s][:, None], np.eye(3)[c[s]]], 1)[:, None] + 0.1 * rng.normal(size=(k, 1, 4))
              for s, k in n.items()}
    noise = {s: rng.normal(size=(k, 1, 4)) for s, k in n.items()}
    for feats, found in ((signal, True), (noise, False)):
        res = probe.probe(feats, labels, [1.0, 0.01], iters=30, bootstrap=200)["mean-pooled"]["groups"]
        for group, g in res.items():
            if found:
                assert g["accuracy"]["value"] > 0.99 and g["minus_majority_ci"][0] > 0.2, (group, g)
            else:
                assert abs(g["accuracy"]["value"] - g["majority"]) < 0.06, (group, g)
        if not found:
            assert abs(res["shape present"]["balanced accuracy"]["value"] - 0.5) < 0.06
            assert res["shape present"]["base_rate"] == pytest.approx(y["test"].mean())


def test_the_command_line_writes_its_report_and_refuses_a_missing_tower(tmp_path, capsys):
    with pytest.raises(SystemExit, match="No tower in"):
        probe.main(["--out", str(tmp_path / "empty")])
    cfg = dict(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=8, pool="gap", class_token=False,
               posemb="sincos2d")
    params = ViT(**cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))["params"]
    writer = ckpt_lib.Checkpointer(tmp_path / "out/tower", keep=1, async_save=False)
    config = {"model": {"image": cfg}, "input": {"image_size": 32, "data": {"name": DATA}}, "total_steps": 1}
    writer.save(1, {"params": {"img": params}}, {}, {"step": 1, "config": json.dumps(config)})
    writer.close()
    probe.main(["--out", str(tmp_path / "out"), "--data_dir", str(tmp_path / "tfds"), "--train_images", "12",
                "--val_images", "8", "--lams", "0.1", "--iters", "5"])
    text = (tmp_path / "out/probe.md").read_text()
    assert "12 train, 8 validation, 8 test" in text and "shape at region (occupied)" in text and "λ" in text
    written = json.loads((tmp_path / "out/probe.json").read_text())
    assert set(written["probes"]) == {"mean-pooled", "flattened grid"} and written["grid"] == "4×4"
