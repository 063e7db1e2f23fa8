"""What a task builds from a config and its tokenizer, before any training."""

import pathlib
import types

import pytest

from vitmm.config_args import load
from vitmm.train import tasks
from vitmm.train.parallel import Parallel

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _clip(data_dir, **overrides):
    return load(ROOT / "configs/clip_scenes.py", "smoke", **{"input.data_dir": data_dir, **overrides})


def test_eot_pooling_without_eos_id_is_refused_when_eos_is_not_the_largest_id(data_dir):
    """eos_id=None pools at argmax(ids): with EOS=2 of 259 ids it would pool at the largest word."""
    config = _clip(data_dir)
    assert config.model.text.pool == "eot" and config.model.text.get("eos_id") is None
    small_eos = types.SimpleNamespace(vocab_size=259, eos_id=2)
    with pytest.raises(ValueError, match=r"EOS 2 of 259 ids; set --config.model.text.eos_id=2"):
        tasks.ContrastiveTask(config, Parallel("jit"), small_eos)
    told = _clip(data_dir, **{"model.text.eos_id": 2})  # the config's slot for it, as on the command line
    assert tasks.ContrastiveTask(told, Parallel("jit"), small_eos).model.text["eos_id"] == 2


def test_byte_tokenizer_eot_runs_build_the_model_they_always_did(data_dir):
    """EOS is the byte tokenizer's largest id: the text tower stays as configured (eos_id unset)."""
    config = _clip(data_dir)
    task = tasks.ContrastiveTask(config, Parallel("jit"), tasks.tokenizer_for(config))
    assert task.model.text == config.model.text.to_dict() and task.model.text.get("eos_id") is None
