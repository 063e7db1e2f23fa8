"""VLM training through the same loop: stages freeze what they should, the tower comes from a
CLIP run of `vitmm.train`, and the QA evaluator reports accuracy per question kind."""

import pathlib
import shutil

import jax
import numpy as np
import pytest

from configs import common
from vitmm import checkpoint as ckpt_lib
from vitmm import config_args
from vitmm.data import preprocess
from vitmm.train import inputs, pp_template, trainer, vlm_start


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


def test_a_frozen_tower_and_lm_cost_the_step_no_gradient_of_their_own(data_dir):
    """Stage 1 differentiates the connector only: the trainer's step costs (compiled FLOPs) about
    what the connector's own gradient does, not the 2.7× it cost while the frozen parameters'
    gradients were computed for the logged gradient norm and then dropped."""
    import jax.numpy as jnp

    from vitmm.train import optim, tasks
    from vitmm.train.parallel import Parallel

    # The config's 4-block tower (the smoke's has 1): the frozen parts' share of the step is what is measured.
    c = _config("vlm_scenes", "smoke,connector=mlp", data_dir, total_steps=10, **{"model.vision.depth": 4})
    assert tuple(c.optim.freeze) == (r"tower/.*", r"language/.*")
    task = tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))
    params = task.init_params()
    b, r = c.batch_size, c.input.image_size
    batch = dict(image=jnp.zeros((b, r, r, 3)), ids=jnp.zeros((b, c.model.max_len), jnp.int32),
                 prompt_len=jnp.ones((b,), jnp.int32), answer_mask=jnp.ones((b, c.model.max_len), jnp.int32))

    def flops(fn, *args):
        return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]

    def step_flops(freeze):
        with c.unlocked():
            c.optim.freeze = freeze
        cfg = c.optim.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.total_steps = c.total_steps
        tx, lr = optim.make_optimizer(cfg, params)
        state = dict(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                     rng=jax.random.key(0), bad=jnp.full((2,), -1, jnp.int32))
        return flops(trainer.make_train_step(task, tx, lr, c, Parallel(c.parallel)), state, batch)

    connector_grad = flops(jax.grad(lambda proj: task.loss_fn({**params, "project": proj}, batch, None)[0]),
                           params["project"])
    frozen, everything = step_flops((r"tower/.*", r"language/.*")), step_flops(())
    assert frozen <= 1.15 * connector_grad, (frozen, connector_grad)
    assert everything >= 2 * connector_grad, (everything, connector_grad)


