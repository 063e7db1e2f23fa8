"""The functions of a task written by ``python -m vitmm.lmms_task``, run by lmms-eval.

This file is copied next to the task's YAML (as ``utils.py``) and imported by lmms-eval in its own
environment, so it needs nothing but Pillow. It scores the way vitmm's ``qa`` evaluator does: a
prediction is right when it equals the reference answer exactly (no stripping, no lower-casing),
overall (``accuracy``) and per question kind (``acc_<kind>``, the kinds listed in ``kinds.json``).

A request lmms-eval's OpenAI model could not get answered (the server refused it, or it never
reached the server) comes here as the answer text ``[LMMS_EVAL_REQUEST_FAILED …] <error>``;
``process_results`` raises on it rather than score it as a wrong answer, so lmms-eval gives no
score for the run instead of a lower one.
"""

import json
import os

from PIL import Image

_HERE = os.path.dirname(os.path.abspath(__file__))
_KINDS = os.path.join(_HERE, "kinds.json")
# What lmms-eval 0.7.3's OpenAI chat model (models/chat/openai.py) records as the answer of a request
# that failed after its retries, or that its token budget stopped.
FAILED_MARKERS = ("[LMMS_EVAL_REQUEST_FAILED", "[LMMS_EVAL_BUDGET_EXCEEDED")
KINDS = json.load(open(_KINDS)) if os.path.exists(_KINDS) else []  # none inside vitmm's own package  # noqa: SIM115


def doc_to_visual(doc):
    with Image.open(os.path.join(_HERE, doc["image"])) as image:
        return [image.convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def doc_to_target(doc):
    return doc["answer"]


def process_results(doc, results):
    answer = results[0]
    if isinstance(answer, str) and answer.startswith(FAILED_MARKERS):
        raise RuntimeError(f"doc {doc['index']} ({doc['question']!r}) has no answer, so there is no score: lmms-eval "
                           f"recorded its request as failed: {' '.join(answer.split())}")
    row = {"index": doc["index"], "kind": doc["kind"], "correct": float(answer == doc["answer"])}
    return {"accuracy": row, **{f"acc_{kind}": row for kind in KINDS}}


def accuracy(rows):
    return sum(r["correct"] for r in rows) / len(rows)


def _accuracy_of(kind):
    def aggregate(rows):
        mine = [r for r in rows if r["kind"] == kind]
        return accuracy(mine) if mine else float("nan")

    return aggregate


for _kind in KINDS:
    globals()[f"acc_{_kind}"] = _accuracy_of(_kind)
