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


def test_a_data_pp_with_clips_resize_and_crop_is_what_the_tower_sees(tmp_path, tiny):
    """CLIP's evaluation protocol in ``data.pp`` (shorter side, bicubic, centre crop) on 24x40
    images: the square resize the evaluator appends leaves the 32x32 crop as it is (it would
    otherwise squash and resample), so each embedding is the tower's on the cropped pixels."""
    from vitmm.data import preprocess

    model, params = tiny
    csv = write_csv(tmp_path, ["caption 0", "caption 1"])
    clip_pp = "decode|resize(32, method='bicubic', shorter=True)|center_crop(32)"
    evals = build(model, {"r": dict(type="retrieval", data=dict(csv=csv, pp=clip_pp))})
    zimg = evals["r"].embeddings.get(params)["zimg"]
    pp = preprocess.parse(f"{clip_pp}|value_range(-1, 1)")
    for i in range(2):
        image = pp({"image": (tmp_path / f"{i}.png").read_bytes()}, None)["image"]
        np.testing.assert_allclose(zimg[i], model.apply({"params": params}, jnp.asarray(image)[None])[0][0], atol=1e-5)


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


class Fixed:
    """Stands in for ``eval_embeddings.Embeddings``: hands the evaluator the embeddings a test wrote."""

    def __init__(self, **value):
        self.value = value

    def get(self, params):
        return self.value

    def clear(self):
        pass


def by_scores(scores, txt2img, tokens=None) -> Fixed:
    """Embeddings whose image-caption scores are ``scores [I, T]``: one-hot images, captions = columns."""
    scores = np.asarray(scores, np.float32)
    tokens = np.arange(scores.shape[1])[:, None] if tokens is None else np.asarray(tokens)[:, None]
    return Fixed(zimg=np.eye(len(scores), dtype=np.float32), ztxt=scores.T.copy(), tokens=tokens,
                 txt2img=np.asarray(txt2img), labels=-np.ones(len(scores)))


# 3 images x 2 captions (captions 0,1 describe image 0; 2,3 image 1; 4,5 image 2).
SCORES = [[0.9, 0.1, 0.8, 0.0, 0.2, 0.3],
          [0.5, 0.6, 0.4, 0.7, 0.1, 0.0],
          [0.3, 0.2, 0.1, 0.45, 0.05, 0.4]]
TXT2IMG = [0, 0, 1, 1, 2, 2]


def test_retrieval_with_several_captions_per_image_scores_as_clip_benchmark():
    """Image→text: a hit if any of the image's captions ranks in the top k of all 6; text→image:
    each caption over the 3 images. By hand: images 0 and 1 rank their own caption first, image 2
    ranks image 1's caption 3 first (0.45) and its own 5 second; captions 0, 3, 5 rank their image
    first, 1, 2, 4 another."""
    out = eval_lib.Retrieval(by_scores(SCORES, TXT2IMG)).run(None)
    assert out["i2t_r1"] == pytest.approx(2 / 3) and out["i2t_r5"] == 1.0
    assert out["t2i_r1"] == pytest.approx(3 / 6) and out["t2i_r5"] == 1.0
    # chance: 2 of 6 captions are an image's (r5: 5 of 6 drawn always hit); 1 of 3 images a caption's
    assert out["i2t_chance_r1"] == pytest.approx(1 / 3) and out["i2t_chance_r5"] == 1.0
    assert out["t2i_chance_r1"] == pytest.approx(1 / 3) and out["t2i_chance_r5"] == 1.0
    assert out["examples"] == 3 and out["caption_examples"] == 6 and "chance_r1" not in out
    # caption 4 word for word caption 1 (image 0's): image 0 is one of its images, and its top
    tied = eval_lib.Retrieval(by_scores(SCORES, TXT2IMG, tokens=[0, 1, 2, 3, 1, 5])).run(None)
    assert tied["t2i_r1"] == pytest.approx(4 / 6) and tied["i2t_r1"] == pytest.approx(2 / 3)
    assert tied["t2i_chance_r1"] == pytest.approx((4 * 1 / 3 + 2 * 2 / 3) / 6)