def test_the_loss_on_answer_positions_only_equals_the_full_loss_for_less(data_dir):
    """``model.loss_positions``: the same loss, token accuracy and gradients (≤ 1e-6) as the head
    on every position, with fewer FLOPs; a pp that cannot check answer lengths is refused. The
    logits made a chunk of tokens at a time (``model.loss_chunk``, a chunk not dividing the
    batch's tokens): the same numbers too."""
    import jax.numpy as jnp

    from vitmm.train import tasks
    from vitmm.train.parallel import Parallel

    def task_for(k, chunk=None):
        c = _config("vlm_scenes", "smoke,connector=mlp,stage=2", data_dir,
                    **{"model.loss_positions": k, "model.loss_chunk": chunk})
        return c, tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))

    c, full = task_for(None)
    _, some = task_for(3)
    params = full.init_params()
    pp = preprocess.parse(pp_template.pp_string(c))
    rng = np.random.default_rng(0)
    exs = [pp({"image": np.zeros((8, 8, 3), np.uint8), "questions": np.array(["how many?", "is there a star?"]),
               "answers": np.array([a, a]), "question_kinds": np.array([0, 1])}, rng)
           for a in ("2", "no", "3")]
    batch = {k: jnp.asarray(np.stack([e[k] for e in exs]))
             for k in ("image", "ids", "answer_mask", "prompt_len", "image_pos")}
    batch["image"] = jnp.asarray(rng.normal(size=batch["image"].shape), jnp.float32)

    def grads(task):  # one program each: eager, every operation of the backward pass is dispatched alone
        return jax.jit(jax.value_and_grad(task.loss_fn, has_aux=True))(params, batch, None)

    (loss, aux), g = grads(full)
    (loss_k, aux_k), g_k = grads(some)
    np.testing.assert_allclose(loss_k, loss, rtol=1e-6)
    np.testing.assert_allclose(aux_k["token_acc"], aux["token_acc"], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_k, g)
    (loss_c, aux_c), g_c = grads(task_for(None, 7)[1])  # the text positions picked from the states, then chunked
    np.testing.assert_allclose([loss_c, aux_c["token_acc"]], [loss, aux["token_acc"]], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_c, g)
    cost = [jax.jit(t.loss_fn).lower(params, batch, None).compile().cost_analysis()["flops"] for t in (full, some)]
    assert cost[1] < cost[0]
    c = _config("vlm_scenes", "smoke,connector=mlp", data_dir, **{"model.loss_positions": 3})
    with c.unlocked():
        c.input.pp = c.input.pp.replace("max_answer={loss_positions}", "")
    with pytest.raises(ValueError, match="add max_answer=\\{loss_positions\\}"):
        tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))


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
    from vitmm.train import vlm_evaluators

    tok = tok_lib.ByteTokenizer()
    count = scenes.QUESTION_KINDS.index("count")
    seen = []
    real_batches = vlm_evaluators.pipeline.eval_batches

    def recording(*args, **kwargs):
        for batch in real_batches(*args, **kwargs):
            seen.append(batch)
            yield batch

    def oracle(variables, images, prompts, prompt_len, max_new_tokens, eos_id, prefix_lm, image_pos, visual_mask,
               layout):
        out = np.full((len(prompts), max_new_tokens), eos_id, np.int32)
        for i, (answer, kind) in enumerate(zip(seen[-1]["answer"], seen[-1]["question_kind"], strict=True)):
            ids = tok.encode(str(answer) if kind == count else str(answer) + "!")
            out[i, : len(ids)] = ids
        return out

    monkeypatch.setattr(vlm_evaluators.pipeline, "eval_batches", recording)
    cfg = {"data": {"name": common.SMOKE_DATA, "split": "validation", "data_dir": clip_smoke_run.data_dir},
           "num_examples": 48, "batch_size": 16, "max_new_tokens": 16,
           "pp": "decode|resize(32)|normalize()|choose|qa_tokens(64)"}
    evaluator = vlm_evaluators.QAAccuracy(None, cfg, tok, False)
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


