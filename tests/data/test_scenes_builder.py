"""The scenes TFDS builder: splits, features, offline array_record build, config names."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from vitmm.data import scenes, scenes_builder


def test_build_has_splits_features_and_version(data_dir, small_name):
    builder = scenes_builder.prepare(small_name, data_dir)
    info = builder.info
    assert str(info.version) == "1.0.0" and "Synthetic scenes" in info.description
    assert {k: info.splits[k].num_examples for k in ("train", "validation", "test")} == \
        {"train": 64, "validation": 16, "test": 10}
    assert info.file_format == tfds.core.file_adapters.FileFormat.ARRAY_RECORD
    assert info.metadata["label_names"] == ["circle", "square", "triangle", "star"]


def test_records_match_the_generator(data_dir, small_name):
    source = tfds.data_source(f"scenes/{small_name}", split="validation", data_dir=data_dir)
    ex = source[3]
    # Records are stored in shuffled order; find the generator index by its caption.
    by_caption = {scenes.generate("easy", 32, i, "validation")["caption"]: i for i in range(16)}
    index = by_caption[ex["caption"].decode()]
    ref = scenes.generate("easy", 32, index, "validation")
    np.testing.assert_array_equal(ex["image"], ref["image"])  # PNG is lossless
    assert [q.decode() for q in ex["questions"]] == ref["questions"]
    assert [scenes.SHAPES[i] for i in ex["objects"]["shape"]] == ref["objects"]["shape"]
    np.testing.assert_array_equal(ex["shape_counts"], ref["shape_counts"])
    assert int(ex["label"]) == ref["label"]


def test_prepare_is_idempotent(data_dir, small_name):
    builder = scenes_builder.prepare(small_name, data_dir)
    assert builder.is_prepared()
    files = sorted(p.name for p in builder.data_path.iterdir())
    scenes_builder.prepare(small_name, data_dir)  # no rebuild, same files
    assert sorted(p.name for p in builder.data_path.iterdir()) == files


def test_config_names():
    assert scenes_builder.config_from_name("hard_224").num_train == 4000
    cfg = scenes_builder.config_from_name("medium_48_100_10_10_s3")
    assert (cfg.difficulty, cfg.resolution, cfg.num_train, cfg.seed) == ("medium", 48, 100, 3)
    assert {c.name for c in scenes_builder.Scenes.BUILDER_CONFIGS} >= {"easy_32", "medium_64", "hard_224"}
    for bad in ("extreme_64", "easy", "easy_8", "easy_64_1"):
        with pytest.raises(ValueError, match="Unknown scenes config"):
            scenes_builder.config_from_name(bad)
