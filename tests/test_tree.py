"""The pytree floor: names, counts and the one mismatch report."""

import numpy as np

from vitmm import tree


def test_flatten_names_leaves_by_path_and_unflatten_inverts_it():
    t = {"a": {"b": np.zeros((2, 3)), "c": {"d": np.ones(4)}}, "e": np.zeros(())}
    flat = tree.flatten(t)
    assert sorted(flat) == ["a/b", "a/c/d", "e"]
    back = tree.unflatten(flat)
    assert back["a"]["c"]["d"] is t["a"]["c"]["d"] and tree.count(back) == 6 + 4 + 1


def test_mismatches_lists_missing_unused_and_misshaped_with_shapes_and_skips():
    model = {"a": np.zeros((2, 3)), "b": {"c": np.zeros(4)}, "d": np.zeros(1)}
    ckpt = {"a": np.zeros((3, 2)), "b": {"c": np.zeros(4)}, "e": np.zeros(5)}
    assert tree.mismatches(model, ckpt) == [
        "  missing in checkpoint: d (1,)", "  unused from checkpoint: e (5,)",
        "  shape mismatch: a: model (2, 3) vs checkpoint (3, 2)"]
    assert tree.mismatches(model, ckpt, skip=lambda k: k in ("a", "d", "e")) == []
    assert tree.mismatches(model, model) == []
