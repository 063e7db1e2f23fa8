"""lmms-eval, in its own environment, scores a VLM through ``vitmm.serve`` exactly as the run's
``qa`` evaluator does (the same answer to every question, the same accuracy overall and per kind),
here as the token-budget study's evaluator.

``make test`` builds that environment (``.venv-eval``, requirements-eval.txt) and points
``VITMM_LMMS_EVAL_PYTHON`` at it; run elsewhere without it, the lmms-eval test is skipped.
"""

import ast
import json
import os
import pathlib

import pytest

from experiments.bench import lmms_eval as bench
from experiments.token_budget import study
from vitmm import lmms_task, lmms_task_utils

EVAL_PYTHON = os.environ.get("VITMM_LMMS_EVAL_PYTHON", "")

STUDY = '''
from experiments.token_budget.configs import common

def get_config(arg=None):
    c = common.study()
    c.train_config, c.train_args, c.smoke = "configs/vlm_scenes.py", "stage=2", True
    # A smoke VLM trained (LM included) long enough to answer some yes/no questions right.
    c.overrides = {{"input": {{"data_dir": "{data_dir}"}}, "total_steps": 60, "batch_size": 32, "log_every": 60,
                   "eval_every": 60, "checkpoint_every": 60, "evals": {{"qa": {{"num_examples": 24}}}}}}
    c.families, c.budgets, c.seeds, c.tune.lrs, c.blind_args = ("pool",), (4,), (0,), (5e-3,), ""
    c.metric, c.kinds_prefix, c.kinds = "vitmm_qa/accuracy", "vitmm_qa/acc_", ("exists", "count")
    c.lmms_eval.tasks, c.lmms_eval.python = "vitmm_qa", "{python}"
    c.keep_checkpoints = True
    return c
'''


