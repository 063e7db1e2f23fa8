"""Configs parse and build; the front-end demo and the token-count experiment run."""

import csv
import json
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
    with pytest.raises(ValueError, match="not a int"):
        config_args.parse_arg("image_size=big", image_size=224)
    with pytest.raises(ValueError, match="not a boolean"):
        config_args.parse_arg("smoke=maybe", smoke=False)
    with pytest.raises(AttributeError):  # locked against typos
        cfg.imagesize = 3


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
    assert bad.returncode != 0
    assert "num_registrs" in bad.stderr


def test_token_count_experiment_writes_tables(tmp_path, load_script):
    module = load_script("experiments/token_counts.py")
    out = module.main(["--out", str(tmp_path)])
    csv_text = (out / "token_counts.csv").read_text().splitlines()
    assert csv_text[0].startswith("variant,resolution,patch")
    assert len(csv_text) == 1 + len(module.VARIANTS) * len(module.RESOLUTIONS) * len(module.PATCHES)
    assert "| B/16 | 224 | 197 | 38,809 | 35.1 |" in (out / "token_counts.md").read_text()


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


def test_benchmark_script_runs_and_writes_its_tables(tmp_path):
    """The vitmm side of experiments/benchmark.py on a tiny ViT and a tiny CLIP pair (the PyTorch side
    needs torch)."""
    import subprocess
    import sys

    out = tmp_path / "bench"
    args = ["--variants", "mu/16", "--batch", "2", "--res", "64", "--warmup", "0", "--repeats", "1", "--no_torch",
            "--pair", "mu/16", "--pair_text_width", "64", "--pair_text_depth", "1", "--pair_text_len", "16",
            "--pair_vocab", "100", "--pair_embed_dim", "32"]
    proc = subprocess.run([sys.executable, str(ROOT / "experiments/benchmark.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "benchmark.csv")))
    assert [(r["task"], r["variant"], r["mode"]) for r in rows] == [
        ("vit", "mu/16", "train"), ("vit", "mu/16", "infer"), ("pair", "mu/16", "train"), ("pair", "mu/16", "infer")]
    for r in rows:
        assert float(r["images_s"]) > 0 and float(r["matmul_gflops"]) > 0 and float(r["compile_s"]) > 0
        # XLA's own count agrees with the analytic formula, which leaves out norms, softmax, the
        # 1000-class head and the optimizer (up to ~15% of these tiny models, ~1% of ViT-S/16).
        assert abs(float(r["xla_vs_analytic"]) - 1) < 0.2, r
        assert "glibc.malloc.hugetlb=1" in r["glibc_tunables"] and float(r["minor_faults_per_step"]) >= 0
    # The pair's analytic count is the image tower's plus the text tower's (1 layer, 16 tokens, width 64).
    assert float(rows[2]["analytic_gflop_per_image"]) == pytest.approx(
        float(rows[0]["analytic_gflop_per_image"]) + (24 * 16 * 64**2 + 4 * 16**2 * 64) / 1e9, rel=1e-9)
    markdown = (out / "benchmark.md").read_text()
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in markdown
    assert "| ViT-mu/16 | train | vitmm |" in markdown and "| CLIP mu/16 + text (pairs) | infer | vitmm |" in markdown


def test_benchmark_scaling_table_sets_measured_next_to_predicted_ratios(tmp_path, monkeypatch, load_script):
    """The scaling mode's bookkeeping, with the timed worker replaced by a clock that is exactly
    proportional to the analytic FLOPs: every measured ratio must then equal its prediction."""
    bench = load_script("experiments/benchmark.py")
    fake = lambda python, kind, spec, threads, tunables: {"step_s": bench.analytic_gflop(spec["variant"], spec["res"])}  # noqa: E731
    monkeypatch.setattr(bench, "_run_worker", fake)
    out = bench.main(["--scaling", "Ti", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(out / "scaling.csv")))
    assert [(r["variant"], int(r["res"]), int(r["tokens"])) for r in rows[::2]] == [
        ("Ti/32", 224, 49), ("Ti/16", 224, 196), ("Ti/8", 224, 784), ("Ti/16", 448, 784)]
    for r in rows:
        assert float(r["measured_ratio"]) == pytest.approx(float(r["predicted_ratio"]), rel=1e-9)
    by = {(r["variant"], r["res"], r["mode"]): float(r["predicted_ratio"]) for r in rows}
    assert by[("Ti/16", "224", "infer")] == 1.0
    # Same tokens: the same encoder FLOPs; only the patch projection (4x the pixels at 448) differs.
    assert by[("Ti/8", "224", "infer")] == pytest.approx(by[("Ti/16", "448", "infer")], rel=0.03)
    assert by[("Ti/8", "224", "infer")] > 4  # 4x tokens: linear terms 4x, attention 16x
    assert "| Ti/8 | 224 | 784 |" in (out / "scaling.md").read_text()


def test_benchmark_rounds_take_turns_and_report_the_median_paired_ratio(tmp_path, monkeypatch, load_script):
    """``--rounds 3``: each round runs vitmm then the reference; a row's time is the median over
    rounds and its ratio the median of the rounds' paired ratios, with their range."""
    bench = load_script("experiments/benchmark.py")
    calls = []
    times = {"jax": [1.0, 2.0, 1.0], "torch": [1.5, 2.0, 3.0]}  # paired ratios 1.5, 1.0, 3.0 per mode

    def fake(python, kind, spec, threads, tunables):
        calls.append(kind)
        assert tunables == bench.HUGE_PAGES  # the same allocator setting for both frameworks
        n = sum(c == kind for c in calls) - 1
        return {"framework": kind, "task": spec["task"], "variant": spec["variant"], "mode": spec["mode"],
                "step_s": times[kind][n % 3], "matmul_gflops": 100.0, "peak_rss_mb": 10.0 + n}

    monkeypatch.setattr(bench, "_run_worker", fake)
    out = bench.main(["--variants", "Ti/16", "--pair", "", "--rounds", "3", "--out", str(tmp_path)])
    assert calls == ["jax", "torch"] * 6  # turns, for train then infer
    rows = list(csv.DictReader(open(out / "benchmark.csv")))
    ref = rows[1]
    assert float(rows[0]["step_s"]) == 1.0 and float(ref["step_s"]) == 2.0
    assert float(ref["ratio"]) == 1.5 and float(ref["ratio_min"]) == 1.0 and float(ref["ratio_max"]) == 3.0
    assert float(ref["peak_rss_mb"]) == 12.0
    assert "1.50× (1.00–3.00)" in (out / "benchmark.md").read_text()


@pytest.fixture
def bench_gpu(load_script):
    return load_script("experiments/bench_gpu.py")


def test_bench_gpu_tiny_runs_every_case_and_profiles_it(tmp_path, bench_gpu):
    """experiments/bench_gpu.py end to end at --tiny size on the CPU: every case times, its
    profile attributes the step's ops, and the tables are written."""
    out = tmp_path / "bench_gpu.json"
    results = bench_gpu.main(["--tiny", "--profile", "--steps", "2", "--repeats", "1", "--out", str(out)])
    assert set(results) == {"agreement", *(c[0] for c in bench_gpu.CASES)}
    # bf16 against float32 on the same tokens: close, not equal (cuDNN is absent on a CPU)
    assert 1e-4 < results["agreement"]["xla_bf16"]["rel"] < 0.02
    assert 1e-4 < results["agreement"]["xla_bf16_residual_bf16"]["rel"] < 0.03
    assert "error" in results["agreement"]["cudnn_bf16"] or results["agreement"]["cudnn_bf16"]["rel"] < 0.02
    for name, r in results.items():
        if name == "agreement":
            continue
        assert "error" not in r, (name, r)
        assert r["step_s"] > 0 and r["flops"] > 0 and r["batch"] == 2
        assert r["profile"]["unknown_ops"] == 0 and r["profile"]["by_kind"]["matmul"] > 0
    assert json.loads(out.read_text()).keys() == results.keys()
    profile = (tmp_path / "profile.md").read_text()
    assert profile.count("## ") == len(results) - 1 and "| forward | encoder/block_*/mlp/fc1 |" in profile


def test_bench_gpu_sweep_runs_each_setting_in_its_own_process(tmp_path, monkeypatch, bench_gpu):
    """The sweep hands each setting's XLA flags and arguments to a fresh process: a flag XLA does
    not know fails that setting alone, and speed-ups are against the baseline runs."""
    bench = bench_gpu
    monkeypatch.setattr(bench, "SWEEP", [("baseline", "", []), ("bogus flag", "--xla_no_such_flag_anywhere=1", []),
                                         ("tanh GELU", "", ["--act", "gelu_tanh", "--dtype_residual", "bfloat16"])])
    out = tmp_path / "sweep.json"
    rows = bench.main(["--tiny", "--sweep", "--steps", "1", "--repeats", "1", "--out", str(out)])["sweep"]
    assert [r["setting"] for r in rows] == ["baseline", "bogus flag", "tanh GELU"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[2]["step_ms"] > 0 and "speedup" in rows[2]
    assert "error" in rows[1] and "step_ms" not in rows[1]
    markdown = out.with_suffix(".md").read_text()
    assert "| tanh GELU | `` | `--act gelu_tanh --dtype_residual bfloat16` |" in markdown
    assert "| bogus flag |" in markdown


def test_one_image_size_override_reaches_training_and_evaluation(tmp_path, monkeypatch):
    """Preprocessing strings are templates filled from the config when the run starts, so an
    override of ``input.image_size`` changes the training pp and every evaluator together, and
    one ``input.data_dir`` reaches every evaluator."""
    from vitmm.data import preprocess
    from vitmm.data import tokenizer as tok_lib
    from vitmm.train import evaluators, tasks
    from vitmm.train.parallel import Parallel

    data_dir = str(tmp_path / "tfds")
    c = load_config(ROOT / "configs/clip_scenes.py", "smoke", **{"input.image_size": 48, "input.data_dir": data_dir})
    assert tasks.pp_string(c).startswith("decode|resize(48)|") and "tokenize('caption', 64," in tasks.pp_string(c)
    seen = []
    real_parse = preprocess.parse
    monkeypatch.setattr(evaluators.preprocess, "parse", lambda pp, *a: seen.append(pp) or real_parse(pp, *a))
    sources = []
    real_source = evaluators.pipeline.get_source
    def get_source(name, split, data_dir, **kw):
        sources.append(data_dir)
        return real_source(name, split, data_dir, **kw)

    monkeypatch.setattr(evaluators.pipeline, "get_source", get_source)
    tasks.from_config(c, Parallel("jit"), tok_lib.get_tokenizer(None)).evaluators()
    assert seen and all("resize(48)" in pp for pp in seen)
    assert sources and set(sources) == {data_dir}
    with pytest.raises(ValueError, match=r"names the field 'size'.*\{image_size\}, \{max_len\}"):
        tasks.pp_string(load_config(ROOT / "configs/clip_scenes.py", "smoke", **{"input.pp": "resize({size})"}))