# chat=False (plain prompts) is slow: the converted tower and GGUF LM are the same with chat=True, and plain prompts are
# every other VLM test's
@pytest.mark.parametrize("chat", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_vlm_from_a_converted_hf_tower_and_a_converted_gguf_lm(tmp_path, data_dir, capsys, chat):
    """Nothing restated: the tower comes from a `python -m vitmm.interop` folder of transformers'
    CLIP vision tower (quick_gelu, eps 1e-5, pre-norm; its 4x4 position table resampled to the
    run's 6x6 grid the way transformers does; images normalised with CLIP's statistics), the LM,
    its tokenizer and (``chat``) its chat template from a converted GGUF. Stage 1 trains the
    connector only."""
    from vitmm.interop import __main__ as cli
    from vitmm.interop import convert
    from vitmm.models.vit_tools import resize_posemb
    from vitmm.train import tasks

    fixtures = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"
    cli.main(["--from", "hf", "--src", str(fixtures / "hf_clip_vision"), "--out", str(tmp_path / "tower"),
              "--tower", "vision"])
    cli.main(["--from", "gguf", "--src", str(fixtures / "gguf_llama" / "tiny.gguf"), "--out", str(tmp_path / "lm")])
    c = _config("vlm_scenes", f"smoke,connector=pool,budget=4,chat={chat}", data_dir,
                **{"init.vision": str(tmp_path / "tower"), "init.lm": str(tmp_path / "lm"),
                   "init.allow_random_tower": False, "input.image_size": 48, "model.max_len": 96 if chat else 64})
    assert ckpt_lib.load_config(tmp_path / "tower")["input"]["image_mean"] == list(convert.OPENAI_CLIP[0])
    assert f"normalize({convert.OPENAI_CLIP[0]}, {convert.OPENAI_CLIP[1]})" in pp_template.pp_string(c)
    if chat:  # the prompts are the LM's chat template with the image where <image> stood
        example = preprocess.parse(pp_template.pp_string(c), tasks.tokenizer_for(c))(
            {"image": np.zeros((8, 8, 3), np.uint8), "questions": ["how many stars are there?"], "answers": ["2"],
             "question_kinds": [0]}, np.random.default_rng(0))
        head = "<|im_start|>system\nAnswer with one word or number.<|im_end|>\n<|im_start|>user\n"
        assert int(example["image_pos"]) == len(tasks.tokenizer_for(c).encode(head))
    summary = trainer.train(c, tmp_path / "vlm", stop_at=1 if chat else None)
    assert capsys.readouterr().out.count("model.vision is replaced by the tower saved in") == 1
    if chat:  # the run outlives its init folders: it resumes, exports and chats with them moved away
        for name in ("tower", "lm"):
            (tmp_path / name).rename(tmp_path / f"moved_{name}")
        assert sorted(p.name for p in (tmp_path / "vlm/sources").iterdir()) == ["lm", "vision"]
        summary = trainer.train(c, tmp_path / "vlm")
        assert summary["final_step"] == c.total_steps > 1
        assert "replaced by the tower" not in capsys.readouterr().out  # said at the start, not on each resume
        from vitmm import chat as chat_lib

        assert chat_lib.load(tmp_path / "vlm").tokenizer.chat_template
        for name in ("tower", "lm"):
            (tmp_path / f"moved_{name}").rename(tmp_path / name)
    assert np.isfinite(summary["history"][-1]["loss"]) and "qa/accuracy" in summary["evals"]
    params = ckpt_lib.load_params(tmp_path / "vlm")
    tower, lm = ckpt_lib.load_params(tmp_path / "tower")["img"], ckpt_lib.load_params(tmp_path / "lm")["lm"]
    kwargs = ckpt_lib.load_config(tmp_path / "tower")["model"]["image"]
    resized = resize_posemb(tower, (6, 6), kwargs["posemb_resample"])
    jax.tree.map(np.testing.assert_array_equal, params["tower"], jax.tree.map(np.asarray, resized))
    jax.tree.map(np.testing.assert_array_equal, params["language"], lm)  # frozen in stage 1
    assert params["tower"]["pos_embedding"].shape == (1, 6, 6, 32)

    # The parts go back to transformers' layouts and load to the same parameters.
    from vitmm import export
    from vitmm.interop import hf, hf_lm

    if chat:
        shutil.rmtree(tmp_path / "lm")  # the LM's tokenizer and template travel from the run's pinned copy
    written = export.export_vlm(tmp_path / "vlm", tmp_path / "exported")
    assert set(written) == {"lm", "vision", "connector"}
    same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, jax.tree.map(np.asarray, b))  # noqa: E731
    same(hf_lm.load_lm(tmp_path / "exported/lm")[1], params["language"])
    vision_kwargs, vision_params = hf.load_clip_vision(tmp_path / "exported/vision")
    same(vision_params, params["tower"])
    assert (vision_kwargs["act"], vision_kwargs["norm_eps"]) == ("quick_gelu", 1e-5)
    settings, connector = export.load_connector(tmp_path / "exported")
    same(connector, {"project": params["project"]})
    assert settings["connector"] == {"name": "pool", "budget": 4}
    assert (tmp_path / "exported/lm/tokenizer.json").is_file()
    assert (tmp_path / "exported/lm/tokenizer_config.json").is_file()  # the GGUF carries a chat template


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
    alpha = vlm_start.lora_alpha(c)
    expected = lora_lib.merge(after, after["lora"], alpha)["language"]["block_00"]["attn"]["q"]["kernel"]
    np.testing.assert_array_equal(merged["language"]["block_00"]["attn"]["q"]["kernel"], expected)
    raised = _config("vlm_scenes", "smoke,stage=2", data_dir, **{"lora.rank": 8})  # a rank without the lora= arg
    assert vlm_start.lora_alpha(raised) == 16.0  # unset: 2 x rank (alpha 0 would train adapters scaled to nothing)
    raised.lora.alpha = 0.0
    with pytest.raises(ValueError, match=r"lora.alpha=0.0 scales the adapters to nothing.*2 x rank = 16"):
        vlm_start.lora_alpha(raised)
    c.optim.freeze = (r"tower/.*",)  # adapters on an LM that would train too: refused before any step
    with pytest.raises(ValueError, match=r"lora.rank=2 adapts language/block_00/attn/k \(and 3 more layers\).*"
                                         r"add 'language/\.\*' to optim.freeze"):
        tasks.from_config(c, Parallel("jit"), tasks.tokenizer_for(c)).init_params()


