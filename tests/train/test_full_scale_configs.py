"""Full-scale configs: they build at full size, and their smoke variant trains one step on a
COCO-captions-shaped dataset read without TensorFlow (the read-only path a real COCO takes)."""

import io
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from vitmm import config_args, tree
from vitmm.models import two_towers
from vitmm.train import trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(name, arg=None):
    return config_args.load(ROOT / "configs" / f"{name}.py", arg)


def _png(seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="session")
def fake_coco(tmp_path_factory):
    """A tiny dataset named coco_captions with COCO's caption layout, built offline."""
    with tfds.core.registered.skip_registration():

        class CocoCaptions(tfds.core.GeneratorBasedBuilder):
            VERSION = tfds.core.Version("1.1.0")
            BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="2014")]  # as the real one

            def _info(self):
                return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                    "image": tfds.features.Image(encoding_format="png"),
                    "image/id": np.int64,
                    "captions": tfds.features.Sequence({"id": np.int64, "text": tfds.features.Text()}),
                }))

            def _split_generators(self, dl_manager):
                return {"train": self._generate_examples(0, 24), "val": self._generate_examples(100, 16)}

            def _generate_examples(self, start, n):
                for i in range(start, start + n):
                    yield i, {"image": _png(i), "image/id": i,
                              "captions": {"id": [2 * i, 2 * i + 1],
                                           "text": [f"photo number {i}", f"picture {i} of things"]}}

    data_dir = tmp_path_factory.mktemp("tfds")
    CocoCaptions(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return str(data_dir)


@pytest.mark.parametrize("name, expected_millions", [("clip_b16_coco", (120, 130)),
                                                     ("siglip_b16", (175, 185)),
                                                     ("clip_scenes:scale=b16,attn=xla", (120, 130)),
                                                     ("siglip_scenes:scale=b16,attn=xla", (175, 180))])
def test_full_size_models_build(name, expected_millions):
    c = _config(*name.split(":"))
    model = two_towers.TwoTowers(**c.model.to_dict())
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)),
                            jnp.zeros((1, c.model.text.max_len), jnp.int32))
    millions = tree.count(shapes["params"]) / 1e6
    lo, hi = expected_millions
    assert lo < millions < hi, millions  # byte vocabulary: no 49k/32k token embedding table
    assert c.model.image.dtype_mm == "bfloat16" and c.model.text.dtype_mm == "bfloat16"
    assert c.model.image.get("scan") or c.model.image.attn_impl == "xla"  # the scenes job at GPU scale, on a CPU
    for scenes in ("clip_scenes", "siglip_scenes"):
        assert _config(scenes, "scale=b16").model.image.attn_impl == "cudnn"  # its default


def test_coco_shaped_examples_read_and_preprocess_as_the_configs_train_and_evaluate(fake_coco):
    """The read-only TFDS path and each config's pp on COCO's caption layout (one caption of an
    image's several for training; the evaluators' pairs): what a real COCO takes. The training step
    on it is the slow test below (a one-block SigLIP step is in test_trainer)."""
    from vitmm.data import pipeline, preprocess
    from vitmm.train import pp_template, tasks

    for name in ("clip_b16_coco", "siglip_b16"):
        c = _config(name, "smoke")
        source = pipeline.source_for({"name": c.input.data.name, "split": c.input.data.split, "data_dir": fake_coco})
        pp = preprocess.parse(pp_template.host_pp_and_device_affine(c)[0], tasks.tokenizer_for(c))
        ex = pp(source[0], np.random.default_rng(0))
        assert ex["image"].shape[:2] == (32, 32) and ex["caption_tokens"].shape == (c.model.text.max_len,), name
        for ev in c.evals.values():
            data = {**dict(ev.data), "data_dir": fake_coco}
            assert len(pipeline.source_for(data, keys=("image", "captions"))) == 16, name


# Each config's smoke run on the fake COCO (~14-18 s each): the reader and pp are tested above
@pytest.mark.slow
@pytest.mark.parametrize("name", ["clip_b16_coco", "siglip_b16"])
def test_smoke_step_on_coco_shaped_data(tmp_path, fake_coco, name):
    c = _config(name, "smoke")
    with c.unlocked():
        c.input.data_dir = fake_coco
        for ev in c.evals.values():
            ev.data.data_dir = fake_coco
    summary = trainer.train(c, tmp_path)
    assert summary["final_step"] == 1 and np.isfinite(summary["history"][0]["loss"])
    assert {"retrieval/i2t_r1", "val/loss"} <= set(summary["evals"])


@pytest.mark.parametrize("name", ["clip_b16_coco", "siglip_b16"])
def test_coco_retrieval_scores_every_caption_of_an_image(fake_coco, name):
    """The configs' retrieval reads each image's list of captions (2 an image in the fake COCO, ~5 in
    the real one): 16 images, 32 captions, as published COCO R@k counts them; val_loss 16 pairs."""
    from vitmm.data.tokenizer import ByteTokenizer
    from vitmm.train import evaluators as eval_lib

    c = _config(name, "smoke")
    model = two_towers.TwoTowers(
        image=dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=8, pool="gap", class_token=False),
        text=dict(vocab_size=259, max_len=32, width=32, depth=1, mlp_dim=64, num_heads=2, causal=True, pool="eot"),
        embed_dim=16)
    params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), jnp.zeros((1, 32), jnp.int32))["params"]
    evals_config = {k: {**ev.to_dict(), "data": {**ev.data.to_dict(), "data_dir": fake_coco}, "num_examples": 16}
                    for k, ev in c.evals.items()}
    evals = eval_lib.from_config(evals_config, model, 32, ByteTokenizer(), c.loss, 32)
    out = evals["retrieval"].run(params)
    assert out["examples"] == 16 and out["caption_examples"] == 32
    assert evals["retrieval"].embeddings.get(params)["txt2img"].tolist() == np.repeat(np.arange(16), 2).tolist()
    assert len(evals["val"].embeddings.get(params)["ztxt"]) == 16
