"""VLM training through the same loop: stages freeze what they should, the tower comes from a
CLIP run of `vitmm.train`, and the QA evaluator reports accuracy per question kind."""

import pathlib

import jax
import numpy as np
import pytest

from configs import common
from vitmm import checkpoint as ckpt_lib
from vitmm import config_args
from vitmm.data import preprocess
from vitmm.train import trainer


def _config(name, arg, data_dir, **overrides):
    path = pathlib.Path(__file__).resolve().parents[2] / "configs" / f"{name}.py"
    return config_args.load(path, arg, **{"input.data_dir": data_dir, **overrides})


def test_stages_train_what_they_should_from_a_clip_tower(tmp_path, data_dir, clip_smoke_run):
    clip_dir = str(clip_smoke_run.workdir)
    clip_img = ckpt_lib.load_params(clip_dir)["img"]

    stage1 = _config("vlm_scenes", "smoke,connector=pool,budget=4", data_dir,
                     **{"init.vision": clip_dir, "init.allow_random_tower": False})
    summary = trainer.train(stage1, tmp_path / "s1")
    assert {"qa/accuracy", "qa/acc_exists", "qa/examples"} <= set(summary["evals"])
    assert all(np.isfinite(h["loss"]) and 0 <= h["token_acc"] <= 1 for h in summary["history"])
    params = ckpt_lib.load_params(tmp_path / "s1")
    jax.tree.map(np.testing.assert_array_equal, params["tower"], clip_img)  # frozen, from CLIP

    # Stage 2 starts from stage 1; the LM now trains, the tower still does not.
    stage2 = _config("vlm_scenes", "smoke,connector=pool,budget=4,stage=2", data_dir,
                     **{"init.vision": clip_dir, "init.checkpoint": str(tmp_path / "s1"),
                        "init.allow_random_tower": False})
    trainer.train(stage2, tmp_path / "s2")
    after = ckpt_lib.load_params(tmp_path / "s2")
    jax.tree.map(np.testing.assert_array_equal, after["tower"], clip_img)
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), after["language"], params["language"])
    assert any(jax.tree.leaves(moved))


def test_stage1_keeps_the_language_model_fixed(tmp_path, data_dir):
    c = _config("vlm_scenes", "smoke,connector=mlp", data_dir, total_steps=2)
    with c.unlocked():
        c.evals = type(c.evals)()
    stopped = trainer.train(c, tmp_path / "a", stop_at=1)
    first = ckpt_lib.load_params(tmp_path / "a")
    trainer.train(c, tmp_path / "a")
    second = ckpt_lib.load_params(tmp_path / "a")
    assert stopped["final_step"] == 1
    jax.tree.map(np.testing.assert_array_equal, second["language"], first["language"])
    changed = jax.tree.map(lambda x, y: bool(np.any(x != y)), second["project"], first["project"])
    assert all(jax.tree.leaves(changed))


def test_a_vlm_needs_a_pretrained_tower(tmp_path, data_dir):
    c = _config("vlm_scenes", "smoke", data_dir, **{"init.allow_random_tower": False})
    with pytest.raises(ValueError, match="init.vision=WORKDIR"):
        trainer.train(c, tmp_path)


def test_qa_evaluator_reports_the_right_values_on_known_answers(clip_smoke_run, monkeypatch):
    """The ``qa`` evaluator's bookkeeping on answers whose correctness is known: a stand-in for
    greedy decoding answers every counting question right and every other one wrong, so
    ``acc_count`` is 1, every other kind 0, and ``accuracy`` the share of counting questions."""
    from vitmm.data import scenes
    from vitmm.data import tokenizer as tok_lib
    from vitmm.train import evaluators as eval_lib

    tok = tok_lib.ByteTokenizer()
    count = scenes.QUESTION_KINDS.index("count")
    seen = []
    real_batches = eval_lib.pipeline.eval_batches

    def recording(*args, **kwargs):
        for batch in real_batches(*args, **kwargs):
            seen.append(batch)
            yield batch

    def oracle(variables, images, prompts, prompt_len, max_new_tokens, eos_id, prefix_lm, image_pos):
        out = np.full((len(prompts), max_new_tokens), eos_id, np.int32)
        for i, (answer, kind) in enumerate(zip(seen[-1]["answer"], seen[-1]["question_kind"], strict=True)):
            ids = tok.encode(str(answer) if kind == count else str(answer) + "!")
            out[i, : len(ids)] = ids
        return out

    monkeypatch.setattr(eval_lib.pipeline, "eval_batches", recording)
    cfg = {"data": {"name": common.SMOKE_DATA, "split": "validation", "data_dir": clip_smoke_run.data_dir},
           "num_examples": 48, "batch_size": 16, "max_new_tokens": 16,
           "pp": "decode|resize(32)|normalize()|choose|qa_tokens(64)"}
    evaluator = eval_lib.QAAccuracy(None, cfg, tok, False)
    evaluator.decode = oracle
    result = evaluator.run({})
    kinds = np.concatenate([b["question_kind"][b["_mask"] > 0] for b in seen])
    assert result["examples"] == len(kinds) == 48
    assert 0 < (kinds == count).sum() < 48
    assert result["accuracy"] == pytest.approx(float(np.mean(kinds == count)))
    assert result["acc_count"] == 1.0
    for i, name in enumerate(scenes.QUESTION_KINDS):
        if name != "count" and (kinds == i).any():
            assert result[f"acc_{name}"] == 0.0


