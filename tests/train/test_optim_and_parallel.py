"""Optimizer rules (schedule, weight-decay mask, freezing) and state sharding (FSDP)."""

import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from vitmm.train import optim
from vitmm.train import step as step_lib
from vitmm.train.parallel import MESH_AXIS, Parallel, to_host


def _cfg(**kw):
    base = dict(lr=1.0, total_steps=100, warmup_steps=10, end_factor=0.0, weight_decay=0.5, b1=0.9,
                b2=0.98, eps=1e-8, clip_norm=0.0, freeze=())
    base.update(kw)
    return ml_collections.ConfigDict(base)


PARAMS = {
    "img": {"embedding": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "pos_embedding": jnp.ones(2),
            "cls": jnp.ones(2), "encoder": {"block_00": {"norm1": {"scale": jnp.ones(2), "bias": jnp.ones(2)}}}},
    "txt": {"token_embedding": {"embedding": jnp.ones((3, 2))}},
    "t": jnp.ones(1), "b": jnp.ones(1), "connector": {"ln_q": {"scale": jnp.ones(2)}},  # a norm named ln_*
}


def test_schedule_warms_up_then_decays_to_zero():
    lr = optim.schedule(_cfg())
    assert float(lr(0)) == 0.0 and float(lr(10)) == pytest.approx(1.0)
    assert float(lr(55)) == pytest.approx(0.5, abs=1e-6) and float(lr(100)) == pytest.approx(0.0, abs=1e-7)


def test_schedule_decays_to_end_factor_times_lr():
    """``end_factor`` is a fraction of ``lr``: lr 2, end_factor 0.1 ends at 0.2 (not 0.1), and the
    cosine's midpoint lies halfway between the peak and that floor (hand-computed)."""
    lr = optim.schedule(_cfg(lr=2.0, end_factor=0.1))
    assert float(lr(10)) == pytest.approx(2.0)
    assert float(lr(55)) == pytest.approx(0.2 + (2.0 - 0.2) * 0.5, abs=1e-6)
    assert float(lr(100)) == pytest.approx(0.2, abs=1e-6)


def test_weight_decay_skips_biases_norms_positions_tokens_temperature():
    decay = optim.path_names(jax.tree.map(lambda no: not no, optim.regex_mask(PARAMS, optim.NO_DECAY)))
    assert {k for k, v in decay.items() if v} == {"img/embedding/kernel", "txt/token_embedding/embedding"}
    # The connectors' learned queries/latents and position table and the VLM's image_newline are
    # exempt like the ViT's; layers that merely share those names keep their kernels decayed.
    kernel = {"kernel": jnp.ones((2, 2))}
    vlm = {"project": {"latents": jnp.ones((4, 2)), "queries": jnp.ones((4, 2)), "query": jnp.ones((4, 2)),
                       "pos_emb": jnp.ones((1, 4, 2)), "attn": {"query": kernel}, "resampler": {"latents": kernel}},
           "image_newline": jnp.ones(2), "language": {"layers": {"query": kernel}, "pos_emb": kernel}}
    decay = optim.path_names(jax.tree.map(lambda no: not no, optim.regex_mask(vlm, optim.NO_DECAY)))
    assert {k for k, v in decay.items() if v} == {"project/attn/query/kernel", "project/resampler/latents/kernel",
                                                  "language/layers/query/kernel", "language/pos_emb/kernel"}


def test_decay_is_applied_only_where_the_mask_says():
    tx, _ = optim.make_optimizer(_cfg(warmup_steps=0, lr=0.1), PARAMS)
    state = tx.init(PARAMS)
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)  # no gradient: only weight decay moves params
    updates, _ = tx.update(zeros, state, PARAMS)
    moved = optim.path_names(jax.tree.map(lambda u: bool(jnp.any(u != 0)), updates))
    assert {k for k, v in moved.items() if v} == {"img/embedding/kernel", "txt/token_embedding/embedding"}


