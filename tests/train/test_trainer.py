"""The contrastive trainer end to end on smoke configs (4 CPU devices, tiny towers, tiny data)."""

import json
import math
import pathlib
import shutil

import jax
import ml_collections
import numpy as np
import pytest

from vitmm import checkpoint as ckpt_lib
from vitmm import config_args
from vitmm.train import inputs, pp_template, trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def smoke_config(data_dir, name="clip_scenes", arg="smoke", evals=True, **overrides):
    """``configs/{name}.py:{arg}`` reading and evaluating on ``data_dir``."""
    c = config_args.load(ROOT / "configs" / f"{name}.py", arg, **{"input.data_dir": data_dir, **overrides})
    if not evals:
        with c.unlocked():
            c.evals = ml_collections.ConfigDict()
    return c


def check_smoke_run(workdir: pathlib.Path, summary: dict, name: str) -> None:
    assert summary["final_step"] == 4 and summary["checkpoints"] == [4]
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [entry["step"] for entry in lines if "loss" in entry]
    assert steps == [2, 4]
    for entry in lines:
        if "loss" in entry:
            assert {"loss", "lr", "grad_norm", "param_norm", "update_norm", "t", "b", "img_per_s"} <= set(entry)
            assert all(math.isfinite(v) for v in entry.values())
    assert {"zeroshot/accuracy", "retrieval/i2t_r1", "retrieval/t2i_r5", "val/loss"} <= set(summary["evals"])
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    if name == "siglip_scenes":
        assert lines[0]["b"] == pytest.approx(-10.0, abs=0.1) and lines[0]["t"] == pytest.approx(10.0, rel=0.05)
    else:
        assert lines[0]["t"] == pytest.approx(1 / 0.07, rel=0.05)


def test_clip_smoke_run_logs_evaluates_and_checkpoints(clip_smoke_run):
    check_smoke_run(clip_smoke_run.workdir, clip_smoke_run.summary, "clip_scenes")


def test_siglip_smoke_run_logs_evaluates_and_checkpoints(tmp_path, data_dir):
    summary = trainer.train(smoke_config(data_dir, "siglip_scenes", "smoke"), tmp_path)
    check_smoke_run(tmp_path, summary, "siglip_scenes")


def test_siglip_chunked_smoke_run_logs_evaluates_and_checkpoints(siglip_chunked_smoke_run):
    check_smoke_run(siglip_chunked_smoke_run.workdir, siglip_chunked_smoke_run.summary, "siglip_scenes")


@pytest.mark.parametrize("shared, name, arg", [
    ("clip_smoke_run", "clip_scenes", "smoke"),
    ("siglip_chunked_smoke_run", "siglip_scenes", "smoke,loss=sigmoid_chunked"),
], ids=["clip", "siglip_chunked"])
def test_pmap_and_jit_give_the_same_losses(tmp_path, request, shared, name, arg):
    """The session's run of the config (jit over the 4-device mesh, the default) against the
    same config under pmap; evaluation does not touch the training state."""
    assert jax.device_count() == 4
    jit_run = request.getfixturevalue(shared)
    assert jit_run.summary["history"] and smoke_config(jit_run.data_dir, name, arg).parallel == "jit"
    pmap = trainer.train(smoke_config(jit_run.data_dir, name, arg, evals=False, parallel="pmap"), tmp_path)
    losses = {k: [(h["step"], h["loss"]) for h in v["history"]] for k, v in (("jit", jit_run.summary), ("pmap", pmap))}
    assert [s for s, _ in losses["jit"]] == [s for s, _ in losses["pmap"]] == [2, 4]
    np.testing.assert_allclose([x for _, x in losses["jit"]], [x for _, x in losses["pmap"]], rtol=1e-4)
    assert jit_run.summary["param_checksum"] == pytest.approx(pmap["param_checksum"], rel=1e-5)


