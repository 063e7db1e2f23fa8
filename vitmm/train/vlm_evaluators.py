"""Evaluators for VLMs, listed in ``config.evals`` of a ``vlm`` run (``tasks.VLMTask.evaluators``):

* ``qa``: ``QAAccuracy``, greedy-decoded answers to scenes questions, exact match, per kind;
* ``val_loss``: ``VLMValLoss``, the answer-token loss and accuracy on held-out examples.

Same protocol as ``evaluators``: ``run(params) -> dict`` and ``clear()``.
"""

from __future__ import annotations

import jax
import numpy as np

from vitmm.data import pipeline, preprocess
from vitmm.train.eval_embeddings import Prefix


class QAAccuracy:
    """Greedy-decoded answers of a VLM against the reference, exact match, per question kind.

    ``cfg``: ``data`` (name, split, data_dir; a scenes config, or ``scenes_any``: scenes at random
    sizes, e.g. for an AnyRes VLM with the ``anyres`` op in ``pp``), ``pp`` (the preprocessing up to
    ``qa_tokens``, fields filled: the training run's image normalisation and prompt format;
    default ``PP``), ``num_examples`` (images; one seeded random question each),
    ``batch_size``, ``max_new_tokens`` (the longest answer read, in tokens: one token more is
    decoded, ``decoded_tokens``, so that an answer filling the budget is seen to end there and one
    that goes on, e.g. "triangles" for "triangle", is not an exact match).
    """

    PP = "decode|resize({image_size})|normalize({image_mean}, {image_std})|choose|qa_tokens({max_len})"

    def __init__(self, model, cfg: dict, tokenizer, prefix_lm: bool):
        from vitmm import decode
        from vitmm.data import scenes

        data = dict(cfg["data"])
        self.tokenizer, self.prefix_lm = tokenizer, prefix_lm
        self.decode = decode.GreedyDecoder(model, tokenizer.vocab_size)
        self.batch_size = cfg.get("batch_size", 64)
        self.max_new_tokens = cfg.get("max_new_tokens", 8)
        self.decoded_tokens = decoded_tokens(cfg)
        source = pipeline.source_for(data, keys=("image", "questions", "answers", "question_kinds"))
        self.source = Prefix(source, min(cfg.get("num_examples") or len(source), len(source)))
        self.kinds = scenes.QUESTION_KINDS
        pp = preprocess.parse(cfg["pp"], tokenizer)
        wanted = ("image", "ids", "prompt_len", "image_pos", "question", "answer", "question_kind", "visual_mask",
                  "anyres_layout")
        self._pp = lambda ex, rng: {k: v for k, v in pp(ex, rng).items() if k in wanted}

    def _batches(self):
        return pipeline.eval_batches(self.source, self._pp, self.batch_size, process_index=0, process_count=1,
                                     num_threads=1)

    def _rows(self, batch):
        """``(index, question, answer, kind)`` of each real example of ``batch``."""
        for i in np.flatnonzero(batch["_mask"]):
            kind = batch["question_kind"][i]
            yield (int(batch["_index"][i]), str(batch["question"][i]), str(batch["answer"][i]),
                   kind if isinstance(kind, str) else self.kinds[int(kind)])  # scenes_any: names

    def questions(self) -> list[dict]:
        """The questions ``run`` asks, in its order: the split's index, the raw record, the question
        (the pp's own seeded choice), the reference answer and the question kind (e.g. to ask the
        same questions through another harness: ``python -m vitmm.lmms_task``)."""
        return [dict(index=index, record=self.source[index], question=q, answer=a, kind=kind)
                for batch in self._batches() for index, q, a, kind in self._rows(batch)]

    def answers(self, params) -> list[dict]:
        """Every question of ``questions()`` with the model's greedy answer (``prediction``)."""
        variables, out = {"params": params}, []
        for batch in self._batches():
            prompts = batch["ids"].copy()
            prompts[np.arange(prompts.shape[1])[None, :] >= batch["prompt_len"][:, None]] = self.tokenizer.pad_id
            rows = self.decode(variables, batch["image"], prompts, batch["prompt_len"], self.decoded_tokens,
                               self.tokenizer.eos_ids, self.prefix_lm, batch.get("image_pos"),
                               batch.get("visual_mask"), batch.get("anyres_layout"))
            for (index, question, answer, kind), i in zip(self._rows(batch), np.flatnonzero(batch["_mask"]),
                                                          strict=True):
                out.append(dict(index=index, question=question, answer=answer, kind=kind,
                                prediction=answer_text(self.tokenizer, rows[i])))
        return out

    def run(self, params, **_) -> dict:
        answers = self.answers(params)
        correct = np.array([a["prediction"] == a["answer"] for a in answers])
        kinds = np.array([a["kind"] for a in answers])
        result = {"accuracy": float(correct.mean()), "examples": int(len(correct))}
        for name in self.kinds:
            if (kinds == name).any():
                result[f"acc_{name}"] = float(correct[kinds == name].mean())
        return result

    def clear(self) -> None:  # nothing cached between rounds
        pass


