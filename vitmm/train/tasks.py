"""What a training run optimises, behind one small interface the loop in ``trainer`` uses:

* ``init_params()``: fresh parameters, plus what the task loads (e.g. a CLIP tower);
* ``loss_fn(params, batch, rng) -> (loss, aux)``: ``aux`` are scalars logged and checked for
  NaN/Inf with the loss;
* ``post_update(params)``: constraints after each update (CLIP's temperature clamp);
* ``evaluators()``: ``{name: evaluator}`` with ``run(params, **aux) -> dict`` and ``clear()`` (drops
  what a round of evaluation cached).

``config.task`` picks ``contrastive`` (CLIP/SigLIP) or ``vlm`` (connector + LM on questions).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from vitmm import checkpoint as ckpt_lib
from vitmm import losses
from vitmm.data import sequences
from vitmm.models import anyres as anyres_lib
from vitmm.models import lm as lm_lib
from vitmm.models import lora as lora_lib
from vitmm.models import packing, rope, two_towers, vlm
from vitmm.train import determinism, pp_template, sources, vlm_evaluators, vlm_start
from vitmm.train import evaluators as eval_lib
from vitmm.train.parallel import Parallel

CONTRASTIVE_LOSSES = ("softmax", "sigmoid", "sigmoid_chunked")


def _contrastive_impl(kind: str, par: Parallel):
    """``(zimg, ztxt, t, b) -> loss`` for the loss and the parallelism (see ``vitmm.losses``)."""
    if kind not in CONTRASTIVE_LOSSES:
        raise ValueError(f"Unknown loss={kind!r}; choose one of {CONTRASTIVE_LOSSES}.")
    if par.kind == "pmap":
        return {"softmax": lambda zi, zt, t, b: losses.softmax_loss_pmap(zi, zt, t),
                "sigmoid": losses.sigmoid_loss_pmap,
                "sigmoid_chunked": losses.sigmoid_loss_chunked_pmap}[kind]
    return {"softmax": lambda zi, zt, t, b, valid=None: losses.softmax_loss(zi, zt, t, valid),
            "sigmoid": losses.sigmoid_loss,
            "sigmoid_chunked": lambda zi, zt, t, b: losses.sigmoid_loss_chunked(zi, zt, t, b, par.mesh)}[kind]


class ContrastiveTask:
    aux_names = ("t", "b")
    loss_weight = None  # each (micro-)batch is its own contrastive problem: a plain mean of their losses

    def __init__(self, config, par: Parallel, tokenizer):
        if config.model.text.vocab_size != tokenizer.vocab_size:
            raise ValueError(
                f"The text tower has vocab_size={config.model.text.vocab_size} but the tokenizer "
                f"({config.get('tokenizer') or 'bytes'}) has {tokenizer.vocab_size} tokens; set "
                f"--config.model.text.vocab_size={tokenizer.vocab_size}.")
        text = config.model.text
        if text.get("pool", "eot") == "eot" and text.get("eos_id") is None and \
                tokenizer.eos_id != tokenizer.vocab_size - 1:
            # eos_id=None pools at argmax(ids), CLIP's EOS-last convention: elsewhere it reads a word
            raise ValueError(
                f"The text tower pools at EOT with eos_id unset, which finds EOS as the largest id, but the "
                f"tokenizer ({config.get('tokenizer') or 'bytes'}) has EOS {tokenizer.eos_id} of "
                f"{tokenizer.vocab_size} ids; set --config.model.text.eos_id={tokenizer.eos_id}.")
        self.config, self.tokenizer = config, tokenizer
        model = config.model.to_dict()
        self.model = two_towers.TwoTowers(**{**model, "image": determinism.attention(model["image"], config,
                                                                                     "the image tower")})
        self._loss = _contrastive_impl(config.loss, par)
        if config.loss.startswith("sigmoid") and model.get("bias_init") is None:
            warnings.warn(f"loss={config.loss!r} without model.bias_init: the logit bias stays 0 and is not learned "
                          f"(temperature_init {model.get('temperature_init')}); SigLIP learns it from "
                          "--config.model.bias_init=-10 with --config.model.temperature_init=10.", stacklevel=2)
        if config.input.get("packing") and (par.kind == "pmap" or config.loss == "sigmoid_chunked"):
            raise ValueError("input.packing (images at their own sizes) needs parallel='jit' and loss 'softmax' "
                             f"or 'sigmoid'; got parallel={par.kind!r}, loss={config.loss!r}.")

    def init_params(self, load: bool = True):  # noqa: ARG002 - a CLIP starts from no init folder
        res = self.config.input.image_size
        images = jnp.zeros((1, res, res, 3), jnp.float32)
        ids = jnp.zeros((1, self.config.model.text.max_len), jnp.int32)
        return jax.jit(self.model.init)(jax.random.key(self.config.seed), images, ids)["params"]

    def loss_fn(self, params, batch, rng):
        if "segment_ids" in batch:  # packed rows of images at their own sizes, captions per image slot
            return self._packed_loss(params, batch, rng)
        zimg, ztxt, out = self.model.apply({"params": params}, batch["image"], batch["caption_tokens"],
                                           train=True, rngs={"dropout": rng})
        t, b = out["t"], out.get("b", jnp.zeros(()))
        return self._loss(zimg, ztxt, t, b), {"t": t, "b": b}

    def _packed_loss(self, params, batch, rng):
        images = packing.Packed(**{k: batch[k] for k in ("patches", "segment_ids", "kinds", "positions", "grids",
                                                          "image_ids")})
        ids = batch["caption_tokens"]
        rows, slots, length = ids.shape
        zimg, ztxt, out = self.model.apply({"params": params}, images, ids.reshape(rows * slots, length),
                                           train=True, rngs={"dropout": rng})
        t, b = out["t"], out.get("b", jnp.zeros(()))
        valid = images.image_mask().reshape(-1)
        return self._loss(zimg.reshape(rows * slots, -1), ztxt, t, b, valid), {"t": t, "b": b}

    def post_update(self, params):
        max_t = self.config.get("max_temperature")
        return two_towers.clamp_temperature(params, max_t) if max_t else params

    def final_aux(self, params) -> dict:
        return {"t": float(jnp.exp(params["t"][0])), "b": float(params["b"][0]) if "b" in params else 0.0}

    def eval_params(self, params):
        return params

    def evaluators(self):
        c = self.config
        return eval_lib.from_config(evals_config(c), self.model, c.model.text.max_len, self.tokenizer,
                                    c.loss, c.input.image_size, pp_template.value_op(c))


class VLMTask:
    """Answer-only next-token loss of a VLM on image+question → answer examples.

    Batches hold ``image``, ``ids`` ([BOS] question answer [EOS]), ``answer_mask`` and
    ``prompt_len`` (``qa_tokens``). ``config.init.vision`` names a ``vitmm.train`` CLIP workdir
    whose image tower the VLM starts from; which parts train is ``config.optim.freeze``.
    """

    aux_names = ("token_acc", "answer_tokens")
    loss_weight = "answer_tokens"  # the loss is a mean over answer tokens, also across micro-batches and devices

    def __init__(self, config, par: Parallel, tokenizer):
        m = config.model
        self.vision, self.lm = vlm_start.vlm_parts(config)
        if tokenizer.vocab_size > self.lm["vocab_size"]:  # more rows (Qwen's padding): never sampled (decode)
            raise ValueError(f"The tokenizer has {tokenizer.vocab_size} ids but the LM only vocab_size="
                             f"{self.lm['vocab_size']}; use the tokenizer saved with init.lm, or (an LM trained "
                             f"from scratch) set --config.model.lm.vocab_size={tokenizer.vocab_size}.")
        self.config, self.tokenizer = config, tokenizer
        anyres = m.get("anyres")
        if anyres is not None:  # LLaVA-NeXT's tiles: the tower sees tile x tile views
            anyres = {"pinpoints": anyres_lib.check_pinpoints(anyres["pinpoints"], int(anyres["tile"])),
                      "tile": int(anyres["tile"]),
                      **({"max_patches": int(anyres["max_patches"])} if anyres.get("max_patches") else {})}
        if m.get("mrope") and self.lm.get("mrope_section") is None:  # Qwen2-VL's 3D positions on any LM
            self.lm = {**self.lm, "mrope_section": rope.mrope_split(lm_lib.LM(**self.lm).attn_head_dim)}
        vlm_start.check_budget(m.connector.to_dict(), self.vision,
                               anyres["tile"] if anyres else config.input.image_size)
        if m.get("loss_positions") and "{loss_positions}" not in config.input.pp:
            raise ValueError(f"model.loss_positions={m.loss_positions} reads that many answer tokens per example; the "
                             "train pp must check that no answer is longer: add max_answer={loss_positions} to its "
                             "qa_tokens op (as configs/vlm_scenes.py does).")
        self.model = vlm.VLM(self.vision, m.connector.to_dict(), self.lm, m.vision_layer, m.use_cls,
                             mrope=bool(m.get("mrope", False)), anyres=anyres)
        self.num_visual = self.mrope_grid = None  # known once the parameters exist (init_params)

    def init_params(self, load: bool = True):
        """The VLM's parameters: the tower's and LM's from ``init.vision`` / ``init.lm`` unless not
        ``load`` (a run that resumes: its own checkpoint holds them)."""
        c = self.config
        res = c.input.image_size
        images = jnp.zeros((1, res, res, pp_template.image_channels(c)), jnp.float32)
        ids = jnp.zeros((1, c.model.max_len), jnp.int32)
        variables = jax.jit(self.model.init)(jax.random.key(c.seed), images, ids)
        self.num_visual = self.model.apply(variables, (res, res), method=vlm.VLM.num_visual_tokens)
        self.mrope_grid = self.model.apply(variables, (res, res), method=vlm.VLM.token_grid) if self.model.mrope \
            else None  # flat sequences' M-RoPE positions are made on the host (data.sequences)
        params = dict(variables["params"])
        dont_load = c.init.get("dont_load") or ()
        if load:  # a start from the init folders (a resume reads its own checkpoint): say what they replace
            vlm_start.vlm_parts(c, say=True)
        if c.init.get("vision") and load:
            tower = ckpt_lib.load_params(c.init.vision)
            if "img" not in tower:
                raise ValueError(f"The checkpoint in {c.init.vision} has no image tower ('img'); it has "
                                 f"{sorted(tower)}.")
            tower = vlm_start.inflate_patch_kernel(vlm_start.fit_positions(tower["img"], params["tower"], self.vision),
                                                   params["tower"])
            params["tower"] = ckpt_lib.merge_params(params["tower"], tower, dont_load,
                                                    source=f"{c.init.vision} (img)", prefix="tower/")
        elif not (c.init.get("vision") or c.init.get("allow_random_tower") or c.init.get("checkpoint")):
            raise ValueError("A VLM starts from a pretrained tower: set --config.init.vision=WORKDIR of a "
                             "`python -m vitmm.train` CLIP run or a `python -m vitmm.interop` folder, or "
                             "init.checkpoint=a VLM's (or init.allow_random_tower=True for tests).")
        if c.get("lora") and c.lora.rank > 0:  # adapters beside the parameters; the optimizer freezes the rest
            params["lora"] = lora_lib.init(params, tuple(c.lora.targets), c.lora.rank, jax.random.key(c.seed + 1))
            vlm_start.check_lora_bases_frozen(c, params["lora"])
            vlm_start.lora_alpha(c)  # refused here, before any step, when it would scale the adapters to nothing
        if c.init.get("lm") and load:
            saved = ckpt_lib.load_params(c.init.lm)
            if "lm" not in saved:
                raise ValueError(f"The checkpoint in {c.init.lm} holds no language model ('lm'); convert one with "
                                 "`python -m vitmm.interop --from hf|gguf`.")
            params["language"] = ckpt_lib.merge_params(params["language"], saved["lm"], dont_load,
                                                       source=f"{c.init.lm} (lm)", prefix="language/")
        return params

    def _apply(self, params, *args, rng=None, **kwargs):
        """The VLM's forward; with LoRA adapters in ``params["lora"]``, the adapted model."""
        if "lora" not in params:
            return self.model.apply({"params": params}, *args, **kwargs)
        base = {k: v for k, v in params.items() if k != "lora"}
        c = self.config.lora
        return lora_lib.apply(self.model, base, params["lora"], vlm_start.lora_alpha(self.config), *args,
                              dropout=c.dropout if rng is not None else 0.0, rng=rng, **kwargs)

    def eval_params(self, params):
        """What evaluators see: adapters merged into the kernels."""
        if "lora" not in params:
            return params
        base = {k: v for k, v in params.items() if k != "lora"}
        return lora_lib.merge(base, params["lora"], vlm_start.lora_alpha(self.config))

    def loss_fn(self, params, batch, rng):
        if "segment_ids" in batch:  # flat sequences, packed or not (input.sequences)
            positions = jnp.moveaxis(batch["mrope"], -1, 0) if "mrope" in batch else batch["positions"]
            images = sequences.tower_batch(batch) if "tower_patches" in batch else batch["images"]
            out = self._apply(params, images, batch["tokens"], batch["visual"], batch["segment_ids"],
                              positions, batch["prefix"] if self.config.model.prefix_lm else None,
                              rng=rng, method=vlm.VLM.packed, hidden=self._chunk is not None)
            loss, acc = self._lm_loss(params, out, batch["targets"], batch["weights"])
            return loss, {"token_acc": acc, "answer_tokens": batch["weights"].astype(jnp.float32).sum()}
        if "more_images" in batch or "image_positions" in batch:
            raise ValueError("Examples with several images train as flat sequences: set input.sequences (e.g. "
                             "--config.input.sequences.length=1024 --config.input.sequences.max_images=4).")
        image_pos = batch.get("image_pos")  # chat prompts: where <image> stood; else after BOS
        targets, mask = batch["ids"][:, 1:], batch["answer_mask"][:, 1:]  # text position i predicts ids[i + 1]
        at = None
        if self.config.model.get("loss_positions"):  # the head on the first K answer positions only
            at = jnp.argsort(mask <= 0, axis=1, stable=True)[:, : self.config.model.loss_positions]
            targets, mask = jnp.take_along_axis(targets, at, 1), jnp.take_along_axis(mask, at, 1)
        # AnyRes views made on the host (the `anyres` op): each image's layout, its padding masked
        visual_mask = batch.get("visual_mask")
        if "has_image" in batch:  # text-only examples among image ones (conversations): no visual tokens shown
            m = visual_mask.shape[1] if visual_mask is not None else self.num_visual
            shown = jnp.broadcast_to(jnp.asarray(batch["has_image"], bool)[:, None], (batch["ids"].shape[0], m))
            visual_mask = shown if visual_mask is None else shown & visual_mask
        out = self._apply(params, batch["image"], batch["ids"], prompt_len=batch["prompt_len"],
                          prefix_lm=self.config.model.prefix_lm, image_pos=image_pos, rng=rng,
                          visual_mask=visual_mask, layout=anyres_layout(batch), text_logits_at=at,
                          hidden=self._chunk is not None)
        if at is None:
            out = vlm.text_logits(out, out.shape[1] - batch["ids"].shape[1], image_pos)[:, :-1]
        loss, acc = self._lm_loss(params, out, targets, mask)
        return loss, {"token_acc": acc, "answer_tokens": mask.astype(jnp.float32).sum()}

    @property
    def _chunk(self) -> int | None:
        """``model.loss_chunk``: tokens whose logits are made at a time (None: all at once)."""
        return self.config.model.get("loss_chunk") or None

    def _lm_loss(self, params, out, targets, mask):
        """The answer loss of the LM's logits ``out``, or of its states with ``model.loss_chunk``."""
        if self._chunk is None:
            return losses.lm_loss(out, targets, mask)
        head = lambda h: self._apply(params, h, method=vlm.VLM.head)  # noqa: E731
        return losses.chunked_lm_loss(out, targets, mask, head, self._chunk)

    def post_update(self, params):
        return params

    def final_aux(self, params) -> dict:
        return {}

    def evaluators(self):
        c = self.config
        evals = {}
        for name, cfg in evals_config(c).items():
            kind = cfg.get("type", "qa")
            if kind not in VLM_EVAL_TYPES:  # at setup, not as a QA evaluator that fails (or misleads) at step N
                raise ValueError(f"Unknown evaluator type {kind!r} for evals.{name} of a VLM run; choose one of "
                                 f"{VLM_EVAL_TYPES}.")
            if "every" in cfg:
                raise ValueError(f"evals.{name}.every={cfg['every']!r}: every evaluator runs each eval_every steps; "
                                 "set config.eval_every instead.")
            unknown = sorted(set(cfg) - {"type"} - VLM_EVAL_SETTINGS[kind])
            if unknown:  # a setting the evaluator would ignore (as evaluators.SETTINGS for two towers)
                raise ValueError(f"evals.{name} ({kind}) has no setting(s) {unknown}; it takes "
                                 f"{sorted(VLM_EVAL_SETTINGS[kind])}.")
            if kind == "val_loss":  # held-out answer loss, with the training preprocessing by default
                cfg["pp"] = pp_template.pp_string(c, cfg.get("pp") or c.input.pp)
                cfg["pp"], row = self._sequence_row(cfg["pp"])
                evals[name] = vlm_evaluators.VLMValLoss(self.loss_fn, cfg, self.tokenizer, row)
                continue
            evals[name] = qa_evaluator(c, cfg, self.model, self.tokenizer)
        return evals


    def _sequence_row(self, spec: str):
        """With ``input.sequences``: ``spec`` as the layout runs it (AnyRes: its final normalize
        applied to the views) and a pp'd example as one padded row (held-out batches); else
        ``(spec, None)``."""
        from vitmm.train.sequence_layout import SequenceLayout

        layout = SequenceLayout.of(self)
        if layout is None:
            return spec, None
        spec, layout = layout.split_affine(spec)
        return spec, layout.row


