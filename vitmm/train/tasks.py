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

import jax
import jax.numpy as jnp

from vitmm import checkpoint as ckpt_lib
from vitmm import losses
from vitmm.models import two_towers, vlm
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
    return {"softmax": lambda zi, zt, t, b: losses.softmax_loss(zi, zt, t),
            "sigmoid": losses.sigmoid_loss,
            "sigmoid_chunked": lambda zi, zt, t, b: losses.sigmoid_loss_chunked(zi, zt, t, b, par.mesh)}[kind]


class ContrastiveTask:
    aux_names = ("t", "b")

    def __init__(self, config, par: Parallel, tokenizer):
        if config.model.text.vocab_size != tokenizer.vocab_size:
            raise ValueError(
                f"The text tower has vocab_size={config.model.text.vocab_size} but the tokenizer "
                f"({config.get('tokenizer') or 'bytes'}) has {tokenizer.vocab_size} tokens; set "
                f"--config.model.text.vocab_size={tokenizer.vocab_size}.")
        self.config, self.tokenizer = config, tokenizer
        self.model = two_towers.TwoTowers(**config.model.to_dict())
        self._loss = _contrastive_impl(config.loss, par)

    def init_params(self):
        res = self.config.input.image_size
        images = jnp.zeros((1, res, res, 3), jnp.float32)
        ids = jnp.zeros((1, self.config.model.text.max_len), jnp.int32)
        return jax.jit(self.model.init)(jax.random.key(self.config.seed), images, ids)["params"]

    def loss_fn(self, params, batch, rng):
        zimg, ztxt, out = self.model.apply({"params": params}, batch["image"], batch["caption_tokens"],
                                           train=True, rngs={"dropout": rng})
        t, b = out["t"], out.get("b", jnp.zeros(()))
        return self._loss(zimg, ztxt, t, b), {"t": t, "b": b}

    def post_update(self, params):
        max_t = self.config.get("max_temperature")
        return two_towers.clamp_temperature(params, max_t) if max_t else params

    def final_aux(self, params) -> dict:
        return {"t": float(jnp.exp(params["t"][0])), "b": float(params["b"][0]) if "b" in params else 0.0}

    def evaluators(self):
        c = self.config
        return eval_lib.from_config(_evals_config(c), self.model, c.model.text.max_len, self.tokenizer,
                                    c.loss, c.input.image_size)


class VLMTask:
    """Answer-only next-token loss of a VLM on image+question → answer examples.

    Batches hold ``image``, ``ids`` ([BOS] question answer [EOS]), ``answer_mask`` and
    ``prompt_len`` (``qa_tokens``). ``config.init.vision`` names a ``vitmm.train`` CLIP workdir
    whose image tower the VLM starts from; which parts train is ``config.optim.freeze``.
    """

    aux_names = ("token_acc",)

    def __init__(self, config, par: Parallel, tokenizer):
        if config.model.lm.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"The LM has vocab_size={config.model.lm.vocab_size} but the tokenizer has "
                             f"{tokenizer.vocab_size}; set --config.model.lm.vocab_size={tokenizer.vocab_size}.")
        self.config, self.tokenizer = config, tokenizer
        m = config.model
        _check_budget(m.connector.to_dict(), m.vision.to_dict(), config.input.image_size)
        self.model = vlm.VLM(m.vision.to_dict(), m.connector.to_dict(), m.lm.to_dict(), m.vision_layer, m.use_cls)
        self.num_visual = None  # known once the parameters exist (init_params)

    def init_params(self):
        c = self.config
        res = c.input.image_size
        images = jnp.zeros((1, res, res, 3), jnp.float32)
        ids = jnp.zeros((1, c.model.max_len), jnp.int32)
        variables = jax.jit(self.model.init)(jax.random.key(c.seed), images, ids)
        self.num_visual = self.model.apply(variables, (res, res), method=vlm.VLM.num_visual_tokens)
        params = variables["params"]
        if c.init.get("vision"):
            params = ckpt_lib.init_tower_from_clip(params, c.init.vision, dont_load=c.init.get("dont_load") or ())
        elif not c.init.get("allow_random_tower"):
            raise ValueError("A VLM starts from a pretrained tower: set --config.init.vision=WORKDIR of a "
                             "`python -m vitmm.train` CLIP run (or init.allow_random_tower=True for tests).")
        return params

    def loss_fn(self, params, batch, rng):
        del rng
        logits = self.model.apply({"params": params}, batch["image"], batch["ids"],
                                  prompt_len=batch["prompt_len"], prefix_lm=self.config.model.prefix_lm)
        logits = vlm.text_logits(logits, self.num_visual)
        loss, acc = losses.lm_loss(logits[:, :-1], batch["ids"][:, 1:], batch["answer_mask"][:, 1:])
        return loss, {"token_acc": acc}

    def post_update(self, params):
        return params

    def final_aux(self, params) -> dict:
        return {}

    def evaluators(self):
        c = self.config
        return {name: eval_lib.QAAccuracy(self.model, cfg, c.model.max_len, self.tokenizer,
                                          c.input.image_size, c.model.prefix_lm)
                for name, cfg in _evals_config(c).items()}


def _check_budget(connector: dict, vision: dict, image_size) -> None:
    """The connector's token count on the tower's grid, checked before anything is allocated:
    a budget the family cannot produce, or more visual tokens than the patches they summarise."""
    from vitmm.models import connectors
    from vitmm.models.patch_embed import to_pair
    from vitmm.models.vit import ViT

    grid = tuple(ViT(**vision).grid(to_pair(image_size, "image_size")))
    tokens = connectors.num_visual_tokens(connector, grid)
    if tokens > grid[0] * grid[1]:
        raise connectors.BudgetError(
            f"connector {connector.get('name')!r} with budget {connector.get('budget')!r} gives {tokens} visual "
            f"tokens, more than the {grid[0]}x{grid[1]} = {grid[0] * grid[1]} patches it summarises; choose a "
            f"budget of at most {grid[0] * grid[1]}.")


def _evals_config(config) -> dict:
    """``config.evals`` as plain dicts, each evaluator's ``data_dir`` defaulting to the training
    input's (one setting points a run and all its evaluators at a TFDS folder)."""
    out = {}
    for name, cfg in (config.get("evals") or {}).items():
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        cfg["data"] = dict(cfg.get("data") or {})
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
