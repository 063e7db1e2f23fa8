"""Configs parse and build; the front-end demo and the token-count experiment run."""

import os
import pathlib
import subprocess
import sys

import pytest

from vitmm import config_args, demo, tree
from vitmm.models import vit, vit_tools

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py") if p.stem not in ("__init__", "common"))


def load_config(path: pathlib.Path, arg=None, **overrides):
    return config_args.load(path, arg, **overrides)


def test_parse_arg_types_bare_flags_and_errors():
    cfg = config_args.parse_arg("variant=L/14,image_size=336,smoke", variant="B/16", image_size=224,
                                smoke=False)
    assert (cfg.variant, cfg.image_size, cfg.smoke) == ("L/14", 336, True)
    assert config_args.parse_arg("S/16", variant="B/16", smoke=False).variant == "S/16"
    assert config_args.parse_arg(None, variant="B/16").variant == "B/16"
    with pytest.raises(ValueError, match="Unknown config arg 'varient'.*known args"):
        config_args.parse_arg("varient=S/16", variant="B/16")
    with pytest.raises(ValueError, match=r"not an integer \(image_size=224 by default\)"):
        config_args.parse_arg("image_size=big", image_size=224)
    with pytest.raises(ValueError, match="not a boolean"):
        config_args.parse_arg("smoke=maybe", smoke=False)
    with pytest.raises(AttributeError):  # locked against typos
        cfg.imagesize = 3


def test_presets_set_defaults_that_explicit_args_override():
    spec = dict(presets={"smoke": {"steps": 4}}, steps=400, smoke=False)
    assert config_args.parse_arg("smoke", **spec).steps == 4
    assert config_args.parse_arg("steps=-5,smoke", **spec).steps == -5  # given beats the preset, in any order
    assert config_args.parse_arg("smoke,steps=7", **spec).steps == 7
    assert config_args.parse_arg("smoke=false", **spec).steps == 400


@pytest.mark.parametrize("path", [p for p in CONFIGS if "steps=" in p.read_text() and "smoke" in p.read_text()],
                         ids=lambda p: p.stem)
def test_smoke_keeps_explicitly_given_steps(path):
    # smoke once set total_steps=4 over an explicit steps=..., so smoke,steps=-5 trained 4 steps
    assert load_config(path, "smoke,steps=3").total_steps == 3


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
@pytest.mark.parametrize("arg", [None, "smoke"])
def test_every_config_builds_its_model(path, arg):
    import jax
    import jax.numpy as jnp

    from vitmm.models import two_towers

    config = load_config(path, arg)
    assert path.read_text().lstrip().startswith('"""') and "python -m" in path.read_text()
    if "lm" in config.model:  # a VLM config
        from vitmm.models import vlm

        m = config.model
        model = vlm.VLM(m.vision.to_dict(), m.connector.to_dict(), m.lm.to_dict(), m.vision_layer, m.use_cls)
        size = config.input.image_size
        shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)),
                                jnp.zeros((1, m.max_len), jnp.int32))
        assert {"tower", "project", "language"} <= set(shapes["params"])
    elif "image" in config.model:  # a two-tower (contrastive) config
        model = two_towers.TwoTowers(**config.model.to_dict())
        size = config.input.image_size
        shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)),
                                jnp.zeros((1, config.model.text.max_len), jnp.int32))
        assert tree.count(shapes["params"]) > 0
    else:
        model = vit.ViT(**config.model.to_dict())
        assert vit_tools.count_params(model, (config.image_size, config.image_size)) > 0
    with pytest.raises(AttributeError):
        config.not_a_key = 1


def test_demo_runs_and_reports_the_front_end():
    lines = []
    result = demo.run(load_config(ROOT / "configs/frontend_demo.py", "smoke"), print_fn=lines.append)
    text = "\n".join(lines)
    assert result["token_shape"] == (1, 197, 192)
    assert result["params"] == 5_524_416  # ViT-Ti/16, timm layout
    assert result["variants"]["Ti"] == 5_524_416
    assert "(1, 197, 192)" in text and "sincos2d row" in text
    row = next(r for r in result["rows"] if r["resolution"] == 384 and r["patch"] == 16)
    assert (row["patches"], row["tokens"]) == (576, 577)
    bad = next(r for r in result["rows"] if r["resolution"] == 384 and r["patch"] == 14)
    assert bad["tokens"] is None


def test_synthetic_image_is_deterministic():
    a, b = demo.synthetic_image(64), demo.synthetic_image(64)
    assert a.dtype.name == "uint8" and a.shape == (64, 64, 3)
    assert (a == b).all() and len({tuple(p) for p in a.reshape(-1, 3)}) > 10


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "vitmm.demo", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_demo_command_line_with_overrides_and_typo():
    ok = _run_cli("--config", "configs/frontend_demo.py:smoke", "--config.model.num_registers=2",
                  "--config.image_size=160")
    assert ok.returncode == 0, ok.stderr
    assert "token shape           (1, 101, 192)" in ok.stdout  # 10x10 patches + CLS; registers dropped
    bad = _run_cli("--config", "configs/frontend_demo.py:smoke", "--config.model.num_registrs=2")
    assert bad.returncode == 2 and "num_registrs" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    bad = _run_cli("--config", "configs/frontend_demo.py:variant=Q/99,smoke")  # given: not replaced by smoke's Ti/16
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1
    assert lines[0].startswith("python -m vitmm.demo: Unknown ViT variant 'Q/99'")