def test_retrieval_of_a_perfect_model_with_five_captions_per_image_is_one():
    """100 images, 5 noisy captions each, every caption nearest its own image: R@1 = 1 both ways
    (the row-per-caption scoring this replaced gave image→text 0.2)."""
    rng = np.random.default_rng(0)
    img = rng.normal(size=(100, 32))
    img /= np.linalg.norm(img, axis=1, keepdims=True)
    txt = np.repeat(img, 5, 0) + 0.05 * rng.normal(size=(500, 32))
    out = eval_lib.Retrieval(Fixed(zimg=img, ztxt=txt, tokens=np.arange(500)[:, None],
                                   txt2img=np.repeat(np.arange(100), 5), labels=-np.ones(100))).run(None)
    assert out["i2t_r1"] == out["t2i_r1"] == 1.0 and out["caption_examples"] == 500


def clip_metrics(zimg, ztxt) -> dict:
    """open_clip's ``get_clip_metrics`` (one caption per image), in numpy."""
    out = {}
    for name, logits in (("i2t", zimg @ ztxt.T), ("t2i", ztxt @ zimg.T)):
        ranking = np.argsort(-logits, axis=1)
        preds = np.nonzero(ranking == np.arange(len(logits))[:, None])[1]
        for k in (1, 5, 10):
            out[f"{name}_r{k}"] = float(np.mean(preds < k))
    return out


def test_retrieval_with_one_caption_per_image_equals_open_clip():
    """Distinct captions, one per image, no ties: exactly open_clip's numbers, and chance k/n."""
    rng = np.random.default_rng(1)
    zimg = rng.normal(size=(200, 16))
    ztxt = zimg + 0.9 * rng.normal(size=(200, 16))
    out = eval_lib.Retrieval(Fixed(zimg=zimg, ztxt=ztxt, tokens=np.arange(200)[:, None], txt2img=np.arange(200),
                                   labels=-np.ones(200))).run(None)
    assert {k: out[k] for k in clip_metrics(zimg, ztxt)} == clip_metrics(zimg, ztxt)
    assert 0 < out["i2t_r1"] < out["i2t_r5"] < out["i2t_r10"] < 1  # the test is not trivially at 0 or 1
    assert out["chance_r1"] == pytest.approx(1 / 200) and out["chance_r5"] == pytest.approx(5 / 200)
    assert out["chance_r10"] == pytest.approx(10 / 200)
    assert "caption_examples" not in out


@pytest.mark.parametrize("native", [None, NATIVE], ids=["square", "native"])
def test_raw_rows_that_show_the_same_image_are_one_image_with_several_captions(tmp_path, tiny, native):
    """A CSV of 3 images, each on 2 rows with its own caption (open_clip's layout): 3 images and 6
    captions, each caption pointing at the rows' image; val_loss still scores the 6 pairs."""
    model, params = tiny
    csv = write_csv(tmp_path, [f"caption {i}" for i in range(6)], images=[0, 1, 0, 2, 1, 2])
    evals = build(model, {"retrieval": dict(type="retrieval", data=dict(csv=csv), native=native, embed_batch_size=4)})
    emb = evals["retrieval"].embeddings.get(params)
    assert emb["zimg"].shape == (3, 16) and emb["ztxt"].shape == (6, 16)
    assert emb["txt2img"].tolist() == [0, 1, 0, 2, 1, 2]
    out = evals["retrieval"].run(params)
    assert out["examples"] == 3 and out["caption_examples"] == 6


@pytest.mark.parametrize("native", [None, NATIVE], ids=["square", "native"])
def test_captions_that_differ_only_past_max_len_are_different_captions(tmp_path, tiny, native):
    """Captions 0 and 1 share their first 40 bytes, so their 32 tokens (max_len) are the same: they
    are still two captions, each its own image's alone. Each of the 4 captions is then one of the 4
    images' own and chance R@1 is 1/4; counting caption 1 as image 0's too gave (2+2+1+1)/4/4 = 0.375."""
    model, params = tiny
    long = "a caption that runs on past the max_len of the text tower"
    csv = write_csv(tmp_path, [f"{long}: one", f"{long}: two", "short a", "short b"])
    evals = build(model, {"retrieval": dict(type="retrieval", data=dict(csv=csv), native=native)})
    emb = evals["retrieval"].embeddings.get(params)
    assert (emb["tokens"][0] == emb["tokens"][1]).all()  # the text tower reads the same ids
    assert list(emb["captions"]) == [f"{long}: one", f"{long}: two", "short a", "short b"]
    assert evals["retrieval"].run(params)["chance_r1"] == pytest.approx(1 / 4)