def test_resume_continues_exactly(tmp_path, clip_smoke_run, capsys):
    """Stopped at step 2 and resumed, a run ends where the session's uninterrupted run ended; an
    evaluation its log lacks at the step it resumes from (killed after saving, before evaluating) is run."""
    straight = clip_smoke_run.summary
    c = smoke_config(clip_smoke_run.data_dir, log_every=1, checkpoint_every=100, eval_every=2)
    first = trainer.train(c, tmp_path, stop_at=2)
    assert first["final_step"] == 2 and first["checkpoints"] == [2]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "zeroshot/accuracy" in r]
    assert [r["step"] for r in evaluated] == [2]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r not in evaluated))
    capsys.readouterr()
    second = trainer.train(c, tmp_path)
    assert "step 2: evaluated on resuming" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "zeroshot/accuracy" in r] == [2, 4]
    again = next(r for r in rows if "zeroshot/accuracy" in r)
    assert "val/loss" in again and again == evaluated[0]  # every number, the temperature's val/loss too
    assert [h["step"] for h in second["history"]] == [3, 4]
    assert [h["step"] for h in straight["history"]] == [2, 4]
    np.testing.assert_allclose([first["history"][1]["loss"], second["history"][1]["loss"]],
                               [h["loss"] for h in straight["history"]], rtol=1e-6)
    assert second["param_checksum"] == pytest.approx(straight["param_checksum"], rel=1e-6)


def test_img_per_s_leaves_out_the_compiling_first_step_of_a_run_and_of_a_resume(tmp_path, data_dir, monkeypatch):
    """On a fake clock where the process's first step takes 100 s (compiling) and every other 1 s,
    each logged rate is exactly batch_size img/s; a row whose interval held only that first step has none."""
    clock = {"now": 0.0, "calls": 0}
    compile_step = trainer.Setup.compile

    def timed(self, placed):
        step_fn = compile_step(self, placed)

        def step(state, batch):
            clock["calls"] += 1
            clock["now"] += 100.0 if clock["calls"] == 1 else 1.0
            return step_fn(state, batch)
        return step

    monkeypatch.setattr(trainer.Setup, "compile", timed)
    monkeypatch.setattr(trainer, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: clock["now"])}))
    c = smoke_config(data_dir, evals=False, log_every=1, checkpoint_every=100)
    first = trainer.train(c, tmp_path, stop_at=2)
    clock["calls"] = 0  # a resume compiles again
    second = trainer.train(c, tmp_path)
    for summary in (first, second):
        assert [h.get("img_per_s") for h in summary["history"]] == [None, c.batch_size]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    b = c.batch_size
    assert [(r["step"], r.get("img_per_s")) for r in rows] == [(1, None), (2, b), (3, None), (4, b)]


@pytest.mark.parametrize("name", ["clip_wds", "clip_scenes_native"])  # with and without an input.data beside
def test_packing_raw_files_is_refused_before_anything_is_built(name):
    """input.packing reads input.data or scenes: with input.wds it is one line naming both keys, not a
    bare KeyError from the input builder nor (beside an input.data) a run on the other dataset."""
    c = config_args.load(ROOT / "configs" / f"{name}.py", "smoke")
    with c.unlocked():
        c.input.wds = "shards/{00000..00003}.tar"
        c.input.packing = ml_collections.ConfigDict(dict(max_num_patches=16, seq_len=64, max_images=16, bins=8))
    with pytest.raises(ValueError, match=r"^input\.packing reads a TFDS dataset \(input\.data\) or scenes .* not the "
                                         r"raw files of input\.wds: .* without input\.packing\.$"):
        trainer.validate(c)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_dir, monkeypatch):
    make_input = inputs.make

    def poisoned(*args):
        it = make_input(*args)

        class Poison:
            count = 0

            def __next__(self):
                batch = next(it)
                Poison.count += 1
                if Poison.count == 3:
                    batch = dict(batch, image=batch["image"] * np.nan)
                return batch

            def get_state(self):
                return it.get_state()

            def set_state(self, s):
                it.set_state(s)

        return Poison()

    monkeypatch.setattr(inputs, "make", poisoned)
    c = smoke_config(data_dir, evals=False, checkpoint_every=1)
    with pytest.raises(FloatingPointError, match=r"Non-finite loss at step 3.*last good checkpoint \(step 2\)"):
        trainer.train(c, tmp_path)
    assert ckpt_lib.Checkpointer(tmp_path).all_steps() == [1, 2]


