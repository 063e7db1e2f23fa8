"""The trainer's step does not depend on how the batch is laid out: one device, a 2-device mesh,
pmap over 4 devices, with and without micro-batches. The VLM's answer loss is a mean over every
answer token of the batch, so rows with answers of unequal lengths (the smoke's) on different
devices or micro-batches weigh by their tokens, not by their share of the rows."""

import dataclasses
import pathlib

import jax
import numpy as np
import optax
import pytest

from vitmm.config_args import load
from vitmm.train import inputs, trainer
from vitmm.train.parallel import Parallel

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _gradients(setup, par):
    """The loss, answer tokens and gradients of ``setup``'s first batch under ``par``'s layout (one SGD
    step of rate 1: the update is the gradient, which Adam's first step would hide under its sign)."""
    sgd = optax.sgd(1.0)
    state = dict(setup.state, opt_state=sgd.init(setup.state["params"]))
    setup = dataclasses.replace(setup, par=par, tx=sgd, lr_schedule=lambda _: 1.0, state=state)
    placed = par.put_state(jax.tree.map(np.asarray, state))  # fresh buffers: the step donates them
    data = inputs.make(setup.config, setup.tokenizer, par, setup.task)
    batch = next(data)
    data.close()
    new, metrics = setup.compile(placed)(placed, batch)
    after = par.host_state(new)["params"]
    grads = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), state["params"], after)
    metrics = par.first(metrics)
    return float(metrics["loss"]), float(metrics["answer_tokens"]), grads


# ~6-12 s; in make test: the token-mean loss over micro-batches and devices on its own
# (test_optim_and_parallel's test_a_token_mean_loss_is_the_same_*) and pmap against jit (test_trainer)
@pytest.mark.slow
def test_a_vlm_step_is_the_same_on_1_2_or_4_devices_and_with_micro_batches(data_dir):
    config = load(ROOT / "configs/vlm_scenes.py", "smoke,stage=2", **{"input.data_dir": data_dir})
    setup = trainer.build(config)
    want_loss, want_tokens, want = _gradients(setup, Parallel("jit", devices=jax.devices()[:1]))
    accum = trainer.build(load(ROOT / "configs/vlm_scenes.py", "smoke,stage=2",
                               **{"input.data_dir": data_dir, "optim.accum_steps": 2}))
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
    for name, s, par in (("jit on 2 devices", setup, Parallel("jit", devices=jax.devices()[:2])),
                         ("pmap on 4 devices, 2 micro-batches", accum, Parallel("pmap"))):
        loss, tokens, grads = _gradients(s, par)
        assert tokens == want_tokens, name
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6, err_msg=name)
        for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5 * scale, err_msg=name)