def test_a_records_list_of_captions_is_scored_caption_by_caption(tiny, monkeypatch):
    """``data.captions="captions/text"`` (TFDS coco_captions' layout): every caption of a record is
    embedded, as the text tower embeds it alone, and points at the record's image."""
    from vitmm.data import pipeline

    model, params = tiny
    counts = [5, 6, 5]
    records = [{"image": np.full((32, 32, 3), 60 * i, np.uint8),
                "captions": {"text": np.array([f"image {i} caption {c}".encode() for c in range(n)], object)}}
               for i, n in enumerate(counts)]
    monkeypatch.setattr(pipeline, "source_for", lambda data, keys=None: records)
    data = dict(name="coco_captions", split="val", captions="captions/text")
    evals = build(model, {"retrieval": dict(type="retrieval", data=data, embed_batch_size=4)})
    emb = evals["retrieval"].embeddings.get(params)
    assert emb["zimg"].shape == (3, 16) and emb["txt2img"].tolist() == [0] * 5 + [1] * 6 + [2] * 5
    alone = evals["retrieval"].embeddings.texts(params, [f"image 1 caption {c}" for c in range(6)])
    np.testing.assert_allclose(emb["ztxt"][5:11], alone, atol=1e-5)
    assert list(emb["captions"][5:11]) == [f"image 1 caption {c}" for c in range(6)]
    assert evals["retrieval"].run(params)["caption_examples"] == 16


def test_the_final_table_shows_each_directions_chance_where_they_differ():
    from vitmm.train.__main__ import summary_table

    evals = {"retrieval/i2t_r1": 0.5, "retrieval/t2i_r1": 0.4, "retrieval/i2t_chance_r1": 0.25,
             "retrieval/t2i_chance_r1": 0.125}
    lines = summary_table(dict(evals=evals, final_step=3, checkpoints=[3], workdir="w")).splitlines()
    assert lines[1].split()[-2:] == ["0.500", "0.250"] and lines[2].split()[-2:] == ["0.400", "0.125"]


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_val_loss_scores_every_pair_the_last_batch_padded_and_masked(loss):
    """10 pairs in batches of 4: two full batches and the last 2 pairs as a batch of their own
    (padded to 4, the padding masked out), the mean over the 10 pairs (float32, 1e-6)."""
    from vitmm import losses

    rng = np.random.default_rng(0)
    zimg, ztxt = (z / np.linalg.norm(z, axis=1, keepdims=True) for z in rng.normal(size=(2, 10, 8)).astype(np.float32))
    emb = Fixed(zimg=zimg, ztxt=ztxt, tokens=np.arange(10)[:, None], txt2img=np.arange(10), labels=-np.ones(10))
    out = eval_lib.ValLoss(emb, loss=loss, batch_size=4).run(None, t=10.0, b=-5.0)
    fn = (lambda zi, zt: losses.softmax_loss(zi, zt, 10.0)) if loss == "softmax" else (
        lambda zi, zt: losses.sigmoid_loss(zi, zt, 10.0, -5.0))
    per_batch = [float(fn(zimg[i : i + 4], ztxt[i : i + 4])) for i in (0, 4, 8)]
    assert out["loss"] == pytest.approx((4 * per_batch[0] + 4 * per_batch[1] + 2 * per_batch[2]) / 10, rel=1e-6)
    assert out["examples"] == 10 and out["batches"] == 3


def test_val_loss_with_several_captions_per_image_puts_one_pair_per_image_in_a_batch():
    """4 images x 2 captions, side by side as a record's list gives them ([0, 0, 1, 1, ...]), a
    perfect model (each caption its image's embedding, t = 100), batches of 4: each batch holds
    the 4 images once and the loss is ~0 (1e-6). In the split's order a batch held images
    0, 0, 1, 1, each copy the other's negative, and the loss was log 2 = 0.693."""
    zimg = np.eye(4, dtype=np.float32)
    txt2img = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    emb = Fixed(zimg=zimg, ztxt=zimg[txt2img], tokens=np.arange(8)[:, None], txt2img=txt2img, labels=-np.ones(4))
    out = eval_lib.ValLoss(emb, batch_size=4).run(None, t=100.0)
    assert out["loss"] == pytest.approx(0.0, abs=1e-6) and out["examples"] == 8 and out["batches"] == 2
    assert eval_lib._round_robin([0, 0, 1, 2, 2, 2]).tolist() == [0, 2, 3, 1, 4, 5]
    assert eval_lib._round_robin(np.arange(5)).tolist() == list(range(5))


