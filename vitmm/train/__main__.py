"""``python -m vitmm.train --config configs/X.py[:args] --workdir DIR [--config.key=value]``.

This file only parses flags; the loop is ``vitmm.train.trainer.train``.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from vitmm import xla_flags
from vitmm.train import trainer

config_flags.DEFINE_config_file("config", None, "Config file (with :args).", lock_config=True)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and TensorBoard files go.")
flags.mark_flags_as_required(["config", "workdir"])


def summary_table(summary: dict) -> str:
    """Final evaluation, each metric next to its chance level where one is known."""
    evals = summary["evals"]
    rows = [("zero-shot accuracy", "zeroshot/accuracy", "zeroshot/chance"),
            ("retrieval image→text R@1", "retrieval/i2t_r1", "retrieval/chance_r1"),
            ("retrieval text→image R@1", "retrieval/t2i_r1", "retrieval/chance_r1"),
            ("retrieval image→text R@5", "retrieval/i2t_r5", "retrieval/chance_r5"),
            ("retrieval text→image R@5", "retrieval/t2i_r5", "retrieval/chance_r5"),
            ("validation loss", "val/loss", None)]
    lines = [f"{'after step ' + str(summary['final_step']):<28} {'value':>8} {'chance':>8}"]
    for label, key, chance in rows:
        if key in evals:
            lines.append(f"{label:<28} {evals[key]:>8.3f} "
                         f"{evals[chance] if chance else float('nan'):>8.3f}".replace("nan", "  -"))
    shown = {key for _, key, _ in rows}
    for key, value in evals.items():  # anything else an evaluator reports (e.g. VLM accuracies)
        if key not in shown and "chance" not in key and not key.endswith(("examples", "batches")):
            lines.append(f"{key:<28} {value:>8.3f} {'-':>8}")
    lines.append(f"checkpoints {summary['checkpoints']} in {summary['workdir']}")
    return "\n".join(lines)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    summary = trainer.train(flags.FLAGS.config, flags.FLAGS.workdir)
    if summary["evals"]:
        print(summary_table(summary))


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    app.run(main)