@pytest.mark.parametrize("args, cwd, message", [
    # the default config is read when the flag is defined: an override's error escaped as a traceback, exit 1
    (["--config.model.num_registrs=2"], ROOT, "unknown config key 'model.num_registrs'; did you mean "
                                              "model.num_registers?"),
    (["--config.variant=B/16"], ROOT, "unknown config key 'variant'; did you mean model.variant or variants?"),
    (["--config", "configs/frontend_demo.py", "--config.modell.x=1"], ROOT,
     "unknown config key 'modell.x'; the keys are in configs/frontend_demo.py."),
    (["--config", "configs/nope.py"], ROOT, "--config configs/nope.py: no such file; the demo's is "
                                            "configs/frontend_demo.py."),
    # started elsewhere: the default config is the repository's, not ./configs/frontend_demo.py
    (["--config.modell.x=1"], "/", f"unknown config key 'modell.x'; the keys are in {ROOT}/configs/frontend_demo.py."),
])
def test_demo_refuses_a_bad_override_or_file_in_one_line(args, cwd, message):
    result = subprocess.run([sys.executable, "-m", "vitmm.demo", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"python -m vitmm.demo: {message}"]


def test_every_readme_model_example_builds():
    """vitmm/models/README.md shows a constructor per ViT option; each must build as written."""
    import re

    import jax
    import jax.numpy as jnp

    examples = re.findall(r"`(ViT\([^`]*\))`", (ROOT / "vitmm/models/README.md").read_text())
    assert len(examples) >= 20
    on_gpu = jax.default_backend() == "gpu"
    for example in examples:
        if "cudnn" in example and not on_gpu:
            continue  # cuDNN attention exists only on NVIDIA GPUs
        model = eval(example, {"ViT": vit.ViT})  # noqa: S307 - our own README
        shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
        assert shapes["params"], example


def test_load_applies_dotted_overrides_and_rejects_unknown_keys():
    config = config_args.load(ROOT / "configs/frontend_demo.py", "smoke", **{"model.num_registers": 3})
    assert config.model.num_registers == 3 and config.model.variant == "Ti/16"
    with pytest.raises(KeyError, match="model.num_registrs"):
        config_args.load(ROOT / "configs/frontend_demo.py", None, **{"model.num_registrs": 3})


def test_one_image_size_override_reaches_training_and_evaluation(tmp_path, monkeypatch):
    """Preprocessing strings are templates filled from the config when the run starts, so an
    override of ``input.image_size`` changes the training pp and every evaluator together, and
    one ``input.data_dir`` reaches every evaluator."""
    from vitmm.data import preprocess
    from vitmm.data import tokenizer as tok_lib
    from vitmm.train import eval_embeddings, pp_template, tasks
    from vitmm.train.parallel import Parallel

    data_dir = str(tmp_path / "tfds")
    c = load_config(ROOT / "configs/clip_scenes.py", "smoke", **{"input.image_size": 48, "input.data_dir": data_dir})
    pp = pp_template.pp_string(c)
    assert pp.startswith("decode|resize(48)|") and "tokenize('caption', 64," in pp
    seen = []
    real_parse = preprocess.parse
    monkeypatch.setattr(eval_embeddings.preprocess, "parse", lambda pp, *a: seen.append(pp) or real_parse(pp, *a))
    sources = []
    real_source = eval_embeddings.pipeline.get_source
    def get_source(name, split, data_dir, **kw):
        sources.append(data_dir)
        return real_source(name, split, data_dir, **kw)

    monkeypatch.setattr(eval_embeddings.pipeline, "get_source", get_source)
    tasks.from_config(c, Parallel("jit"), tok_lib.get_tokenizer(None)).evaluators()
    assert seen and all("resize(48)" in pp for pp in seen)
    assert sources and set(sources) == {data_dir}
    with pytest.raises(ValueError, match=r"names the field 'size'.*\{image_size\}, \{max_len\}"):
        pp_template.pp_string(load_config(ROOT / "configs/clip_scenes.py", "smoke", **{"input.pp": "resize({size})"}))


def test_config_args_given_explicitly_survive_smoke():
    """``smoke`` shrinks what the user left alone: ``smoke,data=medium_64,batch=64`` trains on
    medium scenes, 64 pairs a step (it used to be the smoke build and 16, silently)."""
    c = config_args.load(ROOT / "configs/clip_scenes.py", "smoke,batch=64,data=medium_64")
    assert (c.batch_size, c.input.data.name, c.evals.zeroshot.data.name) == (64, "scenes/medium_64", "scenes/medium_64")
    c = config_args.load(ROOT / "configs/clip_scenes.py", "smoke")
    assert (c.batch_size, c.total_steps) == (16, 4) and c.input.data.name.startswith("scenes/easy_32")
    assert config_args.load(ROOT / "configs/vlm_scenes.py", "smoke,data=hard_64").input.data.name == "scenes/hard_64"


def test_a_config_arg_of_the_wrong_type_names_the_type_in_words():
    """It said ``steps='abc' is not a int.``"""
    with pytest.raises(ValueError, match=r"^Config arg steps='abc' is not an integer \(steps=400 by default\)\.$"):
        config_args.parse_arg("steps=abc", steps=400)
    with pytest.raises(ValueError, match=r"^Config arg lr='x' is not a number \(lr=0.001 by default\)\.$"):
        config_args.parse_arg("lr=x", lr=1e-3)