def test_zeroshot_and_retrieval_embed_in_batches_of_their_batch_size(tmp_path, tiny, monkeypatch):
    """``evals.<name>.batch_size`` of zeroshot/retrieval sets the embedding pass's batches (lowered
    to fit memory, it must not be 256 regardless); a split shared with val_loss embeds in the
    smallest batch asked for, val_loss's own batch_size staying its loss's batch. Settings an
    evaluator would ignore, or both batch keys at odds, are refused in one line."""
    model, params = tiny
    csv = write_csv(tmp_path, [f"caption {i}" for i in range(6)])
    data = dict(csv=csv)
    evals = build(model, {"retrieval": dict(type="retrieval", data=data, batch_size=2),
                          "val": dict(type="val_loss", data=data, batch_size=4, embed_batch_size=3)})
    assert evals["retrieval"].embeddings.batch_size == 2 and evals["val"].batch_size == 4
    assert evals["val"].embeddings is evals["retrieval"].embeddings
    shapes = []
    embeddings = evals["retrieval"].embeddings
    embed = embeddings._embed_images
    monkeypatch.setattr(embeddings, "_embed_images", lambda p, x: shapes.append(x.shape) or embed(p, x))
    assert evals["retrieval"].run(params)["examples"] == 6 and {s[0] for s in shapes} == {2}
    assert build(model, {"zs": dict(type="zeroshot", data=data, class_names=["a"], batch_size=5)})[
        "zs"].embeddings.batch_size == 5
    with pytest.raises(ValueError, match=r"evals.r: batch_size=2 and embed_batch_size=4 both set .* set one"):
        build(model, {"r": dict(type="retrieval", data=data, batch_size=2, embed_batch_size=4)})
    with pytest.raises(ValueError, match=r"evals.r \(retrieval\) has no setting\(s\) \['bach_size'\]; it takes"):
        build(model, {"r": dict(type="retrieval", data=data, bach_size=2)})


class Prompts(Fixed):
    """Embeddings with a text tower that maps each prompt string to a fixed vector."""

    def __init__(self, vectors: dict, **value):
        super().__init__(**value)
        self.vectors = vectors

    def texts(self, params, strings):
        return np.stack([self.vectors[s] for s in strings])


def test_zero_shot_accuracy_on_known_embeddings():
    """Class a's two prompts are e0 and e1, b's both e0, c's both e2: a's prompt mean (0.5, 0.5, 0)
    must be renormalised, or image 0 (0.6, 0.55, 0) goes to b (0.6 > 0.575) instead of a (0.81).
    Image 3 (e1) is a's nearest but labelled b; image 4 has no label and is not scored."""
    e = np.eye(3, dtype=np.float32)
    vectors = {"a one.": e[0], "a two.": e[1], "b one.": e[0], "b two.": e[0], "c one.": e[2], "c two.": e[2]}
    zimg = np.array([[0.6, 0.55, 0], [1, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]], np.float32) * 3  # norms do not matter
    emb = Prompts(vectors, zimg=zimg, labels=np.array([0, 1, 2, 1, -1]))
    zs = eval_lib.ZeroShot(emb, ["a", "b", "c"], templates=("{} one.", "{} two."))
    assert zs.prompts("a") == ["a one.", "a two."]
    assert zs.run(None) == {"accuracy": 0.75, "chance": pytest.approx(1 / 3), "examples": 4}  # no top-5 of 3 classes