@pytest.mark.skipif(not os.path.exists(EVAL_PYTHON),
                    reason="lmms-eval's environment not built (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
def test_the_budget_study_scores_runs_with_lmms_eval_as_the_qa_evaluator_does(tmp_path, clip_smoke_run):
    config = tmp_path / "study.py"
    config.write_text(STUDY.format(data_dir=clip_smoke_run.data_dir, python=EVAL_PYTHON))
    study.main(["--config", str(config), "--out", str(tmp_path / "out"), "--workdirs", str(tmp_path / "runs")])
    row = json.loads((tmp_path / "out/cells.jsonl").read_text().splitlines()[-1])["results"]["0"]
    workdir = tmp_path / "runs/pool_4_s0"
    own = {k.removeprefix("qa/"): v for line in (workdir / "metrics.jsonl").read_text().splitlines()
           for k, v in json.loads(line).items() if k.startswith("qa/acc")}
    assert own["accuracy"] > 0  # the study's numbers are lmms-eval's, equal to the run's own evaluation:
    assert (row["accuracy"], row["acc_exists"], row["acc_count"]) == tuple(
        round(own[k], 4) for k in ("accuracy", "acc_exists", "acc_count"))

    # lmms-eval's every answer and score against the qa evaluator's on the trained run.
    result = bench.compare(workdir, tmp_path / "runs/pool_4_s0/lmms_eval/lmms/vitmm")
    assert result["questions"] == result["samples"] == 24 and result["differ"] == []
    assert result["lmms"] == result["qa"] == own


def test_a_task_is_refused_for_a_run_without_a_qa_evaluator_and_nothing_is_written(tmp_path, clip_smoke_run, capsys):
    out = tmp_path / "task"
    assert lmms_task.main(["--workdir", str(clip_smoke_run.workdir), "--out", str(out)]) == 2
    assert "has no qa evaluator named 'qa'" in capsys.readouterr().err
    assert not out.exists()


FAKE_LMMS_EVAL = '''#!{python}
"""Stands in for lmms-eval's interpreter: records its arguments and writes the logs in SRC as the run's."""
import os, shutil, sys
open({argv!r}, "w").write(repr(sys.argv))
open({argv!r} + ".image_format", "w").write(os.environ.get("LMMS_IMAGE_ENCODE_FORMAT", "unset"))
shutil.copytree({src!r}, sys.argv[sys.argv.index("--output_path") + 1] + "/vitmm")
'''


def fake_lmms_eval(tmp_path, monkeypatch, samples: list[dict]):
    """``python`` for ``lmms_task.evaluate`` that writes lmms-eval's results and ``samples`` (as
    lmms-eval 0.7.3 logs them), with ``vitmm.serve`` not started; returns (python, the argv file)."""
    import sys

    from vitmm import serve

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "20260101_000000_results.json").write_text(json.dumps(
        {"results": {"vitmm_qa": {"alias": "vitmm_qa", "accuracy,none": 0.75, "accuracy_stderr,none": "N/A"}}}))
    (logs / "20260101_000000_samples_vitmm_qa.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    python = tmp_path / "python"
    python.write_text(FAKE_LMMS_EVAL.format(python=sys.executable, argv=str(tmp_path / "argv"), src=str(logs)))
    python.chmod(0o755)
    monkeypatch.setattr(serve, "Engine", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve, "start_in_thread", lambda engine: ("http://127.0.0.1:1", lambda: None))
    return str(python), tmp_path / "argv"


def sample(doc_id, answer):
    return {"doc_id": doc_id, "target": "no", "filtered_resps": answer, "input": "Is there a star?",
            "accuracy": {"index": doc_id, "kind": "exists", "correct": float(answer == "no")}}


def test_evaluate_gives_no_score_when_lmms_eval_recorded_failed_requests(tmp_path, monkeypatch):
    """lmms-eval 0.7.3 turns a request the server refused (after its retries) into the answer text
    ``[LMMS_EVAL_REQUEST_FAILED …] <error>``, scores it as wrong and exits 0: no accuracy then."""
    failed = ("[LMMS_EVAL_REQUEST_FAILED after 5 retries] Error code: 400 - The question does not fit this model's "
              "max_len of 64 tokens; send a shorter question.")
    python, _ = fake_lmms_eval(tmp_path, monkeypatch, [sample(0, "no"), sample(1, "no"), sample(2, "yes"),
                                                       sample(3, failed)])
    with pytest.raises(RuntimeError, match=r"^lmms-eval recorded 1 of 4 requests as failed \(it scores each as a "
                                           r"wrong answer and exits 0\), so there is no score; the first, doc 3: "
                                           r"\[LMMS_EVAL_REQUEST_FAILED after 5 retries\] Error code: 400 - The "
                                           r"question does not fit .*\(every sample: .*_samples_vitmm_qa\.jsonl\)\.$"):
        lmms_task.evaluate("unused", tmp_path / "out", include_path=tmp_path, python=python)


def test_evaluate_returns_lmms_eval_s_scores_when_every_request_was_answered(tmp_path, monkeypatch):
    python, _ = fake_lmms_eval(tmp_path, monkeypatch, [sample(0, "no"), sample(1, ["yes"])])
    assert lmms_task.evaluate("unused", tmp_path / "out", include_path=tmp_path, python=python) == {
        "vitmm_qa/accuracy": 0.75}


def test_evaluate_gives_no_score_when_lmms_eval_exits_0_without_results_of_its_own(tmp_path, monkeypatch):
    """lmms-eval 0.7.3 prints an error raised while it evaluates (a task that does not load, a failed
    request vitmm's task refuses to score) and exits 0 without writing results: an earlier run's
    results in the same folder are not this run's score."""
    import sys

    python, _ = fake_lmms_eval(tmp_path, monkeypatch, [sample(0, "no")])
    assert lmms_task.evaluate("unused", tmp_path / "out", include_path=tmp_path, python=python) == {
        "vitmm_qa/accuracy": 0.75}
    silent = tmp_path / "silent"
    silent.write_text(f"#!{sys.executable}\nprint('  FileNotFoundError: test.jsonl\\nError during evaluation: "
                      "FileNotFoundError(test.jsonl)')\n")
    silent.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"^lmms-eval exited 0 but wrote no results to .*/out/lmms/vitmm, so there "
                                           r"is no score; the exceptions it printed: FileNotFoundError: test\.jsonl; "
                                           r"the end of its output:   FileNotFoundError: test\.jsonl\nError during "
                                           r"evaluation: FileNotFoundError\(test\.jsonl\)\n$"):
        lmms_task.evaluate("unused", tmp_path / "out", include_path=tmp_path, python=str(silent))