@pytest.mark.parametrize("chat", [False, True])
def test_a_vlm_from_a_converted_hf_tower_and_a_converted_gguf_lm(tmp_path, data_dir, capsys, chat):
    """Nothing restated: the tower comes from a `python -m vitmm.interop` folder of transformers'
    CLIP vision tower (quick_gelu, eps 1e-5, pre-norm; its 4x4 position table resampled to the
    run's 6x6 grid the way transformers does; images normalised with CLIP's statistics), the LM,
    its tokenizer and (``chat``) its chat template from a converted GGUF. Stage 1 trains the
    connector only."""
    from vitmm.interop import __main__ as cli
    from vitmm.interop import convert
    from vitmm.models.vit import resize_posemb
    from vitmm.train import tasks

    fixtures = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"
    cli.main(["--from", "hf", "--src", str(fixtures / "hf_clip_vision"), "--out", str(tmp_path / "tower"),
              "--tower", "vision"])
    cli.main(["--from", "gguf", "--src", str(fixtures / "gguf_llama" / "tiny.gguf"), "--out", str(tmp_path / "lm")])
    c = _config("vlm_scenes", f"smoke,connector=pool,budget=4,chat={chat}", data_dir,
                **{"init.vision": str(tmp_path / "tower"), "init.lm": str(tmp_path / "lm"),
                   "init.allow_random_tower": False, "input.image_size": 48})
    assert ckpt_lib.load_config(tmp_path / "tower")["input"]["image_mean"] == list(convert.OPENAI_CLIP[0])
    assert f"normalize({convert.OPENAI_CLIP[0]}, {convert.OPENAI_CLIP[1]})" in tasks.pp_string(c)
    if chat:  # the prompts are the LM's chat template with the image where <image> stood
        example = preprocess.parse(tasks.pp_string(c), tasks.tokenizer_for(c))(
            {"image": np.zeros((8, 8, 3), np.uint8), "questions": ["how many stars are there?"], "answers": ["2"],
             "question_kinds": [0]}, np.random.default_rng(0))
        assert int(example["image_pos"]) == len(tasks.tokenizer_for(c).encode("<|im_start|>user\n"))
    summary = trainer.train(c, tmp_path / "vlm")
    assert "model.vision is replaced by the tower saved in" in capsys.readouterr().out
    assert np.isfinite(summary["history"][-1]["loss"]) and "qa/accuracy" in summary["evals"]
    params = ckpt_lib.load_params(tmp_path / "vlm")
    tower, lm = ckpt_lib.load_params(tmp_path / "tower")["img"], ckpt_lib.load_params(tmp_path / "lm")["lm"]
    kwargs = ckpt_lib.load_config(tmp_path / "tower")["model"]["image"]
    resized = resize_posemb(tower, (6, 6), kwargs["posemb_resample"])
    jax.tree.map(np.testing.assert_array_equal, params["tower"], jax.tree.map(np.asarray, resized))
    jax.tree.map(np.testing.assert_array_equal, params["language"], lm)  # frozen in stage 1
    assert params["tower"]["pos_embedding"].shape == (1, 6, 6, 32)


def test_lora_trains_the_adapters_and_the_connector_only(tmp_path, data_dir):
    from vitmm.models import lora as lora_lib
    from vitmm.train import tasks
    from vitmm.train.parallel import Parallel

    c = _config("vlm_scenes", "smoke,connector=mlp,lora=2", data_dir)
    assert c.lora.rank == 2 and c.optim.freeze == (r"tower/.*", r"language/.*")
    trainer.train(c, tmp_path / "l")
    after = ckpt_lib.load_params(tmp_path / "l")
    task = tasks.from_config(c, Parallel("jit"), tasks.tokenizer_for(c))
    before = jax.tree.map(np.asarray, task.init_params())
    assert sorted(after["lora"]) == sorted(f"language.block_00.attn.{r}" for r in "qkvo")
    changed = lambda a, b: any(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.any(x != y)), a, b)))  # noqa: E731
    assert changed(after["lora"], before["lora"]) and changed(after["project"], before["project"])
    assert not changed(after["language"], before["language"]) and not changed(after["tower"], before["tower"])
    merged = task.eval_params(after)
    assert "lora" not in merged and changed(merged["language"], after["language"])
    expected = lora_lib.merge(after, after["lora"], c.lora.alpha)["language"]["block_00"]["attn"]["q"]["kernel"]
    np.testing.assert_array_equal(merged["language"]["block_00"]["attn"]["q"]["kernel"], expected)
