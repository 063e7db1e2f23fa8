"""The train loop: ``train(config, workdir) -> summary`` for any task in ``vitmm.train.tasks``
(contrastive CLIP/SigLIP pretraining, VLM connector/LM training).

Reads top to bottom: setup → data → model and optimizer → state (fresh, initialised from
another run, or resumed from this workdir) → loop (step, log, evaluate, checkpoint) → summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from vitmm import checkpoint as ckpt_lib
from vitmm import console
from vitmm.data import device_feed, skips
from vitmm.train import (
    determinism,
    distributed,
    imported_vlm,
    inputs,
    metrics_log,
    optim,
    pp_template,
    sources,
    startup,
    tasks,
)
from vitmm.train import step as step_lib
from vitmm.train import workdir as workdir_lib
from vitmm.train.parallel import Parallel, to_host
from vitmm.train.stopping import Preempted, StopRequests, non_finite
from vitmm.train.validation import validate

BASE_METRICS = ("loss", "grad_norm", "param_norm", "update_norm")


# ================================================================================================
#                                         Train step
# ================================================================================================
def make_train_step(task, tx, lr_schedule, config, par: Parallel):
    """One update on the batch: ``step(state, batch) -> (state, metrics)``.

    With ``accum_steps = k`` the batch is split into ``k`` micro-batches whose gradients are
    averaged before one update (for a contrastive task each micro-batch is its own contrastive
    problem: its negatives are the other pairs of the same micro-batch, across all devices; a VLM's
    are weighted by their answer tokens, as are the devices': ``task.loss_weight``).
    """
    accum = config.optim.get("accum_steps", 1)
    names = BASE_METRICS + task.aux_names
    _, affine = pp_template.host_pp_and_device_affine(config)  # uint8 images from the host: normalised here

    def step(state, batch):
        if affine is not None:  # the image (or a packed batch's images)
            key = "images" if "images" in batch else "image"
            batch = dict(batch, **{key: batch[key].astype(jnp.float32) * affine[0] + affine[1]})
        rng = par.device_rng(jax.random.fold_in(state["rng"], state["step"]))
        trainable = optim.trainable_mask(config.optim, state["params"])  # frozen parts get no gradient
        loss, aux, grads = step_lib.loss_and_grads(task.loss_fn, state["params"], batch, rng, accum, trainable,
                                                   weight=task.loss_weight)
        if task.loss_weight is None:
            loss, grads, aux = par.reduce((loss, grads, aux))
        else:  # a mean over every answer token of the batch, whichever device or micro-batch holds it
            (loss, grads, aux), total = par.reduce((loss, grads, aux), aux[task.loss_weight])
            aux = {**aux, task.loss_weight: total}
        params, opt_state, updates = step_lib.apply(tx, grads, state["opt_state"], state["params"])
        params = task.post_update(params)
        metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params),
                       update_norm=optax.tree.norm(updates), lr=lr_schedule(state["step"]), **aux)
        finite = jnp.stack([jnp.isfinite(metrics[k]) for k in names])
        first_bad = jnp.argmin(finite)  # index of the first non-finite metric, if any
        bad = jnp.where((state["bad"][0] < 0) & ~finite.all(), jnp.stack([state["step"], first_bad]),
                        state["bad"])
        new_state = dict(params=params, opt_state=opt_state, step=state["step"] + 1, rng=state["rng"],
                         bad=bad)
        return new_state, metrics

    return step


# ================================================================================================
#                                          The loop
# ================================================================================================
def train(config, workdir: str | pathlib.Path, stop_at: int | None = None, restart: bool = False) -> dict:
    """Trains ``config`` in ``workdir`` (resuming from its newest readable checkpoint).

    ``stop_at`` ends the run after that step with a checkpoint (the schedule still runs to
    ``config.total_steps``; calling ``train`` again resumes; a run already there trains nothing).
    SIGTERM or SIGINT does the same at the current step and raises ``Preempted``. A workdir that
    held a run no checkpoint can resume is refused (``HistoryWithoutCheckpoint``) unless ``restart``,
    which keeps its log aside and starts at step 0. A run refused before it wrote anything leaves no workdir behind.
    """
    determinism.set_flags(config)  # before JAX opens a backend
    distributed.maybe_initialize(config)
    workdir = pathlib.Path(workdir).expanduser()
    workdir_lib.check_is_workdir(workdir)
    resuming = bool(ckpt_lib.step_folders(workdir))  # an unreadable one must not mean a fresh start
    given, config = config, _resolved(config, workdir, resuming)
    created = workdir_lib.make(workdir)
    is_main = jax.process_index() == 0
    lock = workdir_lib.Lock(workdir)
    try:
        refusal, set_aside = None, False
        if is_main:
            try:
                lock.acquire()
                set_aside = startup.check_history(workdir, config, restart)
            except Exception as err:  # noqa: BLE001 - every process stops with it (refuse_together), then re-raised
                refusal = err
        startup.refuse_together(refusal, workdir)
        with (console.library_errors_to(workdir / console.ERRORS_LOG), StopRequests() as stop,
              contextlib.ExitStack() as cleanup):
            try:
                return _train(config, workdir, stop_at, is_main, stop, cleanup, restart, set_aside, resuming)
            except startup.FreshStart:  # --restart and no checkpoint read: step 0 from the folders as they are now
                pass  # (trained below, not in this handler: the closing checkpointer would take it for a failure)
            return _train(_resolved(given, workdir, False), workdir, stop_at, is_main, stop, cleanup)
    finally:
        lock.release()
        if created and is_main:
            workdir_lib.remove_if_empty(workdir, up_to=created)


def _resolved(config, workdir: pathlib.Path, resuming: bool):
    """``config`` as the run uses it: a resumed run reads its init folders' settings as it pinned
    them at its start (``sources``); an imported VLM's settings filled in (``imported_vlm``); checked."""
    config = imported_vlm.from_imported_vlm(sources.with_pinned(config, workdir) if resuming else config)
    validate(config)
    return config


@dataclasses.dataclass
class Setup:
    """What a run trains: the parallelism, tokenizer, task, the initial state (on the host) and
    ``compile()``, the train step as the loop runs it."""

    par: Parallel
    tokenizer: Any
    task: Any
    tx: Any
    lr_schedule: Any
    state: dict
    config: Any

    def compile(self, placed):
        """``step(state, batch) -> (state, metrics)``, jitted or pmapped, the state donated;
        ``placed``: a state as ``par.put_state`` lays it out."""
        train_step = make_train_step(self.task, self.tx, self.lr_schedule, self.config, self.par)

        def step_with_key(state, batch):  # the RNG is stored as raw key data (plain pytree leaf)
            keyed = dict(state, rng=jax.random.wrap_key_data(state["rng"]))
            new, metrics = train_step(keyed, batch)
            return dict(new, rng=jax.random.key_data(new["rng"])), metrics

        return self.par.compile(step_with_key, jax.tree.map(lambda x: x, self.par.host_state(placed)))


def build(config, load: bool = True) -> Setup:
    """The task, optimizer and fresh state of ``config`` (the ``init.*`` weights loaded unless not
    ``load``: a run that resumes reads its own checkpoint, not the folders it started from)."""
    par = Parallel(config.parallel, fsdp=config.get("fsdp", False), tensor_parallel=config.get("tensor_parallel", 1))
    tokenizer = tasks.tokenizer_for(config)
    task = tasks.from_config(config, par, tokenizer)
    params = task.init_params(load=load)
    optim_cfg = config.optim.copy_and_resolve_references()
    with optim_cfg.unlocked():
        optim_cfg.total_steps = config.total_steps
    tx, lr_schedule = optim.make_optimizer(optim_cfg, params)
    if load and config.init.get("checkpoint"):  # (a resumed run's shapes are all it needs: no reading)
        loaded = ckpt_lib.load_params(config.init.checkpoint)
        params = ckpt_lib.merge_params(params, loaded, config.init.get("dont_load") or (),
                                       source=config.init.checkpoint)
    state = dict(params=params, opt_state=jax.jit(tx.init)(params), step=jnp.zeros((), jnp.int32),
                 rng=jax.random.key_data(jax.random.key(config.seed)),
                 bad=jnp.full((2,), -1, jnp.int32))
    return Setup(par, tokenizer, task, tx, lr_schedule, state, config)


def _train(config, workdir: pathlib.Path, stop_at, is_main: bool, stop: StopRequests, cleanup,
           restart: bool = False, set_aside: bool = False, resuming: bool = False) -> dict:
    given = sources.without_pinned(config)  # what the run records: the config as it was given
    setup = build(config, load=not resuming)
    par, tokenizer, task, state = setup.par, setup.tokenizer, setup.task, setup.state
    data = inputs.make(config, tokenizer, par, task)
    cleanup.callback(device_feed.close, data)  # input worker processes stop however the run ends
    evaluators = task.evaluators()  # before anything is written: a bad evaluation setting costs no run
    if set_aside:  # --restart over an earlier run's log, once this run's settings have all been checked
        startup.set_aside_history(workdir)
    checkpointer = ckpt_lib.Checkpointer(workdir, keep=config.get("keep_checkpoints", 2))
    cleanup.callback(checkpointer.close)  # also when a resume is refused or starts afresh, before the loop's own close
    start = 0
    if resuming:
        abstract = par.abstract_for_restore(jax.eval_shape(lambda: state))
        changes = []
        pinned = [f"init/{key}" for key in config.init.get("pinned") or {}]  # not read again: may have moved

        def check(meta):  # before the state is read: what the config changes, refused where it matters
            saved = meta.get("config")
            changes[:] = workdir_lib.check_config_change(json.loads(saved) if isinstance(saved, str) else saved,
                                                         given, checkpointer.directory, pinned)

        found = checkpointer.restore_newest_readable(abstract, check, restart=restart)
        if found is None:  # --restart over checkpoints none of which read: set aside, and a fresh start
            kept = metrics_log.set_aside_for_restart(workdir) if is_main else None
            if is_main:
                print(f"Restarting from step 0 in {workdir} (--restart; no checkpoint read, set aside as "
                      "<step>.unreadable)" + (f"; the earlier log is {kept.name}." if kept else "."), flush=True)
            device_feed.close(data)
            raise startup.FreshStart  # built again from the init folders, whose settings it pins anew
        else:
            state, data_state, _, start = found
            data.set_state(device_feed.own_state(data_state))
            if is_main:
                print(f"Resumed from step {start} in {checkpointer.directory}", flush=True)
                if changes:
                    print("Config changes since that checkpoint:\n" + "\n".join(changes), flush=True)
                for line in sources.changed_since_pinned(config):
                    print(line, flush=True)
    if is_main:
        sources.pin(workdir, given, replace=not resuming)  # the settings of the folders step 0 was loaded from
        workdir_lib.write_config(workdir, given, task)  # a VLM's tower and LM as built from init.*
    state = par.put_state(state)
    step_fn = setup.compile(state)
    metric_names = BASE_METRICS + task.aux_names
    if is_main and (rebuilt := metrics_log.rebuild_metrics(workdir, start)):
        print(rebuilt, flush=True)
    # A resume drops the rows a killed run logged past its checkpoint; a fresh start keeps an earlier log aside.
    writer = metrics_log.MetricWriter(workdir, enabled=is_main, resumed_at=start)

    total = config.total_steps
    evals = {}
    if startup.evaluation_lost(workdir, start, total, config, evaluators, is_main):
        evals = _evaluate_state(evaluators, task, par, state)
        writer.write(start, evals)
        if is_main:
            print(f"step {start}: evaluated on resuming (the run stopped after saving it, before evaluating it)",
                  flush=True)
    elif start >= total and evaluators:  # a finished run: its final evaluation reported again, not logged twice
        evals = _evaluate_state(evaluators, task, par, state)
    sync_every = config.get("sync_every", 8) if par.needs_host_sync else None
    progress = tqdm(total=total, initial=start, desc="train", unit="step", disable=not is_main,
                    dynamic_ncols=True, file=sys.stdout, mininterval=1.0)
    history, last_log = [], (time.perf_counter(), start)
    skipped = _data_counts(data.get_state(), None, False)  # bad examples skipped so far (raw data)
    metrics = None
    try:
        last = total if stop_at is None else max(min(stop_at, total), start)  # at or past stop_at: nothing to train
        for step in range(start + 1, last + 1):
            batch = next(data)
            state, metrics = step_fn(state, batch)
            if step == start + 1:  # the process's first step compiled the step: img/s counts the steps after it
                jax.block_until_ready((state, metrics))
                last_log = (time.perf_counter(), step)
            stopping = stop.requested() and step < total  # at the last step the run simply ends
            at_log = step % config.log_every == 0 or step == total
            at_ckpt = step % config.checkpoint_every == 0 or step in (total, stop_at) or stopping
            at_eval = bool(evaluators) and (step % config.eval_every == 0 or step == total) and not stopping
            if at_log or at_ckpt or at_eval or (sync_every and step % sync_every == 0):
                _check_finite(par.host_state(state["bad"]), checkpointer, metric_names, config.checkpoint_every)
            if at_log:
                now = time.perf_counter()
                host = {k: float(v) for k, v in par.first(metrics).items()}
                if step > last_log[1]:  # no rate for an interval that held only the compiling step
                    host["img_per_s"] = (step - last_log[1]) * config.batch_size / max(now - last_log[0], 1e-9)
                skipped = _data_counts(data.get_state(), skipped, is_main)
                host.update(skips.metrics_of_all_processes(data.get_state()))  # every host's share counted
                if jax.process_count() > 1:  # (one process's own iterator checks at once)
                    skips.check_all_processes(host, config.input.get("max_skipped_share", 0.01), jax.process_count())
                last_log = (now, step)
                history.append({"step": step, **host})
                writer.write(step, host)
                shown = {k: f"{host[k]:.3g}" for k in ("loss",) + task.aux_names[:1]}
                if "img_per_s" in host:
                    shown["img_s"] = f"{host['img_per_s']:.0f}"
                progress.set_postfix(**shown, refresh=False)
            if at_ckpt:  # before evaluating: a failing evaluator never costs the checkpoint
                _save(checkpointer, step, par.host_state(state), device_feed.gather_states(data.get_state()), given)
            checkpointer.check_saves(step)
            if at_eval:
                evals = _evaluate_state(evaluators, task, par, state)
                writer.write(step, evals)
                if is_main:
                    tqdm.write(f"step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in evals.items()
                                                            if not k.endswith("examples")))
                last_log = (time.perf_counter(), step)  # keep evaluation out of img/s
            progress.update(1)
            if stopping:
                checkpointer.wait()
                checkpointer.check_saves(step + 1)
                raise Preempted(step, workdir, stop.name)
        checkpointer.wait()
        checkpointer.check_saves(total + 1)
    finally:
        progress.close()
        checkpointer.close()
        writer.close()
    params = _host_params(par.host_state(state)["params"])
    checksum = float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(params)))
    return dict(history=history, evals=evals, final_step=int(to_host(par.host_state(state)["step"])),
                workdir=str(workdir), checkpoints=checkpointer.all_steps(), param_checksum=checksum)