def test_the_task_refuses_to_score_a_request_lmms_eval_recorded_as_failed():
    """lmms-eval hands a request that failed after its retries to ``process_results`` as the answer
    text ``[LMMS_EVAL_REQUEST_FAILED …] <error>``: no score, rather than a wrong answer."""
    doc = {"index": 3, "kind": "exists", "question": "Is there a star?", "answer": "no"}
    assert lmms_task_utils.process_results(doc, ["no"])["accuracy"] == {"index": 3, "kind": "exists", "correct": 1.0}
    assert lmms_task_utils.process_results(doc, ["No."])["accuracy"]["correct"] == 0.0  # exact, as the evaluator
    failed = "[LMMS_EVAL_REQUEST_FAILED after 5 retries] Error code: 404 - {'error': {'message': \"The model ..."
    with pytest.raises(RuntimeError, match=r"^doc 3 \('Is there a star\?'\) has no answer, so there is no score: "
                                           r"lmms-eval recorded its request as failed: \[LMMS_EVAL_REQUEST_FAILED "
                                           r"after 5 retries\] Error code: 404"):
        lmms_task_utils.process_results(doc, [failed])
    with pytest.raises(RuntimeError, match="has no answer"):
        lmms_task_utils.process_results(doc, ["[LMMS_EVAL_BUDGET_EXCEEDED]"])


def test_evaluate_asks_under_an_id_lmms_eval_never_takes_for_a_reasoning_model(tmp_path, monkeypatch):
    """lmms-eval drops the temperature for an id holding o1, o3, o4 or gpt-5, and vitmm.serve then
    samples at 1: ``evaluate`` asks as ``lmms_task.MODEL`` and refuses model_args that name another."""
    python, argv = fake_lmms_eval(tmp_path, monkeypatch, [sample(0, "no")])
    with pytest.raises(ValueError, match=r"^model_args 'model=demo1,max_retries=1' names the model; evaluate\(\) "
                                         r"serves the run as 'vitmm' .*leave model= out\.$"):
        lmms_task.evaluate("unused", tmp_path / "out", include_path=tmp_path, python=python,
                           model_args="model=demo1,max_retries=1")
    assert not argv.exists()  # refused before lmms-eval ran
    monkeypatch.setenv("LMMS_IMAGE_ENCODE_FORMAT", "JPEG")  # lossy: the served pixels would not be the task's
    lmms_task.evaluate("unused", tmp_path / "out", include_path=tmp_path, python=python, model_args="max_retries=1")
    assert pathlib.Path(f"{argv}.image_format").read_text() == "PNG"
    args = ast.literal_eval(argv.read_text())
    model = args[args.index("--model_args") + 1].split(",")
    assert model[0] == f"model={lmms_task.MODEL}" and "max_retries=1" in model
    assert not any(s in lmms_task.MODEL for s in lmms_task.REASONING_SUBSTRINGS)