def test_checkpoint_that_does_not_fit_the_model_is_an_error(tmp_path, data_dir, clip_smoke_run):
    shutil.copytree(clip_smoke_run.workdir / "checkpoints", tmp_path / "checkpoints")
    wider = smoke_config(data_dir, evals=False, total_steps=8, **{"model.embed_dim": 64})
    with pytest.raises(ValueError, match=r"does not fit the model:\n.*shape mismatch: img_proj/kernel: "
                                         r"model \(128, 64\) vs checkpoint \(128, 128\)"):
        trainer.train(wider, tmp_path)


def test_initialise_from_another_run(tmp_path, data_dir, clip_smoke_run):
    a, a_dir = clip_smoke_run.summary, str(clip_smoke_run.workdir)
    loaded = ckpt_lib.load_params(a_dir)
    assert sum(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(loaded)) == \
        pytest.approx(a["param_checksum"], rel=1e-9)
    # With a zero learning rate the run keeps exactly what it loaded.
    one_step = {"total_steps": 1, "optim.warmup_steps": 0}
    b_config = smoke_config(data_dir, evals=False, **one_step, **{"optim.lr": 0.0, "init.checkpoint": a_dir})
    b = trainer.train(b_config, tmp_path / "b")
    assert b["param_checksum"] == pytest.approx(a["param_checksum"], rel=1e-9)
    # A different head: loading fails loudly unless told what not to load.
    other = smoke_config(data_dir, evals=False, **one_step, **{"model.embed_dim": 64, "init.checkpoint": a_dir})
    with pytest.raises(ValueError, match=r"shape mismatch: img_proj/kernel"):
        trainer.train(other, tmp_path / "c")
    with other.unlocked():
        other.init.dont_load = (r".*_proj/kernel",)
    assert trainer.train(other, tmp_path / "d")["final_step"] == 1


def test_merge_params_lists_every_problem():
    init = {"a": np.zeros(2), "b": {"c": np.zeros((2, 3))}, "d": np.zeros(1)}
    loaded = {"a": np.ones(2), "b": {"c": np.ones((3, 3))}, "e": np.ones(4)}
    with pytest.raises(ValueError) as err:
        ckpt_lib.merge_params(init, loaded)
    text = str(err.value)
    assert "missing in checkpoint: d" in text and "unused from checkpoint: e" in text
    assert "shape mismatch: b/c: model (2, 3) vs checkpoint (3, 3)" in text
    # a shape mismatch: the model's settings first; dont_load only for parts meant to start afresh
    assert text.splitlines()[-1].startswith("The model is not built as the checkpoint's was: set model.*")
    with pytest.raises(ValueError, match=r"\nAdd regexes of what not to load to config.init.dont_load.$"):
        ckpt_lib.merge_params(init, {**loaded, "b": {"c": np.ones((2, 3))}})
    merged = ckpt_lib.merge_params(init, loaded, dont_load=("b/c", "d", "e"))
    np.testing.assert_array_equal(merged["a"], 1)
    np.testing.assert_array_equal(merged["b"]["c"], 0)


