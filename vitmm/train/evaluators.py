"""Evaluators for two-tower models, listed in ``config.evals``: ``{name: {type: ..., ...}}``.

Protocol: ``evaluator.run(params) -> dict`` of metric names to floats, and ``clear()`` after a
round of evaluation. The image-text evaluators share one pass that embeds the evaluation split
(cached for the params object it was given, until ``clear()``), then:

* ``zeroshot``: classify single-shape scenes by comparing each image with one prompt-ensembled
  text embedding per class (``templates``); reports accuracy and chance level.
* ``retrieval``: image→text and text→image Recall@1/@5 over the first ``num_examples`` records,
  as clip_benchmark and published COCO numbers count them: an image is retrieved by any of its
  captions (a record's list, ``data.captions``, or raw rows that show the same image), each
  caption retrieves among the distinct images. Several scenes share the same caption word for
  word; retrieving any pair with the identical caption counts as correct, and the chance level
  printed accounts for that.
* ``val_loss``: the training loss on consecutive batches of ``batch_size`` pairs; the last,
  partial one scores the rest (padded, the padding masked out), so every pair counts.

Any of them reads images at their own sizes with ``native={"max_num_patches", "seq_len",
"max_images"}``: each image resized by NaFlex to the patch budget and the images packed into
rows (``models.packing``) for the image tower; ``data.scenes_any`` (``data.packing.SceneSource``
settings, the split from ``data.split``) draws scenes at random sizes instead of a TFDS split.

Images: ``data.pp`` (default ``decode``), then a square ``resize(input.image_size)`` (PIL bilinear,
the aspect not kept: what vitmm's configs train with), then the run's ``value_range``/``normalize``
(for a converted tower, the mean and std its checkpoint records). A converted checkpoint records
no resize protocol, so an imported OpenAI CLIP is not evaluated as CLIP's papers and open_clip
evaluate it (shorter side to the size, bicubic, centre crop) unless ``data.pp`` does that:
``decode|resize(224, method='bicubic', shorter=True)|center_crop(224)``; the square resize after
it then changes nothing (an image already at ``image_size`` is left as it is).
"""

from __future__ import annotations

import jax
import numpy as np

from vitmm import losses
from vitmm.train.eval_embeddings import Embeddings

DEFAULT_TEMPLATES = ("a {}.", "there is a {}.", "one shape: a {}.")
# For scenes: every colour and position is filled in and the class embedding is their average
# (prompt ensembling as in CLIP), so prompts look like the captions the model was trained on.
SCENES_TEMPLATES = ("a {color} {} {at}.", "there is a {color} {} {at}.", "one shape: a {color} {} ({region}).")
RECALL_AT = (1, 5, 10)  # retrieval's k, as clip_benchmark and the COCO/Flickr tables
TOP5 = 5  # zero-shot's second accuracy, open_clip's top-5


class _OnEmbeddings:
    """An evaluator that reads the shared embeddings of its split; ``clear()`` releases them
    (and the parameters they were computed from) once a round of evaluation is done."""

    embeddings: Embeddings

    def clear(self) -> None:
        self.embeddings.clear()


class ZeroShot(_OnEmbeddings):
    """``templates`` may use ``{color}``, ``{region}`` and ``{at}`` (e.g. "at the top left"),
    filled with every value in ``fill`` and averaged."""

    def __init__(self, embeddings: Embeddings, class_names, templates=DEFAULT_TEMPLATES, fill=None, **_):
        self.embeddings, self.class_names = embeddings, list(class_names)
        self.templates, self.fill = tuple(templates), dict(fill or {})

    def prompts(self, name: str) -> list[str]:
        colors = self.fill.get("color") or [""]
        regions = self.fill.get("region") or [""]
        out = []
        for tpl in self.templates:
            for color in colors if "{color}" in tpl else [""]:
                for region in regions if ("{region}" in tpl or "{at}" in tpl) else [""]:
                    at = _at(region) if region else ""
                    text = tpl.format(name, color=color, region=region, at=at)
                    out.append(" ".join(text.split()).replace(" .", ".").replace(" ()", ""))
        return sorted(set(out))

    def run(self, params, t=None, b=None) -> dict:
        emb = self.embeddings.get(params)
        classes = []
        for name in self.class_names:
            z = self.embeddings.texts(params, self.prompts(name)).mean(0)
            classes.append(z / np.linalg.norm(z))
        single = emb["labels"] >= 0
        if not single.any():
            raise ValueError("zeroshot: the evaluation split has no single-shape (labelled) images.")
        scores, labels, n = emb["zimg"][single] @ np.stack(classes).T, emb["labels"][single], len(self.class_names)
        out = {"accuracy": float((scores.argmax(-1) == labels).mean()), "chance": 1.0 / n}
        if n > TOP5:  # top-5 accuracy, as open_clip reports beside top-1 (with 5 classes or fewer it is 1)
            hits = (_top_k(scores, TOP5) == labels[:, None]).any(1)
            out.update(top5=float(hits.mean()), top5_chance=TOP5 / n)
        return {**out, "examples": int(single.sum())}