VLM_EVAL_TYPES = ("qa", "val_loss")  # qa: a missing type
VLM_EVAL_SETTINGS = {"qa": {"data", "pp", "num_examples", "batch_size", "max_new_tokens"},  # evals.<name> keys
                     "val_loss": {"data", "pp", "num_examples", "batch_size"}}  # (besides type)


def qa_evaluator(config, cfg: dict, model, tokenizer) -> vlm_evaluators.QAAccuracy:
    """The ``qa`` evaluator ``cfg`` (an entry of ``evals_config(config)``) with the run's own pp fields."""
    cfg = {**cfg, "pp": pp_template.pp_string(config, cfg.get("pp") or vlm_evaluators.QAAccuracy.PP)}
    return vlm_evaluators.QAAccuracy(model, cfg, tokenizer, config.model.prefix_lm)


def tokenizer_for(config):
    """The run's tokenizer: the one saved with ``init.lm`` (a VLM on a pretrained LM), else
    ``config.tokenizer`` (a tokenizer.json; with ``config.chat_template`` and the special
    ``config.tokens`` where set, as an imported VLM's workdir has them) or bytes."""
    import pathlib

    from vitmm.data import tokenizer as tok_lib

    lm_dir = sources.existing_folder(config, "lm") if config.get("task") == "vlm" else None
    if lm_dir:
        path = pathlib.Path(lm_dir).expanduser() / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{lm_dir} has no tokenizer.json; convert the LM with `python -m vitmm.interop`.")
        saved = ckpt_lib.load_config(lm_dir)
        ids = {k: v for k, v in (saved.get("tokens") or {}).items() if v is not None}
        return tok_lib.get_tokenizer(str(path), chat_template=saved.get("chat_template"), **ids)
    ids = {k: v for k, v in (config.get("tokens") or {}).items() if v is not None}
    return tok_lib.get_tokenizer(sources.tokenizer_file(config), chat_template=config.get("chat_template"), **ids)


