"""The jobs the token-budget sweep hands its worker processes: one cell (family, tokens, variant)
over its seeds at the family's chosen rate, one point of the tuning grid, and a cell's costs."""

from __future__ import annotations

from experiments.common.feature_vlm import (
    BLIND,
    EVAL_BATCH,
    FeatureTrainer,
    JobContext,
    run_seeds,
    snapshot_path,
    time_steps,
    train_and_eval,
)
from experiments.token_budget import tune
from vitmm.models import connectors, lm


def _run(c: dict, key: tuple, lr: float, warmup: int | None) -> FeatureTrainer:
    job = c["jobs"][key]
    view = c["views"][job["view"]]
    return FeatureTrainer(c["tower_cfg"], job["connector"], c["lm_cfg"], view["grid"], c["in_dim"], c["max_len"],
               c["plan"]["max_steps"], lr, blind=key[0] == BLIND, stage0=c.get("stage0"),
               stage1_steps=c.get("stage1_steps", 0), warmup=warmup, schedule=c["plan"].get("schedule", "constant"))


def _departs(c: dict, job_key: tuple) -> list:
    """What names a run's snapshot beside its key, seed and rate: the connector of a job that
    departs from the default plan (``--native_widths``), nothing for the default plan's jobs, whose
    snapshots keep the names they had."""
    signed = c["jobs"][tuple(job_key)].get("signed")
    return [signed] if signed else []


def job(key, arrays: dict, context: JobContext, progress) -> dict:
    """``{seed: result}`` on the test questions for one job (family, tokens, variant) at its
    family's chosen learning rate and warmup: compiled once, trained per seed; after each seed the
    same compiled step and scoring are timed (``time_steps``). With ``context["seed_log"] = (path,
    signature)`` each finished seed is appended there as it ends, and seeds found there
    (``context["seeds_done"]``) are not trained again: a sweep stopped mid-job loses one seed's run."""
    c = context
    lr, warmup = tune.rate(c["chosen"], key[0], key[1])
    run, view = _run(c, key, lr, warmup), c["jobs"][key]["view"]

    def snapshot_of(seed):
        return snapshot_path(c, key, seed, lr, warmup, *_departs(c, key))

    def one(seed):
        result = train_and_eval(run, seed, arrays["train"], arrays["val"], arrays["test"], c["plan"], view,
                                progress=progress, snapshot=snapshot_of(seed), keep_snapshot=True)
        return {**result, **time_steps(run, arrays["train"], arrays["test"], c["plan"]["batch_size"], view,
                                       eval_batch=c["plan"].get("eval_batch", EVAL_BATCH))}

    return run_seeds(key, c, progress, one, snapshot_of)


def tune_job(key, arrays: dict, context: JobContext, progress) -> dict:
    """``{seed: result}`` on the whole validation split for one (family, tokens, lr, warmup) of
    the tuning grid, at each tuning seed (``context["tune_seeds"]``), each finished seed appended to
    ``context["tune_log"]`` as it ends; those in ``tune_done`` (kept by a stopped sweep, or one
    that tuned on fewer seeds) are not trained again."""
    c, (family, tokens, lr, warmup) = context, key
    job_key = (family, tokens, "")
    run, view = _run(c, job_key, lr, warmup), c["jobs"][job_key]["view"]

    def snapshot_of(seed):
        return snapshot_path(c, "tuning", key, seed, *_departs(c, job_key))

    def one(seed):
        return train_and_eval(run, seed, arrays["train"], arrays["val"], arrays["val"], c["plan"], view,
                              progress=progress, snapshot=snapshot_of(seed), keep_snapshot=True)

    return run_seeds(key, c, progress, one, snapshot_of, tuning=True)


def costs(connector_cfg: dict | None, lm_cfg: dict, in_dim: int, grid, tokens: int, seq_text: int) -> dict:
    """Connector parameters and FLOPs (XLA's count) and LM forward FLOPs per example."""
    out = {"connector_params": 0, "connector_mflops": 0.0}
    if connector_cfg is not None:
        c = connectors.cost(connector_cfg, in_dim, lm_cfg["width"], grid)
        out = {"connector_params": c["params"], "connector_mflops": c["flops"] / 1e6}
    out["lm_mflops"] = lm.forward_flops(lm_cfg, 1 + tokens + seq_text) / 1e6
    return out