@pytest.mark.skipif(not os.path.exists(EVAL_PYTHON),
                    reason="lmms-eval's environment not built (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
def test_lmms_eval_s_reasoning_model_rule_is_the_one_lmms_task_avoids():
    """The installed lmms-eval's OpenAI chat model drops the temperature on exactly these substrings."""
    import subprocess

    site = subprocess.run([EVAL_PYTHON, "-c", "import lmms_eval, os; print(os.path.dirname(lmms_eval.__file__))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    source = (pathlib.Path(site) / "models/chat/openai.py").read_text()
    rule = " or ".join(f'"{s}" in self.model_version' for s in lmms_task.REASONING_SUBSTRINGS)
    assert f"if {rule}:\n" in source and 'payload.pop("temperature")' in source


def scenes_with_two_qa_evaluators():
    """``configs/vlm_scenes.py:smoke`` with a second qa evaluator, ``qa_blind``: its images blanked."""
    from vitmm import config_args

    config = config_args.load(pathlib.Path(__file__).parents[1] / "configs/vlm_scenes.py", "smoke")
    with config.unlocked():
        qa = config.evals.qa.to_dict()
        config.evals.qa_blind = dict(qa, pp=qa["pp"].replace("choose|", "blank|choose|"))
    return config


def test_a_task_is_refused_for_an_evaluator_whose_pp_the_server_does_not_prompt_with(tmp_path, monkeypatch, capsys):
    """lmms-eval asks through vitmm.serve, which prompts with ``evals.qa``'s pp: a task written from
    another qa evaluator (here a blind one) would score answers that evaluator never gives."""
    from vitmm import chat
    from vitmm.train import sources, tasks

    config = scenes_with_two_qa_evaluators()
    monkeypatch.setattr(sources, "run_config", lambda workdir, step=None: config)
    out = tmp_path / "task"
    assert lmms_task.main(["--workdir", "W", "--out", str(out), "--evaluator", "qa_blind"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m vitmm.lmms_task: --evaluator qa_blind: its pp (decode|resize(32)|")
    assert err.endswith(", evals.qa's pp), so lmms-eval's answers would not be this evaluator's; write the task from "
                        "a qa evaluator with the served pp.\n") and err.count("\n") == 1 and "|blank|" in err
    assert not out.exists()

    # evals.qa's own pp is the one served: its task is written (up to reading its data, stood in for here)
    def reached(config, cfg, model, tokenizer):
        raise RuntimeError(f"building the {cfg['pp'][:6]}... evaluator")

    monkeypatch.setattr(tasks, "qa_evaluator", reached)
    with pytest.raises(RuntimeError, match=r"^building the decode\.\.\. evaluator$"):
        lmms_task.write("W", tmp_path / "task_qa", evaluator="qa")
    assert "blank" not in chat.served_pp(config)

    # the only qa evaluator not named qa: the server prompts with the default QAAccuracy.PP, not its pp
    with config.unlocked():
        config.evals = {"qa_own": config.evals.qa.to_dict()}
    assert lmms_task.main(["--workdir", "W", "--out", str(out), "--evaluator", "qa_own"]) == 2
    assert "the default qa pp: the run has no evals.qa pp" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(EVAL_PYTHON),
                    reason="lmms-eval's environment not built (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
def test_lmms_eval_sends_a_task_s_images_before_its_text():
    """docs/serve.md's claim: a task without doc_to_messages (vitmm.lmms_task's) is asked as one user
    message, its images first, then the text (lmms-eval's ConfigurableMessagesTask._build_user_turn)."""
    import subprocess

    code = ("from lmms_eval.api.task import ConfigurableMessagesTask as T; from PIL import Image; "
            "print([part['type'] for part in T._build_user_turn([Image.new('RGB', (2, 2))], 'q')[0]['content']])")
    done = subprocess.run([EVAL_PYTHON, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[-2] == "['image', 'text']"


class _AnsweringChat:
    """A chat that answers "no" to every question (one token, then EOS) and keeps each prompt's
    images and turns: what ``vitmm.serve`` made of lmms-eval's requests."""

    max_images, image_separator = 1, "\n"
    tokenizer = type("Tok", (), {"eos_ids": (0,), "decode": staticmethod(lambda ids: "no" * len(ids))})

    def __init__(self):
        self.prompts = []

    def prepare(self, images, turns):
        self.prompts.append((images, turns))
        return {}

    def num_prompt_tokens(self, example):
        return 1

    def stream_batch(self, examples, max_new_tokens, temperature, top_p, seed):
        import numpy as np

        assert temperature == 0 and max_new_tokens == 9  # the task's generation_kwargs: the evaluator's 8 + EOS
        yield np.full(len(examples), 5)
        yield np.zeros(len(examples), int)


def _engine(chat, model_name):
    from vitmm import serve_batching, serve_engine

    engine = serve_engine.Engine.__new__(serve_engine.Engine)
    engine.chat, engine.model_name, engine.local_root = chat, model_name, None
    engine.batcher = serve_batching.Batcher(chat)
    return engine


def written_task(out, monkeypatch) -> list:
    """``lmms_task.write``'s folder at ``out`` for two questions about two scenes (the smoke scenes
    config's qa evaluator, its questions stood in for); returns the images."""
    from types import SimpleNamespace

    from vitmm.data import scenes
    from vitmm.train import sources, tasks

    config = scenes_with_two_qa_evaluators()
    monkeypatch.setattr(sources, "run_config", lambda workdir, step=None: config)
    images = [scenes.generate("easy", 32, i)["image"] for i in range(2)]
    asked = [("Is there a star?", "no", "exists"), ("How many circles are there?", "two", "count")]
    questions = [dict(index=i, record={"image": image}, question=q, answer=a, kind=k)
                 for i, (image, (q, a, k)) in enumerate(zip(images, asked, strict=True))]
    qa = SimpleNamespace(questions=lambda: questions, kinds=scenes.QUESTION_KINDS)
    monkeypatch.setattr(tasks, "qa_evaluator", lambda config, cfg, model, tokenizer: qa)
    assert lmms_task.write("W", out) == {"task": "vitmm_qa", "questions": 2, "kinds": ["exists", "count"]}
    return images


# ~32 s; in make test: the task's refusal of a failed request and evaluate's of a run without results
# (test_the_task_refuses_*, test_evaluate_gives_no_score_*), and a real lmms-eval run of a written task
# (relative data_files included) in test_the_budget_study_scores_runs_*
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(EVAL_PYTHON),
                    reason="lmms-eval's environment not built (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
def test_a_moved_task_is_asked_through_vitmm_serve_and_a_refused_request_gives_no_score(tmp_path, monkeypatch):
    """The real lmms-eval on a task folder written elsewhere and then moved (as a checkout of it is):
    it reads its questions and images, the server gets each image and question as the evaluator asks
    them, and its answers are scored. Against a server that refuses every request lmms-eval scores
    nothing (the task raises on the failed requests, lmms-eval exits 0 without results) and
    ``evaluate`` gives no score, not the earlier run's in the same folder."""
    import shutil

    from vitmm import serve

    images = written_task(tmp_path / "written", monkeypatch)
    shutil.move(tmp_path / "written", tmp_path / "moved")
    chat = _AnsweringChat()
    monkeypatch.setattr(serve, "Engine", lambda workdir, model_name: _engine(chat, model_name))
    assert lmms_task.evaluate("W", tmp_path / "out", include_path=tmp_path / "moved", python=EVAL_PYTHON) == {
        "vitmm_qa/accuracy": 0.5, "vitmm_qa/acc_exists": 1.0, "vitmm_qa/acc_count": 0.0}
    asked = sorted(chat.prompts, key=lambda prompt: prompt[1][0]["value"])
    assert [turns for _, turns in asked] == [[{"from": "human", "value": "<image>\nHow many circles are there?"}],
                                             [{"from": "human", "value": "<image>\nIs there a star?"}]]
    assert all((got[0] == image).all() for (got, _), image in zip(asked, images[::-1], strict=True))

    monkeypatch.setattr(serve, "Engine", lambda workdir, model_name: _engine(chat, "another"))
    with pytest.raises(RuntimeError, match=r"^lmms-eval exited 0 but wrote no results .*; the exceptions it printed: "
                                           r"RuntimeError: doc \d \('[^']*'\) has no answer, so there is no score: "
                                           r"lmms-eval recorded its request as failed: "
                                           r"\[LMMS_EVAL_REQUEST_FAILED after 1 retries\] Error code: 404 "
                                           r".*does not exist"):
        lmms_task.evaluate("W", tmp_path / "out", include_path=tmp_path / "moved", python=EVAL_PYTHON,
                           model_args="max_retries=1")


LOCAL_MME = '''
import os, sys, datasets, lmms_eval.tasks
from PIL import Image
from lmms_eval.tasks import TaskManager, get_task_dict
root, tasks = sys.argv[1], sys.argv[2]
features = datasets.Features({name: datasets.Value("string") for name in ("question_id", "question", "answer",
                                                                          "category")} | {"image": datasets.Image()})
datasets.Dataset.from_dict({"question_id": ["a.png"], "image": [Image.new("RGB", (40, 30), "red")],
                            "category": ["color"], "question": ["Is it red? Please answer yes or no."],
                            "answer": ["Yes"]},
                           features=features).to_parquet(f"{root}/data/test-00000-of-00001.parquet")
own = os.path.dirname(lmms_eval.tasks.__file__)
open(f"{tasks}/mme_local.yaml", "w").write(f"include: {own}/mme/mme.yaml\\ntask: mme_local\\ndataset_path: {root}\\n")
task = get_task_dict(["mme_local"], TaskManager(include_path=tasks), task_type="chat")["mme_local"]
doc = task.test_docs()[0]
print([(part["type"], part.get("text")) for part in task.doc_to_messages(doc)[0]["content"]])
print(task.process_results(doc, ["yes."]))
'''


@pytest.mark.slow  # ~9 s: docs/serve.md's recipe for lmms-eval's own tasks on local data, end to end
@pytest.mark.skipif(not os.path.exists(EVAL_PYTHON),
                    reason="lmms-eval's environment not built (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
def test_a_standard_task_reads_a_local_copy_of_its_dataset_as_docs_serve_md_says(tmp_path):
    """docs/serve.md's recipe: a YAML including lmms-eval's MME task with ``dataset_path`` a local copy in
    the HF parquet layout loads offline, and asks one user message: the image, then MME's question."""
    import subprocess

    (tmp_path / "MME/data").mkdir(parents=True)
    (tmp_path / "tasks").mkdir()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([EVAL_PYTHON, "-c", LOCAL_MME, str(tmp_path / "MME"), str(tmp_path / "tasks")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parts, score = done.stdout.strip().split("\n")[-2:]
    assert parts == "[('image', None), ('text', 'Is it red?\\nAnswer the question using a single word or phrase.')]"
    assert "'score': 1" in score  # MME's own normalisation: "yes." is "Yes"