def test_zero_shot_top5_counts_the_label_among_the_five_nearest_classes():
    """Eight classes, each prompt its own axis: image i's similarities are its coordinates, so the
    label's rank is known by construction (top-1 1 of 4, top-5 3 of 4: label 5 ranks 6th)."""
    e = np.eye(8, dtype=np.float32)
    names = list("abcdefgh")
    vectors = {f"{n} one.": e[i] for i, n in enumerate(names)}
    ranks = np.arange(8, 0, -1, dtype=np.float32)  # class 0 nearest, class 7 farthest
    zimg = np.stack([ranks, ranks, ranks, ranks])
    out = eval_lib.ZeroShot(Prompts(vectors, zimg=zimg, labels=np.array([0, 1, 4, 5])), names,
                            templates=("{} one.",)).run(None)
    assert out == {"accuracy": 0.25, "chance": 0.125, "top5": 0.75, "top5_chance": 5 / 8, "examples": 4}


def test_native_evaluation_embeds_each_image_at_its_own_size(tiny):
    """``native`` evaluators: scenes at random sizes, each NaFlex-resized and packed with others
    into rows; every image's embedding equals its own forward alone, in the examples' order, and
    zero-shot and retrieval run on them."""
    from vitmm.data import preprocess
    from vitmm.data.packing import SceneSource

    model, params = tiny
    spec = dict(difficulty="easy", num_examples=40, seed=0, min_side=16, max_side=64, max_aspect=3.0)
    data = dict(name="scenes_any", split="validation", scenes_any=spec)
    native = dict(max_num_patches=16, seq_len=64, max_images=8)
    evals = eval_lib.from_config({"zeroshot": dict(type="zeroshot", data=data, native=native, num_examples=40,
                                                   embed_batch_size=16),
                                  "retrieval": dict(type="retrieval", data=data, native=native, num_examples=40,
                                                    embed_batch_size=16)},
                                 model, 32, ByteTokenizer(), "softmax", 32)
    emb = evals["zeroshot"].embeddings.get(params)
    assert evals["retrieval"].embeddings is evals["zeroshot"].embeddings and emb["zimg"].shape == (40, 16)
    source = SceneSource(**{**spec, "split": "validation"})
    pp = preprocess.parse("naflex(16, 8)|value_range(-1, 1)")
    sizes = set()
    for i in (0, 7, 23, 39):
        image = pp({"image": source[i]["image"]}, None)["image"]
        sizes.add(image.shape)
        alone = model.apply({"params": params}, jnp.asarray(image)[None])[0][0]
        np.testing.assert_allclose(emb["zimg"][i], alone, atol=2e-5)
    assert len(sizes) > 1  # the images really are at different sizes
    assert 0 <= evals["zeroshot"].run(params)["accuracy"] <= 1 and evals["retrieval"].run(params)["examples"] == 40


def test_the_vlm_val_loss_weights_each_batch_by_the_tokens_its_loss_averaged(monkeypatch):
    """``val_loss`` of a VLM whose loss reads the first K answer tokens (``model.loss_positions``):
    each batch weighs by the tokens its loss averaged (the loss's ``answer_tokens``), not by every
    answer token of the batch. Two batches, 3- and 1-token answers, K = 1: the mean over the four
    examples' first tokens is (1 + 1 + 3 + 3) / 4 = 2, where weighing by all answer tokens gives 1.5."""
    import jax.numpy as jnp

    from vitmm.data import pipeline
    from vitmm.train import vlm_evaluators

    def example(answer_len, value):
        mask = np.zeros(6, np.int32)
        mask[1:1 + answer_len] = 1
        return {"answer_mask": mask, "value": np.float32(value)}

    examples = [example(3, 1.0), example(3, 1.0), example(1, 3.0), example(1, 3.0)]
    monkeypatch.setattr(pipeline, "source_for", lambda data: examples)

    def loss_fn(params, batch, rng):  # the loss at each example's first answer token (K = 1)
        first = (batch["answer_mask"][:, 1:].sum(1) > 0).astype(jnp.float32)
        return (batch["value"] * first).sum() / first.sum(), {"token_acc": 0.5, "answer_tokens": first.sum()}

    evaluator = vlm_evaluators.VLMValLoss(loss_fn, {"data": {}, "pp": "keep('answer_mask', 'value')",
                                                    "batch_size": 2}, None)
    out = evaluator.run(None)
    assert out["loss"] == pytest.approx(2.0) and out["examples"] == 4 and out["skipped"] == 0
