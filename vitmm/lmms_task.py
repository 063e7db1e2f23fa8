"""A trained VLM's ``qa`` questions as a local lmms-eval task, to score it through lmms-eval.

    python -m vitmm.lmms_task --workdir workdirs/vlm_s2 --out tasks/vlm_s2_qa
    python -m vitmm.serve --workdir workdirs/vlm_s2 --port 8000 --model_name vitmm &
    .venv-eval/bin/python -m lmms_eval eval --model openai \\
        --model_args model=vitmm,base_url=http://127.0.0.1:8000/v1 \\
        --include_path tasks/vlm_s2_qa --tasks vitmm_qa --log_samples --output_path lmms_out

The task holds exactly the questions the run's ``qa`` evaluator asks (the same images of the same
split, the same seeded choice of one question per image, its ``num_examples`` and the tokens it
decodes: ``max_new_tokens`` and one more, where a full-length answer ends), each image as a PNG file
(lossless: the server decodes the pixels the evaluator read), and scores as the evaluator does
(exact match, overall and per question kind), so lmms-eval through ``vitmm.serve`` gives the
evaluator's numbers at temperature 0 (``tests/test_lmms_eval.py``), under a model id in which
lmms-eval sees no reasoning model (``MODEL``; one holding ``o1``, ``o3``, ``o4`` or ``gpt-5`` makes
it drop the temperature, and the server then samples). Nothing comes from a hub: the YAML points
lmms-eval's ``json`` loader at ``test.jsonl`` next to it (lmms-eval 0.7.3 reads a relative
``data_files`` path from the YAML's folder), and ``utils.py`` reads the images from its own folder,
so the folder works wherever it is moved or checked out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from vitmm import lmms_task_utils

_YAML = """\
# Written by `python -m vitmm.lmms_task` from {workdir}: its `{evaluator}` evaluator's questions.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: test.jsonl  # next to this file: lmms-eval reads a relative path from the YAML's folder
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: !function utils.doc_to_target
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  temperature: 0
  do_sample: false
process_results: !function utils.process_results
metric_list:
{metrics}
metadata:
  version: 1.0