def test_a_long_mismatch_list_is_summarised_and_a_foreign_checkpoint_named():
    """An entirely different model's checkpoint once printed hundreds of lines ending in a
    dont_load hint that cannot help: now the counts per module, the first lines and a file."""
    init = {"img": {f"w{i}": np.zeros(2) for i in range(15)}, "txt": {f"w{i}": np.zeros(2) for i in range(10)}}
    loaded = {"tower": {f"v{i}": np.ones(2) for i in range(30)}}
    with pytest.raises(ValueError) as err:
        ckpt_lib.merge_params(init, loaded, source="/runs/other")
    text = str(err.value)
    lines = text.splitlines()
    assert len(lines) < 20 and "25 missing in checkpoint (img 15, txt 10)" in text
    assert "30 unused from checkpoint (tower 30)" in text and "dont_load" not in text
    assert lines[-1].startswith("Nothing in it fits the model (its top level: tower; the model's: img, txt)")
    listed = pathlib.Path(lines[-2].rsplit(": ", 1)[1])
    assert len(listed.read_text().splitlines()) == 55
    listed.unlink()
    init["tower"] = {"v0": np.zeros(2)}  # one entry fits: leaving out the rest is the fix
    with pytest.raises(ValueError, match=r"config.init.dont_load"):
        ckpt_lib.merge_params(init, loaded)


def test_command_line_rejects_unknown_config_keys(tmp_path, data_dir):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "vitmm.train", "--config", "configs/clip_scenes.py:smoke",
         "--workdir", str(tmp_path), f"--config.input.data_dir={data_dir}", "--config.total_step=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "total_step" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_vocabulary_must_match_the_tokenizer(tmp_path, data_dir):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "[UNK]": 3}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]")).save(str(path))
    c = smoke_config(data_dir, evals=False, tokenizer=str(path))
    with pytest.raises(ValueError, match=r"vocab_size=259 but the tokenizer .* has 4 tokens"):
        trainer.train(c, tmp_path / "w")


def test_vlm_tower_initialises_from_a_clip_run(data_dir, clip_smoke_run):
    import jax.numpy as jnp

    from vitmm.models import vlm as vlm_lib

    clip_dir = clip_smoke_run.workdir
    vision = smoke_config(data_dir).model.image.to_dict()
    lm = dict(vocab_size=259, width=32, depth=1, num_heads=4)
    model = vlm_lib.VLM(vision, {"name": "pool", "budget": 4}, lm)
    images, ids = jnp.zeros((1, 32, 32, 3)), jnp.zeros((1, 4), jnp.int32)
    params = model.init(jax.random.key(0), images, ids)["params"]
    loaded = ckpt_lib.init_tower_from_clip(params, clip_dir)
    clip_img = ckpt_lib.load_params(clip_dir)["img"]
    jax.tree.map(np.testing.assert_array_equal, loaded["tower"], clip_img)
    jax.tree.map(np.testing.assert_array_equal, loaded["language"], params["language"])
    narrow = vlm_lib.VLM({**vision, "width": 64}, {"name": "pool", "budget": 4}, lm)
    narrow_params = narrow.init(jax.random.key(0), images, ids)["params"]
    with pytest.raises(ValueError, match=r"shape mismatch: embedding/kernel"):
        ckpt_lib.init_tower_from_clip(narrow_params, clip_dir)


def test_evaluation_embeds_every_new_parameter_tree(clip_smoke_run, monkeypatch):
    """The embedding cache is keyed on the params object it was given: a new tree gets new
    embeddings even when it has the id() of an earlier one (CPython reuses a freed tree's
    address), and ``clear()`` drops the cache."""
    from vitmm.data import tokenizer as tok_lib
    from vitmm.train import evaluators as eval_lib
    from vitmm.train import tasks
    from vitmm.train.parallel import Parallel

    monkeypatch.setattr(eval_lib, "id", lambda obj: 0, raising=False)  # every tree has one id
    c = smoke_config(clip_smoke_run.data_dir)
    task = tasks.from_config(c, Parallel("jit"), tok_lib.get_tokenizer(c.get("tokenizer")))
    evaluators = task.evaluators()
    embeddings = evaluators["retrieval"].embeddings
    assert evaluators["zeroshot"].embeddings is embeddings  # one pass over the split for all three
    fresh = jax.tree.map(np.asarray, task.init_params())
    trained = ckpt_lib.load_params(clip_smoke_run.workdir)
    first = embeddings.get(fresh)["zimg"].copy()
    second = embeddings.get(trained)["zimg"]
    assert np.abs(first - second).max() > 1e-3
    np.testing.assert_allclose(embeddings.get(fresh)["zimg"], first, rtol=1e-5, atol=1e-6)
    cached = embeddings.get(fresh)
    assert embeddings.get(fresh) is cached
    evaluators["val"].clear()
    assert embeddings.get(fresh) is not cached