def _data_counts(data_state, shown: int | None, is_main: bool) -> int | None:
    """The skipped examples so far (raw data); prints the counts and first ids when they grew."""
    counts = skips.total_counts(data_state)
    if not counts:
        return None
    total = sum(counts["skipped"].values())
    if is_main and shown is not None and total > shown:
        tqdm.write(f"data: {skips.report(counts)}")
    return total


def _save(checkpointer, step: int, state, data_state, config) -> None:
    """Starts the (background) save of ``step``; a failure to start it is a ``SaveFailed``."""
    try:
        checkpointer.save(step, state, data_state, {"step": step, "config": config.to_json_best_effort()})
    except ckpt_lib.SaveFailed:
        raise
    except Exception as err:  # noqa: BLE001 - e.g. no space left (this save, or the previous one in the background)
        raise checkpointer.save_failed(err) from err


def _host_params(params):
    """Parameters as this process's numpy arrays (gathered when sharded across processes)."""
    return jax.tree.map(to_host, params)


def _check_finite(bad, checkpointer, names, checkpoint_every: int) -> None:
    bad = to_host(bad)
    if bad[0] >= 0:
        raise non_finite(names[int(bad[1])], int(bad[0]) + 1, checkpointer, checkpoint_every)


def _evaluate_state(evaluators, task, par, state) -> dict:
    """The evaluation of ``state``'s parameters, with what they imply (a CLIP's temperature and bias
    after the step's update): the same numbers in the loop, on resuming and for a finished run."""
    params = _host_params(par.host_state(state)["params"])
    return _evaluate(evaluators, task.eval_params(params), task.final_aux(params))


def _evaluate(evaluators, params, aux) -> dict:
    aux = {k: float(v) for k, v in aux.items()}
    out = {}
    try:
        for name, evaluator in evaluators.items():
            for key, value in evaluator.run(params, **aux).items():
                out[f"{name}/{key}"] = float(value)
    finally:
        for evaluator in evaluators.values():
            evaluator.clear()  # the host copy of the parameters is not kept until the next round
    return out