def test_the_smollm2_config_runs_both_stages_on_converted_fixtures(tmp_path, data_dir, clip_smoke_run, capsys):
    """configs/vlm_smollm2_scenes.py as the README runs it, with a converted tiny GGUF in place of
    SmolLM2: stage 1 (connector), then stage 2 from it (fresh LoRA adapters + the connector; the
    LM's weights stay the converted ones), and the blind variant sees only blank images."""
    from vitmm.interop import __main__ as cli
    from vitmm.train import tasks, vlm_start

    fixtures = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"
    cli.main(["--from", "gguf", "--src", str(fixtures / "gguf_llama" / "tiny.gguf"), "--out", str(tmp_path / "lm")])
    parts = {"init.vision": str(clip_smoke_run.workdir), "init.lm": str(tmp_path / "lm"), "model.max_len": 96}
    trainer.train(_config("vlm_smollm2_scenes", "stage=1,smoke", data_dir, **parts), tmp_path / "s1")
    s1 = ckpt_lib.load_params(tmp_path / "s1")
    c2 = _config("vlm_smollm2_scenes", "stage=2,smoke", data_dir, **parts, **{"init.checkpoint": str(tmp_path / "s1")})
    assert c2.lora.rank == 8 and "chat=True" in c2.input.pp and "chat=True" in c2.evals.qa.pp
    with c2.unlocked():  # a kernel setting of the run applies to the converted LM (its weights unchanged)
        c2.model.lm.attn_impl = "xla"
    assert vlm_start.vlm_parts(c2)[1] == {**ckpt_lib.load_config(tmp_path / "lm")["model"]["lm"], "attn_impl": "xla"}
    c2.model.lm.attn_impl = None
    summary = trainer.train(c2, tmp_path / "s2")
    assert "qa/accuracy" in summary["evals"]
    s2 = ckpt_lib.load_params(tmp_path / "s2")
    jax.tree.map(np.testing.assert_array_equal, s2["language"], ckpt_lib.load_params(tmp_path / "lm")["lm"])
    assert sorted(s2["lora"]) == sorted(f"language.block_{i:02d}.attn.{r}" for i in range(2) for r in "qkvo")
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), s2["project"], s1["project"])))
    from vitmm import export  # LoRA merged into the exported LM; this tower has no transformers layout
    from vitmm.interop import hf_lm
    from vitmm.models import lora as lora_lib

    written = export.export_vlm(tmp_path / "s2", tmp_path / "exported")
    assert written["vision"].startswith("not written") and "class_token=False" in written["vision"]
    base = {k: v for k, v in s2.items() if k != "lora"}
    merged = lora_lib.merge(base, s2["lora"], vlm_start.lora_alpha(c2))["language"]
    jax.tree.map(np.testing.assert_array_equal, hf_lm.load_lm(tmp_path / "exported/lm")[1], merged)
    with pytest.raises(FileExistsError, match="not empty"):
        export.export_vlm(tmp_path / "s2", tmp_path / "exported")
    from vitmm.interop import vlm  # not LLaVA-shaped: every reason at once, nothing written

    with pytest.raises(ValueError, match=r"cannot be a LlavaForConditionalGeneration: the tower: posemb='sincos2d' "
                                         r"\(needs 'learn'\).*"
                                         r"connector \{'budget': 16, 'name': 'pool'\}"):
        vlm.export_llava(tmp_path / "s2", tmp_path / "as_hf")
    assert not (tmp_path / "as_hf").exists()

    from vitmm import chat  # the trained VLM answers a question in its chat format, deterministically

    vlm = chat.load(tmp_path / "s2")
    image = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    answer = vlm.ask(image, "how many stars are there?", max_new_tokens=4)
    assert isinstance(answer, str) and answer == vlm.ask(image, "how many stars are there?", max_new_tokens=4)
    capsys.readouterr()
    assert chat.main(["--workdir", str(tmp_path / "s2"), "--index", "2", "--question", "how many stars are there?",
                      "--question", "is there a red circle?", "--max_new_tokens", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("[scenes/") and printed.count("user: ") == 2 and printed.count("assistant: ") == 2
    assert export.main(["--workdir", str(clip_smoke_run.workdir), "--out", str(tmp_path / "x")]) == 2
    assert "not a VLM" in capsys.readouterr().err
    blind = _config("vlm_smollm2_scenes", "stage=2,smoke,blind=True", data_dir, **parts)
    example = preprocess.parse(pp_template.pp_string(blind), tasks.tokenizer_for(blind))(
        {"image": np.full((8, 8, 3), 200, np.uint8), "questions": ["how many stars?"], "answers": ["2"],
         "question_kinds": [0]}, np.random.default_rng(0))
    assert not example["image"].any() and "|blank|" in blind.evals.qa.pp




def test_the_qa_evaluator_scores_known_answers_per_kind(data_dir):
    """A decoder that always answers "yes" scores exactly the share of questions whose answer is
    "yes", overall and per kind (the yes/no kinds about half, the others none)."""
    from vitmm.data import pipeline
    from vitmm.data import tokenizer as tok_lib
    from vitmm.data.scenes import QUESTION_KINDS
    from vitmm.train import vlm_evaluators

    tok = tok_lib.ByteTokenizer()
    pp = "decode|resize(32)|value_range(-1, 1)|choose|qa_tokens(48)"
    cfg = dict(data=dict(name=common.SMOKE_DATA, split="validation", data_dir=data_dir), pp=pp, num_examples=40,
               batch_size=16, max_new_tokens=5)
    qa = vlm_evaluators.QAAccuracy(None, cfg, tok, prefix_lm=False)
    yes = tok.encode("yes") + [tok.eos_id]
    qa.decode = lambda variables, images, *args: np.tile(np.array(yes + [0] * (5 - len(yes))), (len(images), 1))
    result = qa.run(params={})
    answers, kinds = [], []  # the same examples through the same preprocessing
    for batch in pipeline.eval_batches(qa.source, qa._pp, 16, process_index=0, process_count=1, num_threads=1):
        keep = batch["_mask"].astype(bool)
        answers += [a for a, k in zip(batch["answer"], keep, strict=True) if k]
        kinds += list(np.asarray(batch["question_kind"])[keep])
    answers, kinds = np.array(answers), np.array(kinds)
    assert result["examples"] == len(answers) == 40
    assert result["accuracy"] == pytest.approx(np.mean(answers == "yes"))
    for i, kind in enumerate(QUESTION_KINDS):
        if (kinds == i).any():
            assert result[f"acc_{kind}"] == pytest.approx(np.mean(answers[kinds == i] == "yes"))
    assert 0 < result["accuracy"] < 1 and result.get("acc_count", 0.0) == 0.0


def test_the_qa_evaluator_stops_an_answer_at_any_eos_id_as_serve_does(data_dir):
    """A tokenizer with two EOS ids (an instruct LM's end of turn and its EOS): the answer ends at
    whichever comes first, and the decoder is given both."""
    from vitmm.data import tokenizer as tok_lib
    from vitmm.train import vlm_evaluators

    tok = tok_lib.ByteTokenizer()
    tok.eos_ids = (tok.eos_id, 256)  # byte 0xff, never in UTF-8 text, as a second end of turn
    cfg = dict(data=dict(name=common.SMOKE_DATA, split="validation", data_dir=data_dir), num_examples=4,
               batch_size=4, max_new_tokens=8, pp="decode|resize(32)|value_range(-1, 1)|choose|qa_tokens(48)")
    qa = vlm_evaluators.QAAccuracy(None, cfg, tok, prefix_lm=False)
    given = []

    def decode(variables, images, prompts, prompt_len, max_new_tokens, eos_id, *args):
        given.append(eos_id)
        return np.tile(tok.encode("yes") + [256] + tok.encode("no") + [tok.eos_id], (len(images), 1))

    qa.decode = decode
    assert [a["prediction"] for a in qa.answers({})] == ["yes"] * 4 and given == [(tok.eos_id, 256)]


@pytest.mark.parametrize("arg", ["mrope=True", "anyres=16", "anyres=16,any_size=True"])
def test_native_resolution_keys_build_train_and_answer(tmp_path, data_dir, arg):
    """``mrope`` (Qwen2-VL's positions, the LM's bands split by ``rope.mrope_split``) and ``anyres``
    (LLaVA-NeXT's tiles, made on the host; with ``any_size`` of scenes at random sizes, so each
    batch mixes token counts) reach the VLM the run trains, and the QA evaluator decodes with them."""
    from vitmm.data import pipeline
    from vitmm.train import tasks

    c = _config("vlm_scenes", f"smoke,{arg}", data_dir)
    task = tasks.VLMTask(c, None, tasks.tokenizer_for(c))
    if arg.startswith("mrope"):
        assert task.model.mrope and task.model.lm["mrope_section"] == (2, 1, 1)  # head_dim 8
    else:  # a 32-px image: the base view (2x2 tokens) and 2x2 tiles of 2x2 tokens, a newline per row
        assert task.model.anyres == {"pinpoints": [(16, 32), (32, 16), (32, 32)], "tile": 16}
        task.init_params()
        assert task.num_visual == 4 + 16 + 4
        spec = pp_template.pp_string(c)
        assert spec.startswith("decode|anyres([(16, 32), (32, 16), (32, 32)], 16, (2, 2))|normalize(")
        pp = preprocess.parse(spec, task.tokenizer)
        source = pipeline.source_for(inputs.data_spec(c.input))
        examples = [pp(source[i], np.random.default_rng(i)) for i in range(12)]
        assert {e["image"].shape for e in examples} == {(5, 16, 16, 3)}  # views padded to 1 + 2x2
        counts = {int(e["visual_mask"].sum()) for e in examples}
        assert (len(counts) > 1) == arg.endswith("any_size=True") and max(counts) <= 24
    summary = trainer.train(c, tmp_path)
    assert "qa/accuracy" in summary["evals"]
    assert all(np.isfinite(h["loss"]) for h in summary["history"])
    assert ("image_newline" in ckpt_lib.load_params(tmp_path)) == arg.startswith("anyres")


def test_a_loaded_tower_is_reported_only_where_it_differs_from_the_config(data_dir, capsys, monkeypatch, tmp_path):
    """A config holds the kernel keys at None (the model's default); a tower saved before they existed
    does not: that alone is no difference to report. A different width is."""
    from vitmm.train import tasks, vlm_start

    (tmp_path / "saved_tower").mkdir()  # its config is the monkeypatched one below
    c = _config("vlm_scenes", "smoke", data_dir, **{"init.vision": str(tmp_path / "saved_tower")})
    saved = {k: v for k, v in c.model.vision.to_dict().items() if v is not None or k not in vlm_start.KERNEL_KEYS}
    assert saved != c.model.vision.to_dict()  # the config's None kernel keys are not in the saved tower
    monkeypatch.setattr(tasks.ckpt_lib, "load_config", lambda path: {"model": {"image": dict(saved)}})
    assert vlm_start.vlm_parts(c, say=True)[0] == saved and capsys.readouterr().out == ""
    saved["width"] = 2 * saved["width"]
    assert vlm_start.vlm_parts(c)[0]["width"] == saved["width"] and capsys.readouterr().out == ""  # readers: silent
    assert vlm_start.vlm_parts(c, say=True)[0]["width"] == saved["width"]
    assert f"model.vision is replaced by the tower saved in {tmp_path / 'saved_tower'}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["val", "retrieval"])
def test_a_vlm_evaluator_of_an_unknown_type_is_refused_at_setup(tmp_path, kind):
    """A typo (``val``) or a contrastive type in a VLM run's evals: one line naming it and the
    accepted types when the evaluators are built, not a QA evaluator that fails (or answers under
    the wrong name) at the first evaluation."""
    from vitmm.data import examples
    from vitmm.train import tasks

    val = examples.write_csv(tmp_path / "val", 4, resolution=32, split="validation")
    c = config_args.load("configs/vlm_scenes.py", "smoke", **{"input.data_dir": str(tmp_path),
                                                               "init.allow_random_tower": True})
    with c.unlocked():
        c.evals = {"heldout": {"type": kind, "data": {"csv": str(val)}, "num_examples": 4, "batch_size": 2}}
    task = tasks.VLMTask(c, None, tasks.tokenizer_for(c))
    with pytest.raises(ValueError, match=rf"Unknown evaluator type '{kind}' for evals.heldout of a VLM run; "
                                         r"choose one of \('qa', 'val_loss'\)"):
        task.evaluators()


@pytest.mark.parametrize("kind, setting", [("qa", "max_new_token"), ("val_loss", "max_new_tokens"),
                                           ("qa", "embed_batch_size")])
def test_a_vlm_evaluator_setting_it_would_ignore_is_refused_at_setup(kind, setting):
    """A config file's misspelt or foreign ``evals.<name>`` key (``--config.`` overrides are checked on the
    command line) is one line naming it and the type's settings, as the two-tower evaluators' is, not
    silently ignored."""
    from vitmm.train import tasks

    c = config_args.load("configs/vlm_scenes.py", "smoke", **{"init.allow_random_tower": True})
    with c.unlocked():
        c.evals = {"heldout": {"type": kind, "data": {"name": "scenes/easy_64", "split": "validation"},
                               setting: 4}}
    task = tasks.VLMTask(c, None, tasks.tokenizer_for(c))
    with pytest.raises(ValueError, match=rf"evals.heldout \({kind}\) has no setting\(s\) \['{setting}'\]; it takes"):
        task.evaluators()