def test_freezing_by_regex_keeps_parameters_fixed():
    tx, _ = optim.make_optimizer(_cfg(warmup_steps=0, freeze=(r"img/.*",)), PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    names = optim.path_names(updates)
    assert all(float(jnp.abs(v).max()) == 0 for k, v in names.items() if k.startswith("img/"))
    assert float(jnp.abs(names["txt/token_embedding/embedding"]).max()) > 0
    with pytest.raises(ValueError, match="matches no parameter"):
        optim.make_optimizer(_cfg(freeze=("vision/.*",)), PARAMS)


@pytest.mark.parametrize("accum", [1, 2])
def test_frozen_parameters_get_no_gradient_and_the_rest_get_the_full_one(accum):
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS)
    batch = {"x": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}

    def loss_fn(p, b, _):
        h = b["x"] @ p["img"]["embedding"]["kernel"] + p["img"]["cls"] + p["txt"]["token_embedding"]["embedding"][0]
        return jnp.mean(jnp.tanh(h) ** 2) * p["t"][0] + p["b"][0] ** 2, {}

    cfg = _cfg(warmup_steps=0, freeze=(r"img/.*",))
    trainable = optim.trainable_mask(cfg, params)
    loss, _, grads = step_lib.loss_and_grads(loss_fn, params, batch, jax.random.key(0), accum, trainable)
    full_loss, _, full = step_lib.loss_and_grads(loss_fn, params, batch, jax.random.key(0), accum)
    np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
    names, full_names = optim.path_names(grads), optim.path_names(full)
    assert set(names) == set(full_names)
    for k, g in names.items():
        if k.startswith("img/"):
            assert g is None, k  # never computed
        else:
            np.testing.assert_allclose(g, full_names[k], rtol=1e-6, err_msg=k)
    tx, _ = optim.make_optimizer(cfg, params)
    new, _, _ = step_lib.apply(tx, grads, tx.init(params), params)
    jax.tree.map(np.testing.assert_array_equal, new["img"], params["img"])
    assert float(jnp.abs(new["t"] - params["t"]).max()) > 0
    assert optim.trainable_mask(_cfg(), params) is None


def test_clipping_bounds_the_update_input():
    tx, _ = optim.make_optimizer(_cfg(clip_norm=1.0, weight_decay=0.0, warmup_steps=0), {"w": jnp.zeros(4)})
    clipped = optax.clip_by_global_norm(1.0).update({"w": jnp.full(4, 100.0)}, None)[0]
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0, rel=1e-5)
    assert tx.update({"w": jnp.full(4, 100.0)}, tx.init({"w": jnp.zeros(4)}), {"w": jnp.zeros(4)})


def test_fsdp_shards_large_parameters_on_their_largest_divisible_axis():
    par = Parallel("jit", fsdp=True, fsdp_min_size=64)
    n = par.mesh.shape[MESH_AXIS]
    state = {"big": jnp.zeros((6, 8 * n)), "odd": jnp.zeros((7, 9, 3)), "small": jnp.zeros(4)}
    # FSDP saves nothing on a leaf no axis of which divides the data axis: said once, not left silent
    with pytest.warns(UserWarning, match=rf"^fsdp=True: 1 leaves of the state \(0\.0 MiB\) stay whole on every "
                                         rf"device, .* the {n} devices of the data axis: odd \(7, 9, 3\)\. Train on"):
        shardings = par.state_sharding(jax.eval_shape(lambda: state))
    assert shardings["big"].spec == jax.sharding.PartitionSpec(None, MESH_AXIS)
    assert shardings["odd"].spec == jax.sharding.PartitionSpec()  # nothing divides: replicated
    assert shardings["small"].spec == jax.sharding.PartitionSpec()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once a run: not again for every placement or compile)
        placed = par.put_state(state)
    assert placed["big"].sharding.spec == jax.sharding.PartitionSpec(None, MESH_AXIS)
    x = jnp.arange(6 * 8 * n, dtype=jnp.float32).reshape(6, 8 * n)
    sharded = jax.device_put(x, shardings["big"])
    np.testing.assert_allclose(jax.jit(lambda a: (a @ a.T).sum())(sharded), (x @ x.T).sum(), rtol=1e-6)


def test_unknown_parallel_kind():
    with pytest.raises(ValueError, match="Unknown parallel='dp'"):
        Parallel("dp")


def test_fsdp_under_pmap_is_refused_not_silently_replicated():
    """pmap keeps a whole copy of the state on every device: fsdp=True there sharded nothing (a
    config asking for it, e.g. clip_b16_coco.py with --config.parallel=pmap, ran out of memory
    instead of being told)."""
    with pytest.raises(ValueError, match=r"^fsdp=True .* parallel='pmap' .*--config\.parallel=jit, or "
                                         r"--config\.fsdp=False\.$"):
        Parallel("pmap", fsdp=True)
    assert Parallel("pmap").kind == "pmap" and Parallel("jit", fsdp=True).fsdp


@pytest.mark.parametrize("kind", ["pmap", "jit"])
def test_the_step_is_traced_once_from_the_first_step_on(kind):
    """The state put on the devices has the layout the step's own outputs have, so the second
    step reuses the first step's program (pmap used to trace and compile it twice)."""
    par = Parallel(kind)
    traces = []

    def step(state, batch):
        traces.append(1)
        total = par.reduce(batch["x"].sum())  # pmap: the mean over devices of their shard's sum
        return dict(state, w=state["w"] + total, step=state["step"] + 1), {"total": total}

    state = {"w": jnp.zeros(3), "step": jnp.zeros((), jnp.int32)}
    placed = par.put_state(state)
    step_fn = par.compile(step, state)
    for _ in range(3):
        placed, _ = step_fn(placed, par.put_batch({"x": np.ones((8, 2), np.float32)}))
    assert len(traces) == 1
    host = par.host_state(placed)
    per_step = 16.0 / par.num_devices if kind == "pmap" else 16.0
    np.testing.assert_allclose(to_host(host["w"]), np.full(3, 3 * per_step))
    assert int(to_host(host["step"])) == 3