def decoded_tokens(cfg: dict) -> int:
    """The tokens a ``qa`` evaluator ``cfg`` decodes: ``max_new_tokens`` and one more, where an
    answer of ``max_new_tokens`` tokens has its EOS (what ``vitmm.lmms_task`` asks lmms-eval for)."""
    return cfg.get("max_new_tokens", 8) + 1


def answer_text(tokenizer, row) -> str:
    """The text of a decoded ``row`` up to the first of the tokenizer's EOS ids (an instruct LM's
    end of turn too), where ``vitmm.serve`` stops the answer."""
    eos = set(tokenizer.eos_ids)
    end = next((i for i, token in enumerate(row) if int(token) in eos), len(row))
    return tokenizer.decode(row[:end])


class VLMValLoss:
    """The VLM's answer-token loss and accuracy on held-out examples (e.g. conversations in any raw
    format), weighted by answer tokens; bad records are masked out and counted (``skipped``).

    ``cfg``: ``data`` (a raw-data spec or a dataset), ``pp`` (default: the training pp),
    ``num_examples``, ``batch_size``. ``loss_fn(params, batch, rng)`` is the task's training loss.
    """

    def __init__(self, loss_fn, cfg: dict, tokenizer, to_row=None):
        source = pipeline.source_for(dict(cfg["data"]))
        self.source = Prefix(source, min(cfg.get("num_examples") or len(source), len(source)))
        self.batch_size = cfg.get("batch_size", 32)
        pp = preprocess.parse(cfg["pp"], tokenizer)
        self._pp = pp if to_row is None else lambda ex, rng: to_row(pp(ex, rng))  # flat sequences, one a row

        def sums(params, batch):
            key = "weights" if "weights" in batch else "answer_mask"
            mask = batch[key] * batch["_mask"][:, None].astype(batch[key].dtype)
            loss, aux = loss_fn(params, {**batch, key: mask}, None)
            tokens = aux["answer_tokens"]  # what the loss averaged over (model.loss_positions: the first K only)
            return loss * tokens, aux["token_acc"] * tokens, tokens

        self._sums = jax.jit(sums)

    def run(self, params, **_) -> dict:
        loss = acc = tokens = 0.0
        kept = 0
        for batch in pipeline.eval_batches(self.source, self._pp, self.batch_size, process_index=0, process_count=1,
                                           num_threads=1):
            numeric = {k: v for k, v in batch.items() if isinstance(v, np.ndarray) and v.dtype.kind in "biuf"}
            sums = [float(x) for x in self._sums(params, numeric)]
            loss, acc, tokens = loss + sums[0], acc + sums[1], tokens + sums[2]
            kept += int(batch["_mask"].sum())
        if tokens == 0:
            raise ValueError("val_loss: no answer tokens in the held-out examples (all bad, or none given).")
        return {"loss": loss / tokens, "token_acc": acc / tokens, "examples": kept,
                "skipped": len(self.source) - kept}

    def clear(self) -> None:
        pass
