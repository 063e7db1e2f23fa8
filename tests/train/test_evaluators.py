"""The contrastive evaluators on tiny data the tests write and on hand-made embeddings with known
answers: no training run, seconds in all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from vitmm.data.tokenizer import ByteTokenizer
from vitmm.models import two_towers
from vitmm.train import evaluators as eval_lib

NATIVE = dict(max_num_patches=16, seq_len=64, max_images=8)


@pytest.fixture(scope="module")
def tiny():
    """A two-tower model small enough to embed a few images in well under a second, and its params."""
    model = two_towers.TwoTowers(
        image=dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=8, pool="gap", class_token=False,
                   posemb="sincos2d"),
        text=dict(vocab_size=259, max_len=32, width=32, depth=1, mlp_dim=64, num_heads=2, causal=True, pool="eot"),
        embed_dim=16)
    params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), jnp.zeros((1, 32), jnp.int32))["params"]
    return model, params


def write_csv(folder, captions, images=None) -> str:
    """A CSV of ``filepath,title`` rows (open_clip's layout); row i shows image ``images[i]`` (default i)."""
    images = list(range(len(captions))) if images is None else images
    for i in set(images):
        pixels = np.random.default_rng(i).integers(0, 255, (24, 40, 3), np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    rows = ["filepath,title"] + [f"{i}.png,{c}" for i, c in zip(images, captions, strict=True)]
    (folder / "val.csv").write_text("\n".join(rows) + "\n")
    return str(folder / "val.csv")


def build(model, evals: dict) -> dict:
    return eval_lib.from_config(evals, model, 32, ByteTokenizer(), "softmax", 32)


@pytest.mark.parametrize("native", [None, NATIVE], ids=["square", "native"])
def test_a_bad_raw_record_is_left_out_of_either_evaluation_path(tmp_path, tiny, native):
    """A CSV row with an empty caption (a ``Skipped`` record): the square path masks it, the native
    (NaFlex) path leaves it out the same way; both score the other five."""
    model, params = tiny
    csv = write_csv(tmp_path, [f"caption {i}" if i != 3 else "" for i in range(6)])
    evals = build(model, {"retrieval": dict(type="retrieval", data=dict(csv=csv), native=native,
                                            embed_batch_size=4)})
    out = evals["retrieval"].run(params)
    assert out["examples"] == 5 and 0 <= out["i2t_r1"] <= out["i2t_r5"] <= 1


def test_zero_shot_runs_on_a_dataset_of_images_and_labels_only(tiny, monkeypatch):
    """Zero-shot on a classification split (cifar10-like records: image, label; no caption) with
    ``class_names``: the pass reads no caption and tokenizes none; each image goes to its class's
    nearest prompt embedding."""
    from vitmm.data import pipeline

    model, params = tiny
    records = [{"image": np.full((32, 32, 3), 40 * (i % 3), np.uint8), "label": np.int64(i % 3)} for i in range(7)]
    asked = []
    monkeypatch.setattr(pipeline, "source_for", lambda data, keys=None: asked.append(keys) or records)
    evals = build(model, {"zs": dict(type="zeroshot", data=dict(name="cifar10", split="test"),
                                     class_names=["a", "b", "c"], embed_batch_size=4)})
    out = evals["zs"].run(params)
    assert asked == [("image", "label")] and out["examples"] == 7 and out["chance"] == pytest.approx(1 / 3)
    # the same prediction by hand: images alone through the image tower, prompt-ensembled classes
    zimg = np.asarray(model.apply({"params": params}, jnp.asarray([r["image"] for r in records]) / 127.5 - 1)[0])
    zs = evals["zs"]
    classes = np.stack([zs.embeddings.texts(params, zs.prompts(c)).mean(0) for c in zs.class_names])
    classes /= np.linalg.norm(classes, axis=1, keepdims=True)
    expected = ((zimg @ classes.T).argmax(1) == np.arange(7) % 3).mean()
    assert out["accuracy"] == pytest.approx(expected)