def test_pmap_host_state_is_replica_zero_read_from_its_own_device():
    """What a checkpoint stores under pmap: replica 0's copy, on the first local device, taken
    without running a program over all devices per leaf (hundreds of those queued behind a
    step deadlocked XLA:CPU)."""
    par = Parallel("pmap")
    n = jax.local_device_count()
    per_replica = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)  # replica r holds 6r..6r+5
    state = {"w": jax.device_put(per_replica, par.local_sharding), "step": par.put_state({"s": jnp.int32(7)})["s"]}
    jax.block_until_ready(state)
    host = par.host_state(state)
    np.testing.assert_array_equal(to_host(host["w"]), per_replica[0])
    assert host["w"].shape == (2, 3) and host["step"].shape == () and int(to_host(host["step"])) == 7
    assert host["w"].sharding.device_set == {jax.local_devices()[0]}


def test_a_token_mean_loss_is_the_same_whatever_the_micro_batches_and_devices():
    """A VLM's answer loss is a mean over the batch's answer tokens: rows with long and short
    answers split into micro-batches (accum_steps) or over devices (pmap) give the full batch's
    loss, gradients and token-weighted aux, not a mean of per-part means (which differs here)."""
    from vitmm.train.parallel import AXIS

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 6, 3)), jnp.float32)
    lengths = np.array([6, 1, 5, 1, 6, 2, 1, 4])  # answer tokens per row: parts hold unequal counts
    batch = {"x": x, "mask": jnp.asarray(np.arange(6)[None] < lengths[:, None], jnp.float32)}
    w = jnp.asarray(rng.normal(size=(3,)), jnp.float32)

    def loss_fn(w, b, _):
        per_token = jnp.tanh(b["x"] @ w) ** 2
        tokens = b["mask"].sum()
        return (per_token * b["mask"]).sum() / jnp.maximum(tokens, 1), {"acc": (per_token * b["mask"]).max(),
                                                                         "tokens": tokens}

    (ref_loss, _), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(w, batch, None)
    for accum in (1, 2, 4):
        loss, aux, grads = step_lib.loss_and_grads(loss_fn, w, batch, jax.random.key(0), accum, weight="tokens")
        np.testing.assert_allclose([loss, *grads], [ref_loss, *ref_grads], rtol=1e-6, err_msg=f"accum {accum}")
        assert float(aux["tokens"]) == lengths.sum()
    plain, _, _ = step_lib.loss_and_grads(loss_fn, w, batch, jax.random.key(0), 4)  # a mean of means
    assert abs(float(plain) - float(ref_loss)) > 1e-3

    par = Parallel("pmap")
    n = jax.device_count()

    def on_device(b):
        loss, aux, grads = step_lib.loss_and_grads(loss_fn, w, b, jax.random.key(0), 2 if n < 8 else 1,
                                                   weight="tokens")
        return par.reduce((loss, grads), aux["tokens"])

    split = jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), batch)
    (loss, grads), total = jax.pmap(on_device, axis_name=AXIS)(split)
    np.testing.assert_allclose([loss[0], *grads[0]], [ref_loss, *ref_grads], rtol=1e-6)
    assert float(total[0]) == lengths.sum()


def test_accumulation_splits_each_devices_rows():
    """Each device's rows are split into the micro-batches, under pmap and jit: 8 rows on 4 devices
    take 2 at most."""
    import pathlib

    from vitmm import config_args
    from vitmm.train import trainer

    path = pathlib.Path(__file__).resolve().parents[2] / "configs/clip_scenes.py"
    for parallel in ("pmap", "jit"):
        c = config_args.load(path, "smoke", **{"parallel": parallel, "batch_size": 8, "optim.accum_steps": 4})
        with pytest.raises(ValueError, match=r"accum_steps=4: .* batch_size=8 / the 4 devices of the data axis\."):
            trainer.validate(c)
    c.optim.accum_steps = 2
    trainer.validate(c)
    # Values checked before anything is built (the command line shows them as one line, exit 2).
    for key, value, message in (("evals.zeroshot.num_examples", -1, "config.evals.zeroshot.num_examples=-1: must be"),
                                ("optim.lr", -1.0, "config.optim.lr=-1.0: must be a number, at least 0."),
                                ("input.image_size", 0, "config.input.image_size=0: must be a positive integer."),
                                ("input.prefetch", -2, "config.input.prefetch=-2: must be an integer, at least 0.")):
        bad = config_args.load(path, "smoke", **{key: value})
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            trainer.validate(bad)


