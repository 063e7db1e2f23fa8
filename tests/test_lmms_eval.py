"""lmms-eval, in its own environment, scores a VLM through ``vitmm.serve`` exactly as the run's
``qa`` evaluator does: the same answer to every question, the same accuracy overall and per kind.

``make test`` builds that environment (``.venv-eval``, requirements-eval.txt) and points
``VITMM_LMMS_EVAL_PYTHON`` at it; run elsewhere without it, the test is skipped.
"""

import glob
import json
import os
import subprocess

import pytest

from vitmm import lmms_task, serve
from vitmm.config_args import load
from vitmm.train import tasks, trainer

EVAL_PYTHON = os.environ.get("VITMM_LMMS_EVAL_PYTHON", "")


@pytest.mark.skipif(not os.path.exists(EVAL_PYTHON),
                    reason="lmms-eval's environment not built (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
def test_lmms_eval_through_the_server_gives_the_qa_evaluators_answers_and_scores(tmp_path, clip_smoke_run):
    # A smoke VLM trained (LM included) long enough to answer some yes/no questions right.
    config = load("configs/vlm_scenes.py", "smoke,stage=2", **{
        "input.data_dir": clip_smoke_run.data_dir, "total_steps": 150, "batch_size": 32, "optim.lr": 3e-3,
        "log_every": 150, "eval_every": 150, "checkpoint_every": 150, "evals.qa.num_examples": 24})
    summary = trainer.train(config, tmp_path / "vlm")["evals"]
    assert summary["qa/accuracy"] > 0
    info = lmms_task.write(tmp_path / "vlm", tmp_path / "task")
    assert info["questions"] == 24

    engine = serve.Engine(tmp_path / "vlm")
    url, stop = serve.start_in_thread(engine)
    try:
        env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "OPENAI_API_KEY": "unused"}
        env.pop("XLA_FLAGS", None)
        done = subprocess.run(
            [EVAL_PYTHON, "-m", "lmms_eval", "eval", "--model", "openai",
             "--model_args", f"model=vlm,base_url={url}/v1,num_concurrent=4", "--include_path",
             str(tmp_path / "task"), "--tasks", "vitmm_qa", "--log_samples", "--output_path", str(tmp_path / "out")],
            env=env, capture_output=True, text=True, timeout=300)
    finally:
        stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    qa = tasks.qa_evaluator(engine.chat.config, tasks.evals_config(engine.chat.config)["qa"],
                            engine.chat.task.model, engine.chat.tokenizer)
    expected = {a["index"]: a for a in qa.answers(engine.chat.params)}
    samples = [json.loads(line) for line in open(glob.glob(str(tmp_path / "out/vlm/*_samples_vitmm_qa.jsonl"))[0])]
    assert len(samples) == len(expected) == 24
    for sample in samples:
        index = sample["accuracy"]["index"]
        assert sample["filtered_resps"] == expected[index]["prediction"], (index, sample)
        assert sample["target"] == expected[index]["answer"]
    scores = json.load(open(glob.glob(str(tmp_path / "out/vlm/*_results.json"))[0]))["results"]["vitmm_qa"]
    own = {k.removeprefix("qa/"): v for k, v in summary.items() if k.startswith("qa/acc")}
    assert own == {k.split(",")[0]: v for k, v in scores.items() if k.endswith(",none") and "stderr" not in k}