def test_packed_native_resolution_run_trains_evaluates_and_resumes_exactly(tmp_path, data_dir):
    """configs/clip_scenes_native.py: scenes at random sizes, NaFlex, packed rows, masked loss;
    stopped at step 2 and resumed, it ends where the uninterrupted run ends."""
    c = smoke_config(data_dir, "clip_scenes_native", log_every=1, checkpoint_every=2)
    straight = trainer.train(c, tmp_path)
    assert straight["final_step"] == 4 and all(math.isfinite(h["loss"]) for h in straight["history"])
    assert {"zeroshot/accuracy", "retrieval/i2t_r1", "zeroshot_native/accuracy", "retrieval_native/i2t_r1",
            "val_native/loss"} <= set(straight["evals"])
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # as if killed after step 2's checkpoint
    second = trainer.train(smoke_config(data_dir, "clip_scenes_native", evals=False, log_every=1,
                                        checkpoint_every=2), tmp_path)
    assert [h["step"] for h in second["history"]] == [3, 4]
    np.testing.assert_allclose([h["loss"] for h in second["history"]],
                               [h["loss"] for h in straight["history"][2:]], rtol=1e-6)
    assert second["param_checksum"] == pytest.approx(straight["param_checksum"], rel=1e-6)
    with pytest.raises(ValueError, match="input.packing .* needs parallel='jit'"):
        trainer.train(smoke_config(data_dir, "clip_scenes_native", parallel="pmap"), tmp_path / "pmap")


def test_uint8_batches_normalised_on_the_device_train_as_the_host_normalised_ones(tmp_path, clip_smoke_run):
    """``input.device_normalize``: the host sends uint8 images, the step applies the pp's
    ``value_range``; the run ends where the session's host-normalised run ends (float32, 1e-6)."""
    from vitmm.train import tasks

    c = smoke_config(clip_smoke_run.data_dir, evals=False, **{"input.device_normalize": True})
    host_pp, (scale, offset) = pp_template.host_pp_and_device_affine(c)
    assert "value_range" not in host_pp and scale == pytest.approx([2 / 255] * 3) and offset.tolist() == [-1] * 3
    batch = next(inputs.make(c, tasks.tokenizer_for(c), trainer.Parallel("jit"), None))
    assert batch["image"].dtype == np.uint8
    summary = trainer.train(c, tmp_path)
    straight = clip_smoke_run.summary
    np.testing.assert_allclose([h["loss"] for h in summary["history"]], [h["loss"] for h in straight["history"]],
                               rtol=1e-6)
    assert summary["param_checksum"] == pytest.approx(straight["param_checksum"], rel=1e-6)
    blind = smoke_config(clip_smoke_run.data_dir, **{"input.device_normalize": True,
                                                     "input.pp": "decode|value_range(-1, 1)|blank|keep('image')"})
    with pytest.raises(ValueError, match="does not end its image work with value_range or normalize"):
        pp_template.host_pp_and_device_affine(blind)
    native = config_args.load(ROOT / "configs/llava_pretrain.py", "smoke,native=16,pack=256",
                              **{"input.device_normalize": True})  # images at their own sizes: packed patches
    with pytest.raises(ValueError, match=r"not the tower's packed patches \(input.sequences.tower_length\)"):
        pp_template.host_pp_and_device_affine(native)
