"""``python -m vitmm.train --config configs/X.py[:args] --workdir DIR [--config.key=value]``.

This file parses flags and turns errors into exit codes; the loop is ``vitmm.train.trainer.train``.
Exit codes: 0 done; 2 a bad flag, config value, checkpoint or input (one message, no traceback);
1 the run stopped on a failure it names (non-finite loss, a failed save, no readable
checkpoint: ``--restart`` then trains afresh, keeping the old log aside); 75 preempted by
SIGTERM/SIGINT after saving a checkpoint (rerun to resume).
``--dry_run`` compiles the step and prints its memory per device and FLOPs, training nothing
(``vitmm.train.dry_run``). ``--debug`` (or ``VITMM_DEBUG=1``) shows the traceback instead. The
libraries' errors of a failed save or checkpoint read go to ``WORKDIR/errors.log``; their warnings
of a healthy run stay off the console unless ``--verbose`` (``vitmm.console``).
"""

import os
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

from vitmm import checkpoint as ckpt_lib
from vitmm import config_args, console, xla_flags
from vitmm.train import startup, trainer
from vitmm.train import workdir as workdir_lib

PREEMPTED = 75  # EX_TEMPFAIL: try again (resume)
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports an interrupted command
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, workdir_lib.WorkdirLocked)
RUN_FAILURES = (FloatingPointError, ckpt_lib.SaveFailed, ckpt_lib.NoReadableCheckpoint, startup.ProcessZeroFailed)

config_flags.DEFINE_config_file("config", None, "Config file (with :args).", lock_config=True)
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and TensorBoard files go.")
flags.DEFINE_bool("debug", False, "Show tracebacks instead of one-line errors.")
flags.DEFINE_bool("verbose", False, "Print the libraries' INFO lines and the warnings every run gets.")
flags.DEFINE_bool("restart", False, "Train from step 0 in a workdir whose earlier run no checkpoint can resume "
                  "(its metrics.jsonl is kept aside).")
flags.DEFINE_bool("dry_run", False, "Compile the training step without training and print what it needs per "
                  "device (parameters, optimizer state, batch, temporaries) and its FLOPs; nothing is written.")
flags.DEFINE_string("dry_run_target", None, "With --dry_run: compile for GPUs of this card (h100, h200, a100) "
                    "instead of this machine's devices; needs JAX's CUDA plugin, not a GPU.")
flags.DEFINE_integer("dry_run_devices", 1, "With --dry_run_target: how many such GPUs (batch_size is the global "
                     "batch).")
flags.mark_flags_as_required(["config", "workdir"])


def _debug(argv=()) -> bool:
    return os.environ.get("VITMM_DEBUG", "") not in ("", "0") or "--debug" in argv


def _fail(message: str, code: int) -> None:
    print(f"python -m vitmm.train: {message}", file=sys.stderr)
    if code == 2:
        print("(--debug shows the traceback)", file=sys.stderr)
    sys.exit(code)


def parse_flags(argv):
    """absl's parsing, with a bad flag, config file or config override reported in one line (exit 2)."""
    spec = config_args.config_spec(argv)
    if spec is not None and not os.path.isfile(spec.partition(":")[0]) and not _debug(argv):
        _fail(f"--config {spec.partition(':')[0]}: no such file; the configs are in configs/ (listed in README.md).",
              2)
    try:
        parsed = flags.FLAGS(argv)
        flags.FLAGS.config.get("task")  # config_flags reports a config file that failed to load only when used
    except Exception as err:  # noqa: BLE001 - config_flags raises whatever the config file raised
        if _debug(argv):
            raise
        _fail(config_args.unknown_override(argv, keys_are="listed in README.md (Config keys)") or _one_line(err), 2)
    problem = _flags_problem(flags.FLAGS)
    if problem:
        _fail(problem, 2)
    return parsed


def _flags_problem(f) -> str | None:
    """Flags that parse but would do something else than asked: an empty ``--workdir`` (``--workdir=$W``
    with W unset: the current folder), a dry run's flag without ``--dry_run`` (a training run), devices
    without a target (ignored: this machine's devices are compiled for)."""
    if not f.workdir.strip():
        return "--workdir is empty (an unset shell variable?); name the folder the run writes checkpoints to."
    devices = f"--dry_run_devices={f.dry_run_devices}" if f.dry_run_devices != 1 else None
    if not f.dry_run and (f.dry_run_target or devices):
        given = f"--dry_run_target={f.dry_run_target}" if f.dry_run_target else devices
        return (f"{given} applies to --dry_run only; add --dry_run to compile the step without training, or leave it "
                "out to train.")
    if devices and not f.dry_run_target:
        from vitmm.train.gpu_targets import CARDS

        return (f"{devices} counts GPUs of --dry_run_target; add --dry_run_target=h100 ({', '.join(sorted(CARDS))}), "
                "or leave it out to compile for this machine's devices.")
    return None