class Retrieval(_OnEmbeddings):
    """Recall@k (k = 1, 5, 10) as clip_benchmark and the COCO/Flickr papers report it. Image→text: an image is a
    hit when any of its captions is among the ``k`` best of all captions; text→image: each caption
    is a query over the distinct images. With one caption per image this is open_clip's
    ``get_clip_metrics``. A caption identical word for word to one of an image's captions also
    counts as that image's (scenes repeat captions), and the chance levels account for that;
    identical means the whole text, not the tokens the text tower reads (cut to ``max_len``)."""

    def __init__(self, embeddings: Embeddings, **_):
        self.embeddings = embeddings

    def run(self, params, t=None, b=None) -> dict:
        emb = self.embeddings.get(params)
        zimg, ztxt = emb["zimg"], emb["ztxt"]
        txt2img = emb.get("txt2img", np.arange(len(ztxt)))
        # Identical captions: the same whole text, not the same tokens (cut to max_len, captions that
        # differ past it have the same ids; hand-made embeddings without texts have tokens alone).
        if "captions" in emb:
            _, caption_id = np.unique(np.asarray(emb["captions"], str), return_inverse=True)
        else:
            _, caption_id = np.unique(emb["tokens"], axis=0, return_inverse=True)
        caption_id = caption_id.reshape(-1)
        has = np.zeros((len(zimg), caption_id.max() + 1), bool)
        has[txt2img, caption_id] = True
        positive = has[:, caption_id]  # [I, T]: image i has a caption identical to caption t
        scores = zimg @ ztxt.T
        out = {}
        for name, s, pos in (("i2t", scores, positive), ("t2i", scores.T, positive.T)):
            top = _top_k(s, max(RECALL_AT))
            hits = np.take_along_axis(pos, top, axis=1)
            for k in RECALL_AT:
                out[f"{name}_r{k}"] = float(hits[:, :k].any(1).mean())
        # Chance of a positive within the top k of a random ranking (drawn without replacement).
        chance = {name: _chance(pos.sum(1), pos.shape[1]) for name, pos in (("i2t", positive), ("t2i", positive.T))}
        single = len(zimg) == len(ztxt) and (txt2img == np.arange(len(ztxt))).all()
        for k in RECALL_AT:
            if single:  # the two directions' chance levels are the same
                out[f"chance_r{k}"] = chance["i2t"][k]
            else:
                out[f"i2t_chance_r{k}"], out[f"t2i_chance_r{k}"] = chance["i2t"][k], chance["t2i"][k]
        out["examples"] = len(zimg)
        if not single:
            out["caption_examples"] = len(ztxt)
        return out


def _top_k(scores, k: int, chunk: int = 1024) -> np.ndarray:
    """``[Q, k]`` indices of each query's (row's) best candidates, best first; a chunk of rows at a
    time (the index matrix of a whole argsort over 25,000 COCO captions would be gigabytes)."""
    return np.concatenate([np.argsort(-scores[i : i + chunk], axis=1)[:, :k] for i in range(0, len(scores), chunk)])


def _chance(matches: np.ndarray, n: int) -> dict:
    """``{k: mean chance}`` that ``k`` of ``n`` candidates drawn at random include one of a query's ``matches``."""
    out = {}
    for k in RECALL_AT:
        miss = np.ones(len(matches))
        for j in range(min(k, n)):  # k over n candidates: all of them drawn
            miss *= np.clip((n - matches - j) / (n - j), 0, 1)
        out[k] = float((1 - miss).mean())
    return out