def anyres_layout(batch: dict):
    """A batch's AnyRes layout (the ``anyres`` op's): ``anyres_layout``, or with LLaVA-OneVision's
    downsampling the pair ``(anyres_layout, anyres_weights)``; None without AnyRes views."""
    if "anyres_weights" in batch:
        return batch["anyres_layout"], batch["anyres_weights"]
    return batch.get("anyres_layout")


def evals_config(config) -> dict:
    """``config.evals`` as plain dicts, each evaluator's ``data_dir`` defaulting to the training
    input's (one setting points a run and all its evaluators at a TFDS folder); an evaluator whose
    data names no dataset and no raw files is left out."""
    from vitmm.data import formats

    out = {}
    for name, cfg in (config.get("evals") or {}).items():
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        cfg["data"] = dict(cfg.get("data") or {})
        if not (cfg["data"].get("name") or cfg["data"].get("scenes_any") or formats.raw_format(cfg["data"])):
            continue  # raw data for this evaluator not given (e.g. no held-out shards): it does not run
        if not cfg["data"].get("data_dir"):
            cfg["data"]["data_dir"] = config.input.get("data_dir")
        out[name] = cfg
    return out


TASKS = {"contrastive": ContrastiveTask, "vlm": VLMTask}


def from_config(config, par: Parallel, tokenizer):
    kind = config.get("task", "contrastive")
    if kind not in TASKS:
        raise ValueError(f"Unknown task={kind!r}; choose one of {tuple(TASKS)}.")
    return TASKS[kind](config, par, tokenizer)