"""


def write(workdir, out, task: str = "vitmm_qa", evaluator: str = "qa", step: int | None = None) -> dict:
    """Writes the task folder ``out`` (YAML, ``utils.py``, ``kinds.json``, ``test.jsonl``, ``images/``);
    returns ``{"task", "questions", "kinds"}``. ``ValueError`` for a workdir without that evaluator, or
    one whose pp is not the one ``vitmm.serve`` prompts with (``chat.served_pp``): its answers would
    not be lmms-eval's."""
    from PIL import Image

    from vitmm import chat, cli
    from vitmm.data import preprocess
    from vitmm.train import pp_template, sources, tasks
    from vitmm.train.vlm_evaluators import QAAccuracy, decoded_tokens

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", task):
        raise ValueError(f"--task {task!r}: a task name is letters, digits, '_', '.' and '-' (lmms-eval's "
                         "--tasks names it; it is the YAML's file name).")
    def own(names):  # a task folder written before (e.g. moved, and written again where it now is)
        return names <= {"images", "test.jsonl", "kinds.json", "utils.py", "lmms"} | \
            {n for n in names if n.endswith(".yaml")}

    workdir, out = Path(workdir), cli.new_output_folder(out, reusable=own)
    config = sources.run_config(workdir, step)
    evals = tasks.evals_config(config) if config.get("task") == "vlm" else {}
    if evals.get(evaluator, {}).get("type") != "qa":
        have = sorted(k for k, v in evals.items() if v.get("type") == "qa")
        raise ValueError(f"{workdir} has no qa evaluator named {evaluator!r} (its qa evaluators: {have or 'none'}); "
                         "a task is written from a VLM run's qa evaluator.")
    cfg = evals[evaluator]
    # lmms-eval asks through vitmm.serve, which prompts every question with one pp (chat.served_pp):
    # an evaluator with another (a blind `blank|`, another format) would be scored on answers it never gives.
    own = pp_template.pp_string(config, (cfg.get("pp") or QAAccuracy.PP).replace("choose|", ""))
    served, source = chat.served_pp(config, why=True)
    if preprocess.ops(own) != preprocess.ops(served):
        raise ValueError(f"--evaluator {evaluator}: its pp ({own}) is not the one vitmm.serve prompts with ({served}, "
                         f"{source}), so lmms-eval's answers would not be this evaluator's; write the task from a qa "
                         "evaluator with the served pp.")
    qa = tasks.qa_evaluator(config, cfg, None, tasks.tokenizer_for(config))
    questions = qa.questions()
    decode = preprocess.parse("decode")
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for q in questions:
        name = f"images/{q['index']:06d}.png"
        Image.fromarray(decode(dict(q["record"]), None)["image"]).save(out / name)
        rows.append(dict(index=q["index"], image=name, question=q["question"], answer=q["answer"], kind=q["kind"]))
    with open(out / "test.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    kinds = [k for k in qa.kinds if any(row["kind"] == k for row in rows)]  # as the evaluator reports them
    (out / "kinds.json").write_text(json.dumps(kinds))
    shutil.copyfile(Path(__file__).with_name("lmms_task_utils.py"), out / "utils.py")
    metrics = "\n".join(f"  - metric: {m}\n    aggregation: !function utils.{m}\n    higher_is_better: true"
                        for m in ["accuracy", *(f"acc_{k}" for k in kinds)])
    (out / f"{task}.yaml").write_text(_YAML.format(
        workdir=workdir, evaluator=evaluator, task=task, max_new_tokens=decoded_tokens(cfg), metrics=metrics))
    return {"task": task, "questions": len(rows), "kinds": kinds}


# The model id evaluate() serves the run under and hands lmms-eval. lmms-eval 0.7.3's OpenAI chat model
# (models/chat/openai.py, build_payload_for_index) treats an id as a reasoning model when
# `"o1" in id or "o3" in id or "o4" in id or "gpt-5" in id` (a case-sensitive substring test) and
# then drops the task's temperature from the request, which vitmm.serve reads as OpenAI's default 1:
# sampled answers, not the evaluator's greedy ones. This id holds none of the four.
MODEL = "vitmm"
REASONING_SUBSTRINGS = ("o1", "o3", "o4", "gpt-5")

# What lmms-eval 0.7.3's OpenAI chat model (models/chat/openai.py) records as the *answer* of a request
# that failed after its retries, or that its token budget stopped: a task scores that text (vitmm's own
# raises on it instead, lmms_task_utils.process_results), and lmms-eval exits 0.
FAILED_MARKERS = lmms_task_utils.FAILED_MARKERS


def check_requests(folder, stamp: str) -> None:
    """``RuntimeError`` when lmms-eval's samples of the run ``stamp`` (``<stamp>_samples_<task>.jsonl``
    in ``folder``, written by ``--log_samples``) hold a failed request. lmms-eval scores such a
    request's error text as a wrong answer and exits 0, so its accuracy would no longer be the
    evaluator's: a request ``vitmm.serve`` refused (a 400 for a question too long, a 404 for another
    model id) would lower the score without a word."""
    failed, total = [], 0
    for path in sorted(Path(folder).glob(f"{stamp}_samples_*.jsonl")):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            total += 1
            texts = [sample.get("resps"), sample.get("filtered_resps")]
            while any(isinstance(t, list) for t in texts):  # nested per request and per filter
                texts = [x for t in texts for x in (t if isinstance(t, list) else [t])]
            bad = next((t for t in texts if isinstance(t, str) and t.startswith(FAILED_MARKERS)), None)
            if bad is not None:
                failed.append((path, sample.get("doc_id"), bad))
    if failed:
        path, doc, text = failed[0]
        text = " ".join(text.split())
        raise RuntimeError(f"lmms-eval recorded {len(failed)} of {total} requests as failed (it scores each as a wrong "
                           f"answer and exits 0), so there is no score; the first, doc {doc}: {text} (every sample: "
                           f"{path}).")


def evaluate(workdir, out, tasks: str = "vitmm_qa", include_path=None, python: str = ".venv-eval/bin/python",
             model_args: str = "", timeout: float = 3600) -> dict:
    """Scores ``workdir`` with lmms-eval (``python``: its environment's interpreter) through
    ``vitmm.serve`` on a free local port, served from this process: ``tasks`` from ``include_path``,
    or (None) the run's own ``qa`` task written to ``out/task``. Returns ``{"<task>/<metric>": value}``; lmms-eval's
    output (with every sample) stays in ``out/lmms``. ``RuntimeError`` with the tail of what failed (lmms-eval
    exiting 0 without writing results of this run among it), or naming the requests lmms-eval recorded as
    failed (``check_requests``): no score then."""
    import os
    import subprocess

    from vitmm import serve

    workdir, out = Path(workdir), Path(out)
    named = [arg.split("=", 1)[0].strip() for arg in model_args.split(",") if arg.strip()]
    if {"model", "model_version"} & set(named):
        raise ValueError(f"model_args {model_args!r} names the model; evaluate() serves the run as {MODEL!r} and "
                         "asks for it (an id holding o1, o3, o4 or gpt-5 makes lmms-eval drop the temperature): "
                         "leave model= out.")
    if not Path(python).is_file():
        raise FileNotFoundError(f"No lmms-eval interpreter at {python}; make eval-env builds .venv-eval.")
    if include_path is None:
        include_path = out / "task"
        write(workdir, include_path, tasks)
    logs = out / "lmms" / MODEL  # lmms-eval's results of earlier runs there are not this run's
    before = {path: path.stat().st_mtime_ns for path in logs.glob("*_results.json")}
    url, stop = serve.start_in_thread(serve.Engine(workdir, model_name=MODEL))
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
               "HF_DATASETS_OFFLINE": os.environ.get("HF_DATASETS_OFFLINE", "1"),
               "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "unused"),
               "LMMS_IMAGE_ENCODE_FORMAT": "PNG"}  # lossless, as lmms-eval's default: the task's own pixels
        env.pop("XLA_FLAGS", None)
        args = f"model={MODEL},base_url={url}/v1" + (f",{model_args}" if model_args else "")
        done = subprocess.run([python, "-m", "lmms_eval", "eval", "--model", "openai", "--model_args", args,
                               "--include_path", str(include_path), "--tasks", tasks, "--log_samples",
                               "--output_path", str(out / "lmms")], env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        stop()
    if done.returncode != 0:
        raise RuntimeError(f"lmms-eval failed (exit {done.returncode}): {(done.stdout + done.stderr)[-3000:]}")
    # lmms-eval 0.7.3 prints an error raised while it evaluates (a task that does not load, a failed request
    # vitmm's task refuses to score) and exits 0 without results: a run with no results file of its own failed
    written = [path for path in sorted(logs.glob("*_results.json")) if before.get(path) != path.stat().st_mtime_ns]
    if not written:  # the exceptions it printed first: the cause may be far from the end of a long traceback
        output = done.stdout + done.stderr
        errors = dict.fromkeys(line.strip() for line in output.splitlines()
                               if re.match(r"[A-Za-z_][\w.]*(Error|Exception): ", line.strip()))
        raise RuntimeError(f"lmms-eval exited 0 but wrote no results to {logs}, so there is no score; the exceptions "
                           f"it printed: {' | '.join(errors) or 'none'}; the end of its output: {output[-2000:]}")
    found = written[-1]
    check_requests(found.parent, found.name.removesuffix("_results.json"))
    results = json.loads(found.read_text())
    return {f"{task}/{key.split(',')[0]}": value for task, metrics in results["results"].items()
            for key, value in metrics.items() if key.endswith(",none") and "stderr" not in key}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a `python -m vitmm.train` VLM workdir with a qa evaluator")
    parser.add_argument("--out", required=True, help="the task folder to write (lmms-eval's --include_path)")
    parser.add_argument("--task", default="vitmm_qa", help="the task's name (lmms-eval's --tasks)")
    parser.add_argument("--evaluator", default="qa", help="which qa evaluator of config.evals")
    args = parser.parse_args(argv)
    from vitmm import console

    console.quiet()  # the libraries' expected warnings (vitmm/console.py)
    try:
        info = write(args.workdir, args.out, args.task, args.evaluator)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"python -m vitmm.lmms_task: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: task {info['task']!r}, {info['questions']} questions ({', '.join(info['kinds'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