class ValLoss(_OnEmbeddings):
    """The training loss on consecutive batches of ``batch_size`` pairs, every pair scored: the
    last batch, padded to ``batch_size`` with its padding masked out (``losses``' ``valid``), is
    the loss of its own pairs alone (fewer negatives than a full batch); the mean is over pairs.
    With several captions per image (``data.captions``, grouped raw rows) the pairs are taken each
    image's first caption first, then each one's second, ...: in the split's order an image's
    captions sit side by side, and a batch holding one image several times scores the copies as
    each other's negatives (a perfect model's loss no lower than log 5 with COCO's 5 captions), a
    loss the training batches, one pair per image, never see."""

    def __init__(self, embeddings: Embeddings, loss: str = "softmax", batch_size: int = 256, **_):
        self.embeddings, self.loss, self.batch_size = embeddings, loss, batch_size

    def run(self, params, t=None, b=None) -> dict:
        emb = self.embeddings.get(params)
        order = _round_robin(emb["txt2img"])
        zimg, ztxt = emb["zimg"][emb["txt2img"][order]], emb["ztxt"][order]  # the split's image-caption pairs
        n, size = len(zimg), self.batch_size
        values, weights = [], []
        for i in range(0, n, size):
            zi, zt = zimg[i : i + size], ztxt[i : i + size]
            valid = None
            if len(zi) < size:  # the rest: padded, so that it runs in the full batches' compiled shape
                valid = np.arange(size) < len(zi)
                zi, zt = (np.concatenate([z, np.zeros((size - len(z), z.shape[1]), z.dtype)]) for z in (zi, zt))
            if self.loss == "softmax":
                values.append(float(_softmax_loss(zi, zt, t, valid)))
            else:
                values.append(float(_sigmoid_loss(zi, zt, t, b, valid)))
            weights.append(len(zi) if valid is None else int(valid.sum()))
        return {"loss": float(np.average(values, weights=weights)), "batches": len(values), "examples": n}


def _round_robin(txt2img: np.ndarray) -> np.ndarray:
    """The captions' order by their rank among their image's captions (each image's first, then
    each one's second, ...), the split's order within a rank; ``arange`` with one caption per image."""
    txt2img = np.asarray(txt2img)
    by_image = np.argsort(txt2img, kind="stable")
    grouped = txt2img[by_image]
    rank = np.empty(len(txt2img), np.int64)
    rank[by_image] = np.arange(len(grouped)) - np.searchsorted(grouped, grouped, side="left")
    return np.lexsort((np.arange(len(txt2img)), rank))


# Compiled once per batch shape (eagerly, each of the loss's ~15 operations is a program of its own).
_softmax_loss, _sigmoid_loss = jax.jit(losses.softmax_loss), jax.jit(losses.sigmoid_loss)


TYPES = {"zeroshot": ZeroShot, "retrieval": Retrieval, "val_loss": ValLoss}
_SHARED = {"data", "native", "num_examples", "batch_size", "embed_batch_size"}
SETTINGS = {"zeroshot": _SHARED | {"class_names", "templates", "fill"}, "retrieval": _SHARED,
            "val_loss": _SHARED | {"loss"}}  # each type's evals.<name> keys (besides type)


def _embed_batch_size(name: str, cfg: dict) -> int | None:
    """The embedding pass's batch an evaluator asks for: ``embed_batch_size``, or for ``zeroshot``
    and ``retrieval`` (whose only batches are the pass's) ``batch_size``; ``val_loss``'s
    ``batch_size`` is its loss's contrastive batch, not the pass's."""
    kind = cfg.get("type", name)
    asked = cfg.get("embed_batch_size")
    if kind in ("zeroshot", "retrieval") and cfg.get("batch_size") is not None:
        if asked is not None and asked != cfg["batch_size"]:
            raise ValueError(f"evals.{name}: batch_size={cfg['batch_size']} and embed_batch_size={asked} both set "
                             f"the batches {kind} embeds the split in; set one.")
        asked = cfg["batch_size"]
    return asked