def _one_line(err: Exception) -> str:
    """A flag or config error in one line. A user error says itself, without its exception's name, as
    the run's own one-line errors do (``Unknown config arg 'stepz' …``, not ``ValueError: …``, the last line
    of the config file's traceback that absl's error carries); any other error from a broken config file
    keeps its name, the cause (``NameError: name 'x' is not defined``)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    if not lines:
        return repr(err)
    name, sep, message = lines[-1].partition(": ")
    if sep and name in {e.__name__ for e in USER_ERRORS}:
        return message
    if not isinstance(err, (flags.Error, *USER_ERRORS)):  # raised by the config file when first used
        return f"{type(err).__name__}: {lines[-1]}"
    return lines[-1]


def summary_table(summary: dict) -> str:
    """Final evaluation, each metric next to its chance level where one is known."""
    evals = summary["evals"]
    rows = [("zero-shot accuracy", "zeroshot/accuracy", "zeroshot/chance"),
            ("zero-shot top-5 accuracy", "zeroshot/top5", "zeroshot/top5_chance"),
            ("retrieval image→text R@1", "retrieval/i2t_r1", "retrieval/chance_r1"),
            ("retrieval text→image R@1", "retrieval/t2i_r1", "retrieval/chance_r1"),
            ("retrieval image→text R@5", "retrieval/i2t_r5", "retrieval/chance_r5"),
            ("retrieval text→image R@5", "retrieval/t2i_r5", "retrieval/chance_r5"),
            ("retrieval image→text R@10", "retrieval/i2t_r10", "retrieval/chance_r10"),
            ("retrieval text→image R@10", "retrieval/t2i_r10", "retrieval/chance_r10"),
            ("validation loss", "val/loss", None)]
    lines = [f"{'after step ' + str(summary['final_step']):<28} {'value':>8} {'chance':>8}"]
    for label, key, chance in rows:
        if key in evals:
            # several captions an image: each direction has its own chance level
            direction = key.split("/")[1].split("_")[0]  # i2t, t2i
            chance = chance and (chance if chance in evals else chance.replace("/", f"/{direction}_"))
            lines.append(f"{label:<28} {evals[key]:>8.3f} "
                         f"{evals[chance] if chance else float('nan'):>8.3f}".replace("nan", "  -"))
    shown = {key for _, key, _ in rows}
    for key, value in evals.items():  # anything else an evaluator reports (e.g. VLM accuracies)
        if key not in shown and "chance" not in key and not key.endswith(("examples", "batches")):
            lines.append(f"{key:<28} {value:>8.3f} {'-':>8}")
    lines.append(checkpoints_line(summary))
    return "\n".join(lines)


def checkpoints_line(summary: dict) -> str:
    return f"checkpoints {summary['checkpoints']} in {summary['workdir']}"


def final_report(summary: dict, config) -> str:
    """What a finished run prints: the final evaluation's table (``summary_table``), or only where its
    checkpoints are when nothing was evaluated; then each evaluator the config sets up that did not run
    for want of data (``tasks.evals_config`` leaves those out: a LLaVA config without held-out data)."""
    from vitmm.data import formats
    from vitmm.train import tasks

    lines = [summary_table(summary) if summary["evals"] else checkpoints_line(summary)]
    run = tasks.evals_config(config)
    keys = [k for k in formats.RAW_KEYS if k != "mixture"]
    for name in config.get("evals") or {}:
        if name not in run:
            lines.append(f"evals.{name}: no data.{keys[0]} (nor {', '.join(keys[1:])}), not run; set "
                         f"--config.evals.{name}.data.{keys[0]} (held-out examples) to evaluate")
    return "\n".join(lines)


def main(argv):
    del argv
    console.quiet(flags.FLAGS.verbose)
    debug = flags.FLAGS.debug or _debug()
    errors_log = pathlib.Path(flags.FLAGS.workdir).expanduser() / console.ERRORS_LOG
    if flags.FLAGS.dry_run:
        from vitmm.train import dry_run

        try:
            print(dry_run.report(dry_run.plan(flags.FLAGS.config, target=flags.FLAGS.dry_run_target,
                                              num_devices=flags.FLAGS.dry_run_devices)))
        except USER_ERRORS as err:
            if debug:
                raise
            _fail(str(err), 2)
        return
    try:
        with console.library_errors_to(errors_log):
            summary = trainer.train(flags.FLAGS.config, flags.FLAGS.workdir, restart=flags.FLAGS.restart)
    except trainer.Preempted as stop:
        _fail(str(stop), PREEMPTED)
    except KeyboardInterrupt:  # a second Ctrl-C while the first one's checkpoint was on its way
        if debug:
            raise
        _fail("Ctrl-C twice: stopped at once, the checkpoint of this step perhaps unfinished; rerun the same "
              "command to resume from the last one saved.", INTERRUPTED)
    except USER_ERRORS as err:
        if debug:
            raise
        _fail(str(err), 2)
    except RUN_FAILURES as err:
        if debug:
            raise
        _fail(str(err), 1)
    except OSError as err:  # e.g. a full disk met by the metrics log; a checkpoint is never half-written
        if debug:
            raise
        console.log_error(errors_log, "the run stopped", err)
        logged = f"; the full error is in {errors_log}" if errors_log.is_file() else ""
        _fail(f"{console.cause(err)}{logged}. Free space or fix the path, then rerun the same command (a run "
              "resumes from its last checkpoint).", 1)
    print(final_report(summary, flags.FLAGS.config))


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    app.run(main, flags_parser=parse_flags)
