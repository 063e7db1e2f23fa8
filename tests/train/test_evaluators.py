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