def test_warmup_must_end_before_the_last_step_and_end_factor_lie_in_0_1():
    """A warmup as long as the run (e.g. ``--config.total_steps`` shortened below the config's warmup)
    or negative, or an end_factor outside [0, 1], is refused in one line instead of clamped silently."""
    import pathlib

    from vitmm import config_args
    from vitmm.train import trainer

    path = pathlib.Path(__file__).resolve().parents[2] / "configs/clip_scenes.py"
    trainer.validate(config_args.load(path, "smoke", **{"total_steps": 2, "optim.warmup_steps": 1}))
    trainer.validate(config_args.load(path, "smoke,steps=1"))  # its smoke warms up for none of its one step
    for total, warmup in ((20, 20), (100, 500), (4, -5)):
        bad = config_args.load(path, "smoke", **{"total_steps": total, "optim.warmup_steps": warmup})
        with pytest.raises(ValueError, match=rf"^config\.optim\.warmup_steps={warmup} with total_steps={total}: must "
                                             rf"be an integer from 0 to {total - 1} .*--config\.optim\.warmup_steps="):
            trainer.validate(bad)
    for end in (1.5, -0.1):
        with pytest.raises(ValueError, match=rf"^config\.optim\.end_factor={end}: must be a number from 0 to 1"):
            trainer.validate(config_args.load(path, "smoke", **{"optim.end_factor": end}))
    trainer.validate(config_args.load(path, "smoke", **{"optim.end_factor": 1.0}))


def test_micro_batches_take_every_kth_row_and_stay_on_their_devices_under_jit():
    """Micro-batch i holds rows i, i + k, ...: on a batch sharded over 4 devices in contiguous
    blocks each device computes its own rows of each micro-batch, with no gather of the batch
    (contiguous micro-batches lay on one or two devices, and XLA gathered them: k times the compute)."""
    from jax.sharding import NamedSharding, PartitionSpec

    rows, k, width = 16, 2, 8
    batch = {"x": jnp.arange(rows * width, dtype=jnp.float32).reshape(rows, width)}
    loss_fn = lambda w, b, r: (jnp.mean((b["x"] @ w) ** 2), {"first": b["x"][:, 0]})  # noqa: E731
    w = jnp.ones((width, 3))
    _, aux, _ = step_lib.loss_and_grads(loss_fn, w, batch, jax.random.key(0), k)
    np.testing.assert_array_equal(aux["first"], batch["x"][k - 1::k, 0])  # the last micro-batch's rows
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    step = jax.jit(lambda w, b: step_lib.loss_and_grads(loss_fn, w, b, jax.random.key(0), k)[2])
    hlo = step.lower(w, sharded).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo, "the micro-batches left their devices"
    np.testing.assert_allclose(step(w, sharded), step_lib.loss_and_grads(loss_fn, w, batch, jax.random.key(0))[2],
                               rtol=1e-6)


def test_lr_mult_scales_the_matching_parameters_updates_beside_a_freeze():
    """LLaVA-1.5's LoRA recipe: the projector at a tenth of the adapters' rate, the LM frozen."""
    params = {"project": {"kernel": jnp.ones((2, 2))}, "lora": {"a": jnp.ones((2, 2))},
              "language": {"kernel": jnp.ones((2, 2))}}
    grads = jax.tree.map(lambda p: 0.5 * p, params)

    def updates(**more):
        cfg = optim.config(lr=1e-2, warmup_steps=0, total_steps=10, freeze=(r"language/.*",), **more)
        tx, _ = optim.make_optimizer(cfg, params)
        return tx.update(grads, tx.init(params), params)[0]

    plain, scaled = updates(), updates(lr_mult=((r"project/.*", 0.1),))
    np.testing.assert_allclose(scaled["project"]["kernel"], 0.1 * plain["project"]["kernel"], rtol=1e-6)
    np.testing.assert_array_equal(scaled["lora"]["a"], plain["lora"]["a"])
    assert not np.any(scaled["language"]["kernel"]) and np.any(plain["lora"]["a"])
    with pytest.raises(ValueError, match=r"optim.lr_mult pattern 'projection/.\*' matches no parameter"):
        updates(lr_mult=((r"projection/.*", 0.1),))
    with pytest.raises(ValueError, match=r"optim.lr_mult\['project/.\*'\]=-1: must be a number >= 0"):
        updates(lr_mult=((r"project/.*", -1),))


def test_an_evaluators_own_every_is_refused_not_ignored():
    from vitmm.train import evaluators

    with pytest.raises(ValueError, match=r"evals.retrieval.every=5: every evaluator runs each eval_every steps"):
        evaluators.from_config({"retrieval": {"every": 5, "data": {}}}, None, 8, None, "softmax", 32)
