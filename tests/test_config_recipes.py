"""The configs that say they follow a published recipe keep its numbers, and the optimizer they
build applies them (Adam's b2 and eps are recovered from two updates, not read back from the config)."""

import math
import pathlib

import jax.numpy as jnp
import pytest

from vitmm import config_args
from vitmm.train import optim

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(name, arg=None):
    return config_args.load(ROOT / "configs" / f"{name}.py", arg)


def _adam_b2_eps(optim_cfg) -> tuple[float, float]:
    """Adam's (b2, eps) as the built optimizer applies them: one update with gradient g (Adam's
    first step is lr·g/(|g| + eps)), then one with gradient 0 (lr·b1/(1+b1) / (sqrt(b2/(1+b2)) + eps/g)),
    on a parameter without decay, the rate held constant."""
    cfg = optim_cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.total_steps, cfg.warmup_steps, cfg.freeze, cfg.lr_mult = 10**9, 0, (), ()
    params = {"scale": jnp.ones(1)}  # a norm scale: no weight decay
    tx, schedule = optim.make_optimizer(cfg, params)
    g, lr, b1 = 1e-6, float(schedule(0)), cfg.b1
    state = tx.init(params)
    u0, state = tx.update({"scale": jnp.full(1, g)}, state, params)
    u1, _ = tx.update({"scale": jnp.zeros(1)}, state, params)
    eps = g * (lr / -float(u0["scale"][0]) - 1)
    s = b1 / (1 + b1) / (-float(u1["scale"][0]) / lr) - eps / g  # sqrt(b2 / (1 + b2))
    return s * s / (1 - s * s), eps


def _pp_padding(config) -> str:
    return config.input.pp.split("padding=")[1].split(")")[0].strip("'\"")


def test_siglip_b16_trains_with_siglips_optimizer_and_heads():
    c = _config("siglip_b16")
    b2, eps = _adam_b2_eps(c.optim)
    assert b2 == pytest.approx(0.95, abs=2e-3) and eps == pytest.approx(1e-8, rel=1e-2)  # was CLIP's 0.98, 1e-6
    assert c.optim.lr == 1e-3 and c.optim.weight_decay * c.optim.lr == pytest.approx(1e-4)  # big_vision's wd
    assert c.optim.clip_norm == 1.0
    assert (c.model.temperature_init, c.model.bias_init, c.max_temperature) == (10.0, -10.0, None)
    assert (c.model.text.causal, c.model.text.pool, _pp_padding(c)) == (False, "last", "eos")
    assert (c.model.image.pool, c.model.image.class_token, c.model.image.act) == ("map", False, "gelu_tanh")


def test_clip_b16_coco_trains_with_clips_optimizer_and_heads():
    c = _config("clip_b16_coco")
    b2, eps = _adam_b2_eps(c.optim)
    assert b2 == pytest.approx(0.98, abs=2e-3) and eps == pytest.approx(1e-6, rel=1e-2)
    assert (c.optim.lr, c.optim.weight_decay, c.optim.clip_norm) == (5e-4, 0.2, 1.0)
    assert math.log(c.model.temperature_init) == pytest.approx(math.log(1 / 0.07)) and c.max_temperature == 100.0
    assert (c.model.text.causal, c.model.text.pool, _pp_padding(c)) == (True, "eot", "pad")
    assert (c.model.text.max_len, c.model.text.width, c.model.text.num_heads, c.model.embed_dim) == (77, 512, 8, 512)


@pytest.mark.parametrize("scale", ["demo", "b16"])
def test_clip_wds_sigmoid_is_siglips_text_tower(scale):
    c = _config("clip_wds", f"loss=sigmoid,scale={scale}")
    assert (c.model.text.causal, c.model.text.pool, _pp_padding(c)) == (False, "last", "eos")  # was causal
    assert (c.model.temperature_init, c.model.bias_init, c.max_temperature) == (10.0, -10.0, None)
    clip = _config("clip_wds", f"scale={scale}")
    assert (clip.model.text.causal, clip.model.text.pool, _pp_padding(clip)) == (True, "eot", "pad")


def test_llava_stages_follow_llava_15():
    s1 = _config("llava_pretrain", "steps=1000")
    b2, eps = _adam_b2_eps(s1.optim)  # transformers' Trainer AdamW defaults
    assert b2 == pytest.approx(0.999, abs=2e-4) and eps == pytest.approx(1e-8, rel=1e-2)
    assert (s1.optim.lr, s1.optim.weight_decay, s1.optim.warmup_steps, s1.optim.clip_norm) == (1e-3, 0.0, 30, 1.0)
    assert set(s1.optim.freeze) == {r"tower/.*", r"language/.*"}
    assert (s1.model.vision_layer, s1.model.use_cls, s1.model.connector.name) == (-2, False, "mlp")
    assert s1.input.pp.split("|")[1].startswith("pad_to_square({image_mean})")
    s2 = _config("llava_finetune", "steps=1000")
    assert (s2.optim.lr, s2.optim.weight_decay, s2.optim.b2, s2.optim.eps) == (2e-5, 0.0, 0.999, 1e-8)
    assert tuple(s2.optim.freeze) == (r"tower/.*",) and s2.optim.lr_mult == ()
    lora = _config("llava_finetune", "lora=128,steps=1000")
    assert lora.optim.lr == 2e-4 and dict(lora.optim.lr_mult)["project/.*"] * lora.optim.lr == pytest.approx(2e-5)
    assert lora.lora.rank == 128 and lora.lora.alpha is None and lora.lora.dropout == 0.05  # alpha: 2 x rank = 256