def from_config(evals_config, model, max_len: int, tokenizer, loss: str, image_size: int,
                value_op: str = "value_range(-1, 1)") -> dict:
    """Builds the evaluators of ``config.evals`` for a ``TwoTowers`` model; ``value_op``: the
    run's final ``value_range``/``normalize`` (``pp_template.value_op``), so they see the pixels
    it trained on."""
    embed_images = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
    embed_texts = jax.jit(lambda p, ids: model.apply({"params": p}, None, ids)[1])
    caches: dict = {}
    evaluators = {}
    # The split's captions are read and embedded only where an evaluator on it compares with them
    # (retrieval, val_loss): zero-shot alone runs on images and labels.
    with_captions = {_cache_key(cfg) for name, cfg in evals_config.items()
                     if dict(cfg).get("type", name) in ("retrieval", "val_loss")}
    # Evaluators on one split share its embedding pass, in batches of the smallest size any of them
    # asks for (memory is why one asks): zeroshot's and retrieval's batch_size, or embed_batch_size.
    embed_batch: dict = {}
    for name, cfg in evals_config.items():
        asked = _embed_batch_size(name, dict(cfg))
        if asked is not None:
            key = _cache_key(cfg)
            embed_batch[key] = min(embed_batch.get(key, asked), asked)
    for name, cfg in evals_config.items():
        cfg = dict(cfg)
        kind = cfg.pop("type", name)
        if kind not in TYPES:
            raise ValueError(f"Unknown evaluator type {kind!r} for {name!r}; choose one of {tuple(TYPES)}.")
        if "every" in cfg:  # it was once accepted and ignored
            raise ValueError(f"evals.{name}.every={cfg['every']!r}: every evaluator runs each eval_every steps; set "
                             "config.eval_every instead.")
        unknown = sorted(set(cfg) - SETTINGS[kind])
        if unknown:  # a setting an evaluator would ignore
            raise ValueError(f"evals.{name} ({kind}) has no setting(s) {unknown}; it takes {sorted(SETTINGS[kind])}.")
        data = dict(cfg["data"])
        native = cfg.get("native")
        if native:  # the image tower's patch and prefix tokens, as packing needs them
            from vitmm.models.vit import ViT

            tower = ViT(**model.image)
            patch = tower.arch().patch_size
            if patch[0] != patch[1]:
                raise ValueError(f"{name}: native (NaFlex) evaluation needs square patches, the tower has {patch}.")
            native = {**dict(native), "patch_size": patch, "class_token": tower.class_token,
                      "num_registers": tower.num_registers}
        key = _cache_key(cfg)
        if key not in caches:
            caches[key] = Embeddings(embed_images, embed_texts, data, max_len, tokenizer,
                                      embed_batch.get(key, 256), cfg.get("num_examples"),
                                      image_size, native, padding=text_padding(model), value_op=value_op,
                                      captions=key in with_captions)
        for setting in ("data", "native", "num_examples", "embed_batch_size"):
            cfg.pop(setting, None)
        if kind != "val_loss":  # the embedding pass's, above
            cfg.pop("batch_size", None)
        if kind == "val_loss":
            cfg.setdefault("loss", "sigmoid" if loss.startswith("sigmoid") else "softmax")
        if kind == "zeroshot" and "class_names" not in cfg:
            cfg["class_names"], fill = _scenes_classes(data)
            cfg.setdefault("templates", SCENES_TEMPLATES)
            cfg.setdefault("fill", fill)
        evaluators[name] = TYPES[kind](caches[key], **cfg)
    return evaluators


def _cache_key(cfg: dict) -> tuple:
    """Evaluators whose settings agree on these share one embedding pass."""
    native = cfg.get("native")
    return (str(sorted(dict(cfg["data"]).items())), cfg.get("num_examples"),
            str(sorted(dict(native).items())) if native else None)


def text_padding(model) -> str:
    """How captions are padded for ``model``'s text tower: sticky EOS when it pools the last
    position (SigLIP; a PAD there would be what it embeds), else PAD."""
    return "eos" if (model.text or {}).get("pool") == "last" else "pad"


def _at(region: str) -> str:
    from vitmm.data import scenes

    return scenes.at(region)


def _scenes_classes(data: dict) -> tuple[list[str], dict]:
    """Class names, colours and regions of a scenes config (other datasets name their classes)."""
    from vitmm.data import scenes, scenes_builder

    if data.get("scenes_any"):
        difficulty = data["scenes_any"]["difficulty"]
    else:
        name = data["name"]
        if not name.startswith("scenes"):
            raise ValueError(f"zeroshot on {name!r} needs class_names (and templates) in its config.")
        config = name.split("/", 1)[1] if "/" in name else scenes_builder.Scenes.DEFAULT_CONFIG_NAME
        difficulty = scenes_builder.config_from_name(config).difficulty
    diff = scenes.DIFFICULTIES[difficulty]
    regions = scenes.REGIONS_2X2 if diff.grid == 2 else scenes.REGIONS_3X3
    return list(diff.shapes), {"color": list(diff.colors), "region": list(regions)}
