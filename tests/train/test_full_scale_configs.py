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


@pytest.fixture(scope="module")
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
                                                     ("clip_scenes:scale=b16,attn=xla", (120, 130))])
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
    assert _config("clip_scenes", "scale=b16").model.image.attn_impl == "cudnn"  # its default


def test_loop_overhead_times_the_loop_and_its_bare_step(load_script, clip_smoke_run):
    """``experiments/loop_overhead.py``: the trainer's logged speed after the skipped intervals and
    the same compiled step alone (``trainer.build``)."""
    script = load_script("experiments/loop_overhead.py")
    # 4 steps, the smoke's own: the step compiles to the program the session's smoke run cached.
    out = script.main(["--config", "configs/clip_scenes.py:smoke", "--steps", "4",
                       "--log_every", "1", "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    assert out["loop"]["intervals"] == 2 and out["batch_size"] == 16
    assert out["loop"]["img_per_s"] > 0 and out["bare"]["img_per_s"] > 0
    assert out["ratio"] == out["loop"]["img_per_s"] / out["bare"]["img_per_s"] and 0.2 < out["ratio"] < 2
    with pytest.raises(SystemExit, match="too few intervals"):
        script.main(["--config", "configs/clip_scenes.py:smoke", "--steps", "4", "--log_every", "2",
                     "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    bare = script.main(["--config", "configs/clip_scenes.py:smoke", "--steps", "4", "--log_every", "2",
                        "--bare_only", "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    assert bare["loop"] is None and bare["ratio"] is None and bare["bare"]["img_per_s"] > 0


def test_resume_check_compares_a_resumed_run_step_by_step(load_script, clip_smoke_run):
    """``experiments/resume_check.py`` (on a GPU it separated nondeterminism from the resume): on
    this CPU the resumed and the repeated runs equal the straight one at every step."""
    script = load_script("experiments/resume_check.py")
    out = script.main(["--config", "configs/clip_scenes.py:smoke", "--half", "2", "--repeat",
                       "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    assert out["resume_exact"] and out["steps"] == 4 and out["stopped_at"] == 2
    assert out["repeat"] == {"max_loss_difference": 0.0, "first_differing_step": None}
    assert len(set(out["param_checksums"].values())) == 1
    a, b = {1: 1.0, 2: 2.0, 3: 3.0}, {1: 1.0, 2: 2.5, 3: 2.0}
    assert script.compare(a, b, range(1, 4)) == {"max_loss_difference": 1.0, "first_differing_step": 2}


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
