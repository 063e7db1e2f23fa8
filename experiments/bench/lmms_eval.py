"""lmms-eval through ``vitmm.serve`` against vitmm's own ``qa`` evaluator on one trained VLM: the
same answers and scores (checked question by question), and what each way costs in wall time.

    make eval-env    # lmms-eval's environment, .venv-eval
    python -m experiments.bench.lmms_eval --workdir workdirs/vlm_pool16_s2 --out results/serve_lmms_eval

The evaluator runs in this process twice (the first run compiles); lmms-eval runs as a user runs it
(``vitmm.lmms_task.evaluate``: the run's questions written as a task, ``vitmm.serve`` on a
free port, ``python -m lmms_eval`` from ``--python``), timed from the server's start to lmms-eval's
exit, with lmms-eval's own evaluation time (its requests, after its start-up) beside it. Writes
``lmms_eval.json`` and ``README.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import statistics
import tempfile
import time


def _qa(workdir):
    """The VLM of ``workdir`` (``vitmm.chat``) and its run's ``qa`` evaluator on that model."""
    from vitmm import chat
    from vitmm.train import tasks

    vlm = chat.load(workdir)
    return vlm, tasks.qa_evaluator(vlm.config, tasks.evals_config(vlm.config)["qa"], vlm.task.model, vlm.tokenizer)


def compare(workdir, lmms_dir) -> dict:
    """lmms-eval's samples and scores in ``lmms_dir`` (its ``--output_path``/<model>) against the
    ``qa`` evaluator's answers on ``workdir``: the counts, the questions whose answers differ, and
    both sets of scores."""
    lmms_dir = pathlib.Path(lmms_dir)
    vlm, qa = _qa(workdir)
    expected = {a["index"]: a for a in qa.answers(vlm.params)}
    samples = [json.loads(line) for line in open(glob.glob(str(lmms_dir / "*_samples_*.jsonl"))[-1])]
    differ = [s["accuracy"]["index"] for s in samples
              if s["filtered_resps"] != expected[s["accuracy"]["index"]]["prediction"]
              or s["target"] != expected[s["accuracy"]["index"]]["answer"]]
    results = json.loads(pathlib.Path(sorted(glob.glob(str(lmms_dir / "*_results.json")))[-1]).read_text())
    lmms = {k.split(",")[0]: v for task in results["results"].values() for k, v in task.items()
            if k.endswith(",none") and "stderr" not in k}
    correct = {i: a["prediction"] == a["answer"] for i, a in expected.items()}
    own = {"accuracy": sum(correct.values()) / len(correct)}
    for kind in qa.kinds:
        mine = [correct[i] for i, a in expected.items() if a["kind"] == kind]
        if mine:
            own[f"acc_{kind}"] = sum(mine) / len(mine)
    return dict(questions=len(expected), samples=len(samples), differ=differ, lmms=lmms, qa=own,
                evaluation_s=float(results["total_evaluation_time_seconds"]))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a VLM workdir with a qa evaluator")
    parser.add_argument("--out", default="results/serve_lmms_eval")
    parser.add_argument("--python", default=".venv-eval/bin/python", help="lmms-eval's interpreter")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way (medians, ranges)")
    args = parser.parse_args(argv)
    from vitmm import lmms_task

    vlm, qa = _qa(args.workdir)
    inprocess, through, evaluation = [], [], []
    for _ in range(1 + args.repeats):
        start = time.perf_counter()
        qa.run(vlm.params)
        inprocess.append(time.perf_counter() - start)
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            lmms_task.evaluate(args.workdir, tmp, python=args.python)
            through.append(time.perf_counter() - start)
            result = compare(args.workdir, pathlib.Path(tmp) / "lmms/vitmm")
            evaluation.append(result["evaluation_s"])
            if result["differ"] or result["lmms"] != result["qa"]:
                break
    result.update(workdir=str(args.workdir), repeats=len(through), qa_cold_s=round(inprocess[0], 1),
                  qa_warm_s=_median(inprocess[1:]), lmms_end_to_end_s=_median(through),
                  evaluation_s=_median(evaluation), date=time.strftime("%Y-%m-%d"))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lmms_eval.json").write_text(json.dumps(result, indent=1) + "\n")
    names = list(result["qa"])
    lines = [f"# lmms-eval through vitmm.serve vs the qa evaluator ({result['date']}, 2-core CPU)", "",
             f"`python -m experiments.bench.lmms_eval --workdir {args.workdir}` on {result['questions']} validation "
             f"questions; answers that differ: {len(result['differ'])}.", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
             "| `qa` evaluator | " + " | ".join(f"{result['qa'][k]:.4f}" for k in names) + " |",
             "| lmms-eval | " + " | ".join(f"{result['lmms'].get(k, float('nan')):.4f}" for k in names) + " |", "",
             f"Wall time, medians of {len(through)} runs (range): the evaluator in-process {result['qa_cold_s']} s the "
             f"first time (compiling), then {_fmt(result['qa_warm_s'])}; lmms-eval {_fmt(result['lmms_end_to_end_s'])}"
             f" from the server's start to its exit, of which {_fmt(result['evaluation_s'])} its evaluation (the "
             "requests, the server compiling its decode shapes; the rest is the two programs starting)."]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def _median(xs: list[float]) -> list[float]:
    """``[median, min, max]`` rounded to 0.1 s."""
    return [round(float(v), 1) for v in (statistics.median(xs), min(xs), max(xs))]


def _fmt(m: list[float]) -> str:
    return f"{m[0]} s ({m[1]}–{m[2]})"


if __name__ == "__main__":
    main()
