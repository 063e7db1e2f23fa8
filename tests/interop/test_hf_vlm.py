"""Whole transformers VLMs (LLaVA with its ``LlavaProcessor``, ``tests/fixtures/interop/hf_llava``,
written by ``make_fixtures.py --only vlm``; LLaVA-NeXT, ``hf_llava_next``, by ``--only llava_next``;
PaliGemma in ``test_hf_paligemma.py``) imported into a vitmm
VLM workdir: the processor's pixels and ids, the logits (≤ 1e-5 of the largest) and the greedy
answers equal transformers'; every tensor layout transformers writes reads alike; what vitmm cannot
hold is refused in one line with nothing written."""

import json
import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import import_hf

from vitmm.interop import io
from vitmm.interop import vlm as hf_vlm

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/hf_llava"
IMAGE_TOKEN = 320  # the fixture tokenizer's <image>


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_hf(FIXTURE, tmp_path_factory)  # the CLI, in this process


def test_llava_gives_transformers_pixels_ids_logits_and_greedy_answers(imported):
    _, vlm = imported
    ref = np.load(FIXTURE / "io.npz")
    prompts = json.loads((FIXTURE / "prompts.json").read_text())
    for i, prompt in enumerate(prompts):  # a 24x20 image (resized and cropped), then a 16x16 one
        example = vlm.prepare([ref[f"image_{i}"]], [{"from": "human", "value": prompt["messages"][0]["content"]}])
        np.testing.assert_allclose(example["image"], ref[f"pixel_values_{i}"][0].transpose(1, 2, 0), atol=1e-6)
        hf_ids = ref[f"input_ids_{i}"][0]
        n, pos = int(example["prompt_len"]), int(example["image_pos"])
        assert list(example["ids"][:n]) == [t for t in hf_ids if t != IMAGE_TOKEN]  # the text, token for token
        at = np.flatnonzero(hf_ids == IMAGE_TOKEN)
        assert pos == at[0] and len(at) == vlm.num_prompt_tokens(example) - n == 16  # where and how many
        logits = np.asarray(vlm.task.model.apply({"params": vlm.params}, jnp.asarray(example["image"][None]),
                                                 jnp.asarray(example["ids"][None, :n]), image_pos=jnp.array([pos])))
        want = ref[f"logits_{i}"][0]
        assert logits.shape[1:] == want.shape
        assert np.abs(logits[0] - want).max() <= 1e-5 * np.abs(want).max()
        assert list(vlm.generate(example, 6)) == list(ref[f"answer_{i}"])


@pytest.fixture(scope="module")
def next_imported(tmp_path_factory):
    return import_hf(FIXTURE.with_name("hf_llava_next"), tmp_path_factory)


def _check_anyres_prompt(vlm, ref: dict, prompts: list, i: int) -> None:
    """Prompt ``i`` of an AnyRes fixture: views, ids and the image's place and token count equal
    transformers'; logits at the real positions (the padding views' tokens out) ≤ 1e-5 of the
    largest; the same greedy answer."""
    from vitmm.train.tasks import anyres_layout

    example = vlm.prepare([ref[f"image_{i}"]], [{"from": "human", "value": prompts[i]["messages"][0]["content"]}])
    views = ref[f"pixel_values_{i}"][0].transpose(0, 2, 3, 1)
    np.testing.assert_allclose(example["image"][:len(views)], views, atol=1e-6)
    n, pos, hf_ids = int(example["prompt_len"]), int(example["image_pos"]), ref[f"input_ids_{i}"][0]
    assert list(example["ids"][:n]) == [t for t in hf_ids if t != IMAGE_TOKEN]
    at = np.flatnonzero(hf_ids == IMAGE_TOKEN)
    assert pos == at[0] and len(at) == vlm.num_prompt_tokens(example) - n
    mask = example["visual_mask"]
    layout = jax.tree.map(lambda x: jnp.asarray(x)[None], anyres_layout(example))  # OneVision's: with weights
    logits = np.asarray(vlm.task.model.apply(
        {"params": vlm.params}, jnp.asarray(example["image"][None]), jnp.asarray(example["ids"][None, :n]),
        image_pos=jnp.array([pos]), visual_mask=jnp.asarray(mask[None]), layout=layout))[0]
    real = np.concatenate([np.ones(pos, bool), mask, np.ones(n - pos, bool)])
    want = ref[f"logits_{i}"][0]
    assert np.abs(logits[real] - want).max() <= 1e-5 * np.abs(want).max()
    assert list(vlm.generate(example, 6)) == list(ref[f"answer_{i}"])


def test_llava_next_gives_transformers_views_ids_logits_and_greedy_answers(next_imported, tmp_path):
    """LLaVA-NeXT (``hf_llava_next``): AnyRes views made as its processor makes them (the base view
    squashed to a tile, the tiles of the best of 1x2, 2x1, 2x2 with the image centred on black,
    bicubic), its token count and place (the unpadded grid, a newline ending each row), logits at the
    real positions ≤ 1e-5 of the largest, the same greedy answers; exported back, the same parameters."""
    out, vlm = next_imported
    folder = FIXTURE.with_name("hf_llava_next")
    ref = np.load(folder / "io.npz")
    assert vlm.config.model.anyres.to_dict() == {"pinpoints": [[16, 32], [32, 16], [32, 32]], "tile": 16,
                                                 "method": "bicubic"}  # the processor's, for flat sequences
    for i in range(3):  # 24x40, 30x18, 16x16
        _check_anyres_prompt(vlm, ref, json.loads((folder / "prompts.json").read_text()), i)
    hf_vlm.export_llava(out, tmp_path / "hf")
    config, params, _ = hf_vlm.load_llava(tmp_path / "hf")
    assert jax.tree.all(jax.tree.map(np.array_equal, params, vlm.params))
    assert config["input"]["pp"] == vlm.config.input.pp
    from vitmm import export  # the parts carry the learned newline and the AnyRes settings too

    export.export_vlm(out, tmp_path / "parts")
    settings, rest = export.load_connector(tmp_path / "parts")
    assert settings["anyres"] == vlm.config.model.anyres.to_dict() and sorted(rest) == ["image_newline", "project"]
    np.testing.assert_array_equal(rest["image_newline"], vlm.params["image_newline"])


def test_llava_onevision_gives_transformers_views_ids_logits_and_greedy_answers(tmp_path):
    """LLaVA-OneVision (``hf_llava_onevision``): SigLIP read at its last block before the final norm,
    LLaVA-NeXT's views and unpadding, and ``anyres_max_2``: a grid downsampled bilinearly
    (``models.anyres.downsampled``) and one not; the token counts, logits at the real
    positions (≤ 1e-5 of the largest) and greedy answers equal transformers'; exported back, the
    same parameters (transformers runs the export: ``in_transformers``)."""
    from vitmm import chat
    from vitmm.interop.__main__ import main

    folder = FIXTURE.with_name("hf_llava_onevision")
    main(["--from", "hf", "--src", str(folder), "--out", str(tmp_path / "w")])
    vlm, ref = chat.load(tmp_path / "w"), np.load(folder / "io.npz")
    assert vlm.config.model.anyres.max_patches == 2 and not vlm.config.model.vision.final_norm
    prompts = json.loads((folder / "prompts.json").read_text())
    for i in (0, 3):  # 24x40 (2x3 tiles, downsampled) and 16x16 (one tile, not); the export runs all four
        _check_anyres_prompt(vlm, ref, prompts, i)
    exported = hf_vlm.export_hf(tmp_path / "w", tmp_path / "hf")
    assert exported["architecture"] == "LlavaOnevisionForConditionalGeneration"
    assert jax.tree.all(jax.tree.map(np.array_equal, hf_vlm.load_llava(tmp_path / "hf")[1], vlm.params))


def test_llava_next_tiles_other_than_the_towers_input_are_refused(tmp_path, capsys):
    from vitmm.interop.__main__ import main

    folder = tmp_path / "src"
    shutil.copytree(FIXTURE.with_name("hf_llava_next"), folder)
    processor = json.loads((folder / "processor_config.json").read_text())
    processor["image_processor"]["crop_size"] = {"height": 12, "width": 12}
    (folder / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(SystemExit) as exit_:
        main(["--from", "hf", "--src", str(folder), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "LLaVA-NeXT's tiles of the tower's 16x16 input" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_llava_with_a_siglip_tower_gives_transformers_pixels_ids_logits_and_greedy_answers(tmp_path):
    """LLaVA with a SigLIP tower (``hf_llava_siglip``, llava-interleave's layout): its last block before
    the final norm (``final_norm=False``), every patch (``full``), the image squashed to the tower's
    square; pixels, ids, logits (≤ 1e-5 of the largest) and greedy answers; exported back, the same
    parameters and image steps (transformers runs the export: ``in_transformers``)."""
    from vitmm import chat
    from vitmm.interop.__main__ import main

    folder = FIXTURE.with_name("hf_llava_siglip")
    main(["--from", "hf", "--src", str(folder), "--out", str(tmp_path / "w")])
    vlm, ref = chat.load(tmp_path / "w"), np.load(folder / "io.npz")
    assert not vlm.config.model.vision.final_norm
    assert vlm.config.input.pp.startswith("decode(alpha='white')|resize(16, method='bicubic')")
    for i, prompt in enumerate(json.loads((folder / "prompts.json").read_text())):  # 24x20, then 16x16
        example = vlm.prepare([ref[f"image_{i}"]], [{"from": "human", "value": prompt["messages"][0]["content"]}])
        np.testing.assert_allclose(example["image"], ref[f"pixel_values_{i}"][0].transpose(1, 2, 0), atol=1e-6)
        n, pos, hf_ids = int(example["prompt_len"]), int(example["image_pos"]), ref[f"input_ids_{i}"][0]
        assert list(example["ids"][:n]) == [t for t in hf_ids if t != IMAGE_TOKEN]
        assert pos == np.flatnonzero(hf_ids == IMAGE_TOKEN)[0] and vlm.num_prompt_tokens(example) - n == 16
        logits = np.asarray(vlm.task.model.apply({"params": vlm.params}, jnp.asarray(example["image"][None]),
                                                 jnp.asarray(example["ids"][None, :n]), image_pos=jnp.array([pos])))
        want = ref[f"logits_{i}"][0]
        assert np.abs(logits[0] - want).max() <= 1e-5 * np.abs(want).max()
        assert list(vlm.generate(example, 6)) == list(ref[f"answer_{i}"])
    hf_vlm.export_hf(tmp_path / "w", tmp_path / "hf")
    config, params, _ = hf_vlm.load_llava(tmp_path / "hf")
    assert jax.tree.all(jax.tree.map(np.array_equal, params, vlm.params))
    assert config["input"]["pp"] == vlm.config.input.pp
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())  # hidden_states[depth] is [-1]
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf_config, "vision_feature_layer": 2}))
    assert jax.tree.all(jax.tree.map(np.array_equal, hf_vlm.load_llava(tmp_path / "hf")[1], vlm.params))


def test_the_parts_export_of_an_import_carries_its_tokenizer_ids_and_template(imported, tmp_path):
    """An imported VLM has no ``init.lm``: its LM's part still gets the run's tokenizer, its special
    tokens and ids and its chat template (transformers' files), and nothing but what was asked."""
    from vitmm import export

    workdir, vlm = imported
    tokenizer = vlm.tokenizer
    written = export.export_vlm(workdir, tmp_path / "parts")
    assert "tokenizer" not in written  # (a byte tokenizer would be named there, not written)
    lm = tmp_path / "parts/lm"
    assert (lm / "tokenizer.json").read_text().strip() == tokenizer.to_str().strip()
    settings = json.loads((lm / "tokenizer_config.json").read_text())
    assert settings["chat_template"] == tokenizer.chat_template
    assert settings["eos_token"] == tokenizer.token(tokenizer.eos_id)
    config = json.loads((lm / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    assert json.loads((lm / "generation_config.json").read_text())["eos_token_id"] in (tokenizer.eos_id,
                                                                                       list(tokenizer.eos_ids))


def test_a_clip_tower_without_a_final_norm_is_refused_where_it_is_read_and_exported_where_not(imported, tmp_path,
                                                                                                monkeypatch):
    """``final_norm=False``: a standalone CLIPVisionModel applies ``post_layernorm`` to what it returns
    (the parts' tower is not written, with the reason); LLaVA reads an earlier hidden state, so
    ``--format hf`` writes an identity norm. Nothing is left half-written either way."""
    from vitmm import checkpoint as ckpt_lib
    from vitmm import export
    from vitmm.train import vlm_start

    load_params, vlm_parts = ckpt_lib.load_params, vlm_start.vlm_parts

    def without_norm(workdir):
        params = load_params(workdir)
        params["tower"]["encoder"].pop("encoder_norm")
        return params

    monkeypatch.setattr(ckpt_lib, "load_params", without_norm)
    monkeypatch.setattr(vlm_start, "vlm_parts",
                        lambda c, **kw: ({**vlm_parts(c)[0], "final_norm": False}, vlm_parts(c)[1]))
    workdir, _ = imported
    written = export.export_vlm(workdir, tmp_path / "parts")
    assert written["vision"].startswith("not written") and "no final norm (final_norm=False" in written["vision"]
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["connector.json", "connector.safetensors", "lm"]
    hf_vlm.export_hf(workdir, tmp_path / "hf")
    tensors = io.read_tensors(tmp_path / "hf")
    width = tensors["vision_tower.vision_model.post_layernorm.weight"].shape[0]
    np.testing.assert_array_equal(tensors["vision_tower.vision_model.post_layernorm.weight"], np.ones(width))
    np.testing.assert_array_equal(tensors["vision_tower.vision_model.post_layernorm.bias"], np.zeros(width))


def test_the_workdir_holds_the_processors_settings_and_its_own_tokenizer(imported):
    from vitmm import checkpoint as ckpt_lib

    out, vlm = imported
    config = ckpt_lib.load_config(out)
    assert config["task"] == "vlm" and config["model"]["vision_layer"] == -2
    assert config["model"]["connector"] == {"name": "mlp", "budget": "all"}
    assert config["input"]["image_size"] == 16 and config["input"]["image_mean"][0] == pytest.approx(0.48145466)
    assert config["tokenizer"] == str(out / "tokenizer.json") and (out / "tokenizer.json").is_file()
    assert config["chat_template"] == (FIXTURE / "chat_template.jinja").read_text()
    assert config["tokens"] == {"bos_id": 1, "eos_id": 2, "pad_id": 2, "eos_ids": [2]}
    assert vlm.ask(np.zeros((20, 30, 3), np.uint8), "what is it?", max_new_tokens=3) is not None


def _relabel(tensors: dict, layout: str) -> dict:
    """The fixture's tensors (transformers 5.24's hybrid layout) in another layout it writes."""
    out = {}
    for key, value in tensors.items():
        if layout == "classic":  # 4.x and early 5.x: vision_tower.vision_model.*
            key = key.replace("vision_tower.", "vision_tower.vision_model.", 1)
        else:  # model.* (what LlavaForConditionalGeneration holds in memory)
            key = ("lm_head." + key.removeprefix("language_model.lm_head.") if key.startswith("language_model.lm_head")
                   else "model.language_model." + key.removeprefix("language_model.model.")
                   if key.startswith("language_model.model.") else "model." + key)
        out[key] = value
    return out


@pytest.mark.parametrize("layout", ["classic", "model_prefix"])
def test_every_tensor_layout_transformers_writes_reads_alike(tmp_path, layout):
    _, base = hf_vlm.load_llava(FIXTURE)[:2]
    folder = tmp_path / layout
    shutil.copytree(FIXTURE, folder)
    io.write_safetensors(_relabel(io.read_tensors(FIXTURE), layout), folder / "model.safetensors")
    _, params, _ = hf_vlm.load_llava(folder)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, base))


def _as_transformers_4_saves(src: pathlib.Path, folder: pathlib.Path) -> None:
    """``src`` as transformers 4 writes a VLM: sub-configs without the fields at their class's default
    (``to_diff_dict``), the image processor's settings in ``preprocessor_config.json`` and only the
    processor's own in ``processor_config.json``."""
    from vitmm.interop import hf_lm
    from vitmm.interop.hf import clip

    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    defaults = {**hf_lm.LM_DEFAULTS, **clip.SIGLIP_DEFAULTS, "clip_vision_model": clip.VISION_DEFAULTS}
    for part in ("text_config", "vision_config"):
        table = defaults[config[part]["model_type"]]
        config[part] = {k: v for k, v in config[part].items() if k not in table or table[k] != v}
    (folder / "config.json").write_text(json.dumps(config))
    processor = json.loads((folder / "processor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(processor.pop("image_processor")))
    (folder / "processor_config.json").write_text(json.dumps(processor))


@pytest.mark.parametrize("name", ["hf_llava", "hf_paligemma"])
def test_a_folder_saved_by_transformers_4_reads_alike(tmp_path, name):
    """llava-1.5-7b-hf's text_config names no hidden_size (Llama's default), PaliGemma's of its time no
    activation (Gemma's gelu_tanh, not silu): they read as transformers reads them."""
    src = FIXTURE.parent / name
    load = hf_vlm.load_llava if name == "hf_llava" else hf_vlm.load_paligemma
    _as_transformers_4_saves(src, tmp_path / "v4")
    dropped = json.loads((tmp_path / "v4/config.json").read_text())["text_config"]
    assert "hidden_act" not in dropped  # at its default: left out
    settings, params, _ = load(tmp_path / "v4")
    base_settings, base_params, _ = load(src)
    assert settings == base_settings
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, base_params))


@pytest.mark.parametrize(("change", "message"), [
    ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy='full'"),
    ({"vision_feature_layer": [-2, -1]}, "several layers concatenated"),
    ({"vision_feature_layer": -1}, "the last block without the final norm"),
    ({"projector_hidden_act": "relu"}, "projector_hidden_act='relu'"),
    ({"architectures": ["Blip2ForConditionalGeneration"]}, "is a Blip2ForConditionalGeneration VLM, which vitmm "
                                                            "does not import; it imports LlavaForConditional"),
])
def test_what_vitmm_cannot_hold_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, change, message):
    from vitmm.interop.__main__ import main

    folder = tmp_path / "src"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["--from", "hf", "--src", str(folder), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_options_for_one_tower_are_refused_for_a_whole_vlm(tmp_path, capsys):
    from vitmm.interop.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--from", "hf", "--src", str(FIXTURE), "--out", str(tmp_path / "out"), "--image_size", "32"])
    assert exit_.value.code == 2 and "is a whole VLM (LlavaForConditionalGeneration)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def finetuned(imported, tmp_path_factory):
    """configs/llava_finetune.py with LoRA from the imported workdir, 4 steps on written LLaVA data."""
    import contextlib
    import io as io_lib

    from vitmm import config_args
    from vitmm.data import examples
    from vitmm.train import trainer

    out, _ = imported
    root = tmp_path_factory.mktemp("finetune")
    data = examples.write_llava(root / "data", 8, resolution=24)
    run = root / "run"
    # What `python -m vitmm.train --config configs/llava_finetune.py:lora=4,smoke --config.init.checkpoint=W
    # --config.input.data_path=... --config.input.image_folder=...` runs, in this process.
    config = config_args.load(pathlib.Path(__file__).resolve().parents[2] / "configs/llava_finetune.py",
                              "lora=4,smoke", **{"init.checkpoint": str(out), "input.data_path": str(data),
                                                 "input.image_folder": str(data.parent)})
    printed = io_lib.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train(config, run)
    return run, data, printed.getvalue()


def test_an_imported_llava_fine_tunes_with_lora_as_it_is_and_chats(imported, finetuned, capsys):
    """README's "Start from a pretrained VLM": ``init.checkpoint`` = the imported workdir gives the run
    its model, tokenizer and image settings; LoRA trains the adapters and the connector, the tower and
    the LM stay as imported; ``vitmm.chat`` answers from the run."""
    from vitmm import checkpoint as ckpt_lib

    (out, _), (run, data, stdout) = imported, finetuned
    assert "model, tokenizer and image settings from the imported LlavaForConditionalGeneration" in stdout
    config, saved = ckpt_lib.load_config(run), ckpt_lib.load_config(out)
    assert config["model"]["lm"] == saved["model"]["lm"] and config["input"]["image_size"] == 16
    before, after = ckpt_lib.load_params(out), ckpt_lib.load_params(run)
    assert jax.tree.all(jax.tree.map(np.array_equal, after["tower"], before["tower"]))
    assert jax.tree.all(jax.tree.map(np.array_equal, after["language"], before["language"]))
    assert "lora" in after and not jax.tree.all(jax.tree.map(np.array_equal, after["project"], before["project"]))
    from vitmm.chat import main

    assert main(["--workdir", str(run), "--image", str(next((data.parent / "images").iterdir())), "--question",
                 "What is it?"]) in (0, None)
    assert "assistant:" in capsys.readouterr().out


def test_a_run_started_from_the_imported_llavas_run_takes_the_imported_settings(imported, finetuned, capsys):
    """Stage 2 with ``init.checkpoint`` = stage 1's workdir (stage 1 started from the imported LLaVA)
    takes the imported model, tokenizer, special ids and image statistics as stage 1 did: stage 1's
    config records the import (``source.imported_from``). It once took its own config's tower and LM
    and 0.5 statistics, and died in merge_params suggesting init.dont_load."""
    from vitmm import checkpoint as ckpt_lib
    from vitmm import config_args
    from vitmm.train import imported_vlm

    (out, _), (run, data, _) = imported, finetuned
    first = ckpt_lib.load_config(run)
    assert first["source"] == {"imported_from": ckpt_lib.load_config(out)["source"]}
    config = config_args.load(pathlib.Path(__file__).resolve().parents[2] / "configs/llava_finetune.py", "smoke",
                              **{"init.checkpoint": str(run), "input.data_path": str(data),
                                 "input.image_folder": str(data.parent)})
    second = imported_vlm.from_imported_vlm(config)
    assert f"imported LlavaForConditionalGeneration in {run} (a run that started from it)" in capsys.readouterr().out
    for key in ("model", "tokenizer", "tokens", "chat_template"):
        assert second.to_dict()[key] == first[key], key
    for key in ("image_size", "image_mean", "image_std"):
        assert list(np.ravel(second.input[key])) == list(np.ravel(first["input"][key])), key
    assert second.source.imported_from.architecture == "LlavaForConditionalGeneration"


def test_the_imported_settings_name_each_setting_of_the_run_they_replace(imported, capsys):
    """A run asking for another resolution and statistics than the imported VLM's trains at the
    imported ones (its weights are that model's), and says so key by key with both values."""
    from vitmm import config_args
    from vitmm.train import imported_vlm

    out, _ = imported
    config = config_args.load(pathlib.Path(__file__).resolve().parents[2] / "configs/llava_finetune.py", "smoke",
                              **{"init.checkpoint": str(out), "input.image_size": 48,
                                 "input.image_mean": (0.5, 0.5, 0.5), "input.image_std": (0.5, 0.5, 0.5)})
    resolved = imported_vlm.from_imported_vlm(config)
    printed = capsys.readouterr().out
    assert resolved.input.image_size == 16 and "input.image_size 48 -> 16" in printed
    assert "input.image_mean [0.5, 0.5, 0.5] -> [0.48145466, 0.4578275, 0.40821073]" in printed
    assert "input.image_std [0.5, 0.5, 0.5] -> [0.26862954" in printed


def test_an_exported_vlm_imports_back_to_the_same_parameters_and_image_steps(finetuned, tmp_path):
    """export_llava then the importer: the fine-tuned run's parameters (LoRA merged) and its image
    steps (LLaVA's pad-to-square, bilinear) come back as they were."""
    from vitmm import chat

    run, _, _ = finetuned
    hf_vlm.export_llava(run, tmp_path / "hf")
    config, params, _ = hf_vlm.load_llava(tmp_path / "hf")
    merged = chat.load(run).params  # what chat runs: the adapters merged
    assert "lora" not in merged and jax.tree.all(jax.tree.map(np.array_equal, params, merged))
    assert config["input"]["pp"].startswith("decode(alpha='white')|pad_to_square({image_mean})|"
                                            "resize(16, method='bilinear')|normalize")  # the run's own steps
    with pytest.raises(FileExistsError, match="not empty"):
        hf_vlm.export_llava(run, tmp_path / "hf")


EVAL_PYTHON = os.environ.get("VITMM_LMMS_EVAL_PYTHON", "")
QUESTIONS = ["<image>\nwhat colour is the circle?", "How many shapes? <image>"]


def _images():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, (24, 20, 3), dtype=np.uint8), rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)]


@pytest.fixture(scope="module")
def trained_here(tmp_path_factory):
    """A VLM vitmm trained (configs/llava_pretrain.py smoke: 4 steps of the connector) from a CLIP
    tower and the tiny GGUF LM, whose tokenizer has no ``<image>``."""
    from vitmm import config_args
    from vitmm.data import examples
    from vitmm.interop.__main__ import main as interop
    from vitmm.train import trainer

    root = tmp_path_factory.mktemp("trained_here")
    interop(["--from", "hf", "--src", str(FIXTURE.with_name("hf_clip")), "--out", str(root / "tower"),
             "--tower", "vision"])
    interop(["--from", "gguf", "--src", str(FIXTURE.with_name("gguf_llama") / "tiny.gguf"), "--out", str(root / "lm")])
    data = examples.write_llava(root / "data", 8, resolution=40)
    config = config_args.load(pathlib.Path(__file__).resolve().parents[2] / "configs/llava_pretrain.py", "smoke", **{
        "init.vision": str(root / "tower"), "init.lm": str(root / "lm"), "init.allow_random_tower": False,
        "input.data_path": str(data), "input.image_folder": str(data.parent), "input.image_size": 32})
    trainer.train(config, root / "run")
    return root / "run"


def test_a_vlm_trained_on_an_lm_without_an_image_token_exports_with_one_added(trained_here, tmp_path):
    """LLaVA's processor needs ``<image>`` in the tokenizer: the export adds it after the vocabulary
    (a zero row in the embedding and the tied head; generation suppresses it)."""
    out = hf_vlm.export_hf(trained_here, tmp_path / "hf")
    assert out["added"] == "<image> as token 320"
    config, generation = (json.loads((tmp_path / "hf" / name).read_text()) for name in ("config.json",
                                                                                        "generation_config.json"))
    assert config["image_token_index"] == 320 and config["text_config"]["vocab_size"] == 321
    assert generation["suppress_tokens"] == [320]
    embed = io.read_tensors(tmp_path / "hf")["language_model.model.embed_tokens.weight"]
    assert embed.shape[0] == 321 and not embed[320].any()


def _fixture_inputs(name: str, n: int) -> dict:
    """A fixture's first ``n`` images with their prompts as transformers' messages."""
    ref, prompts = np.load(FIXTURE.with_name(name) / "io.npz"), json.loads((FIXTURE.with_name(name) / "prompts.json")
                                                                           .read_text())
    return {**{f"image_{i}": ref[f"image_{i}"] for i in range(n)},
            **{f"messages_{i}": json.dumps(prompts[i]["messages"]) for i in range(n)}}


@pytest.fixture(scope="module")
def in_transformers(finetuned, next_imported, trained_here, tmp_path_factory):
    """The fine-tuned LLaVA and the imported PaliGemma, LLaVA-NeXT, Qwen2-VL and Idefics3 exported with
    ``--format hf`` and run in transformers (``.venv-eval``'s; one process for all): ``{name: outputs}``."""
    if not pathlib.Path(EVAL_PYTHON or "/nonexistent").is_file():
        pytest.skip("no environment with transformers (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
    from vitmm.export import main as export
    from vitmm.interop.__main__ import main as interop

    root = tmp_path_factory.mktemp("in_transformers")
    interop(["--from", "hf", "--src", str(FIXTURE.with_name("hf_paligemma")), "--out", str(root / "paligemma_w")])
    interop(["--from", "hf", "--src", str(FIXTURE.with_name("hf_qwen2_vl")), "--out", str(root / "qwen2_vl_w")])
    interop(["--from", "hf", "--src", str(FIXTURE.with_name("hf_idefics3")), "--out", str(root / "idefics3_w")])
    interop(["--from", "hf", "--src", str(FIXTURE.with_name("hf_llava_onevision")), "--out", str(root / "ov_w")])
    interop(["--from", "hf", "--src", str(FIXTURE.with_name("hf_llava_siglip")), "--out", str(root / "siglip_w")])
    pali = np.load(FIXTURE.with_name("hf_paligemma") / "io.npz")
    prompts = json.loads((FIXTURE.with_name("hf_paligemma") / "prompts.json").read_text())
    nxt = np.load(FIXTURE.with_name("hf_llava_next") / "io.npz")
    nxt_prompts = json.loads((FIXTURE.with_name("hf_llava_next") / "prompts.json").read_text())
    cases = {"llava": (finetuned[0], {**{f"image_{i}": x for i, x in enumerate(_images())},
                                      **{f"question_{i}": q for i, q in enumerate(QUESTIONS)}}),
             "paligemma": (root / "paligemma_w", {**{f"image_{i}": pali[f"image_{i}"] for i in range(2)},
                                                  **{f"question_{i}": q for i, q in enumerate(prompts)}}),
             "llava_next": (next_imported[0], {
                 **{f"image_{i}": nxt[f"image_{i}"] for i in range(3)},
                 **{f"question_{i}": p["messages"][0]["content"] for i, p in enumerate(nxt_prompts)}}),
             "qwen2_vl": (root / "qwen2_vl_w", _fixture_inputs("hf_qwen2_vl", 2)),  # its one-image prompts
             "idefics3": (root / "idefics3_w", _fixture_inputs("hf_idefics3", 3)),
             "llava_onevision": (root / "ov_w", _fixture_inputs("hf_llava_onevision", 4)),
             "llava_siglip": (root / "siglip_w", _fixture_inputs("hf_llava_siglip", 2)),
             # its first question as lmms-eval's llava_hf sends it: typed parts, which the LM's text-only
             # template reads once exported (QUESTIONS[0] is the same turn as a string)
             "trained_here": (trained_here, {**{f"image_{i}": x for i, x in enumerate(_images())},
                                             "messages_0": json.dumps([{"role": "user", "content": [
                                                 {"type": "image"}, {"type": "text", "text": QUESTIONS[0][8:]}]}]),
                                             "question_1": QUESTIONS[1]})}
    args = []
    for name, (workdir, inputs) in cases.items():
        assert export(["--workdir", str(workdir), "--out", str(root / name), "--format", "hf"]) == 0
        np.savez(root / f"{name}_in.npz", **inputs)
        args += [str(root / name), str(root / f"{name}_in.npz"), str(root / f"{name}_out.npz")]
    ran = subprocess.run([EVAL_PYTHON, str(pathlib.Path(__file__).with_name("transformers_vlm.py")), *args],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    return {name: np.load(root / f"{name}_out.npz") for name in cases}


def test_each_export_runs_in_transformers_as_in_vitmm_or_as_the_original(finetuned, trained_here, in_transformers):
    """One test (one xdist worker: transformers runs once) for every export of ``in_transformers``.

    LLaVA trained in vitmm (the imported LLaVA fine-tuned with LoRA, merged; a VLM trained here from a
    CLIP tower and a GGUF LM): transformers loads the export with AutoModelForImageTextToText and
    AutoProcessor and gives vitmm's pixels (LLaVA's pad-to-square, the run's), ids, logits (≤ 1e-5 of
    the largest; the added ``<image>``'s column aside) and greedy answers. An imported PaliGemma,
    LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL or Idefics3 exported back: the original model's ids, pixels
    (views, patches, tiles), logits (to 1e-5 of the largest) and greedy answers."""
    for name in ("llava", "trained_here"):
        _check_against_vitmm(in_transformers[name], finetuned[0] if name == "llava" else trained_here)
    for name, architecture, n in (("paligemma", "PaliGemmaForConditionalGeneration", 2),
                                  ("llava_next", "LlavaNextForConditionalGeneration", 3),
                                  ("qwen2_vl", "Qwen2VLForConditionalGeneration", 2),
                                  ("idefics3", "Idefics3ForConditionalGeneration", 3),
                                  ("llava_onevision", "LlavaOnevisionForConditionalGeneration", 4),
                                  ("llava_siglip", "LlavaForConditionalGeneration", 2)):
        out, ref = in_transformers[name], np.load(FIXTURE.with_name(f"hf_{name}") / "io.npz")
        assert str(out["class"]) == architecture
        for i in range(n):
            assert np.array_equal(out[f"input_ids_{i}"], ref[f"input_ids_{i}"]), (name, i)
            np.testing.assert_array_equal(out[f"pixel_values_{i}"], ref[f"pixel_values_{i}"], err_msg=name)
            # 1e-5: the stored logits come from another machine, whose CPU kernels round differently (PaliGemma's
            # differed by 1.6e-6 of the largest on one machine with the same weights, config, ids and pixels)
            assert np.abs(out[f"logits_{i}"] - ref[f"logits_{i}"]).max() <= 1e-5 * np.abs(ref[f"logits_{i}"]).max(), \
                (name, i)
            assert list(out[f"answer_{i}"]) == list(ref[f"answer_{i}"]), (name, i)


def _check_against_vitmm(ref, workdir) -> None:
    from vitmm import chat

    vlm = chat.load(workdir)
    assert str(ref["class"]) == "LlavaForConditionalGeneration"
    for i, (image, question) in enumerate(zip(_images(), QUESTIONS, strict=True)):
        example = vlm.prepare([image], [{"from": "human", "value": question}])
        np.testing.assert_allclose(example["image"], ref[f"pixel_values_{i}"][0].transpose(1, 2, 0), atol=1e-6)
        n, pos = int(example["prompt_len"]), int(example["image_pos"])
        hf_ids = ref[f"input_ids_{i}"][0]
        assert list(example["ids"][:n]) == [t for t in hf_ids if t != IMAGE_TOKEN]
        assert pos == np.flatnonzero(hf_ids == IMAGE_TOKEN)[0]
        logits = np.asarray(vlm.task.model.apply({"params": vlm.params}, jnp.asarray(example["image"][None]),
                                                 jnp.asarray(example["ids"][None, :n]), image_pos=jnp.array([pos])))
        want = ref[f"logits_{i}"][0][:, :logits.shape[-1]]  # trained here: <image> is a column more
        assert np.abs(logits[0] - want).max() <= 1e-5 * np.abs(want).max()
        assert list(vlm.generate(example, 6)) == list(ref[f"answer_{i}"])


DEFAULTS_SCRIPT = """
import json, transformers as T
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
classes = dict(llama=T.LlamaConfig, qwen2=T.Qwen2Config, qwen3=T.Qwen3Config, mistral=T.MistralConfig,
               phi3=T.Phi3Config, gemma=T.GemmaConfig, gemma2=T.Gemma2Config, gemma3_text=T.Gemma3TextConfig,
               clip_vision_model=T.CLIPVisionConfig, siglip_vision_model=T.SiglipVisionConfig,
               idefics3_vision=Idefics3VisionConfig)
out = {}
for name, cls in classes.items():
    c = cls().to_dict()
    rope = c.get("rope_parameters") or {}
    c["rope_theta"] = (rope.get("full_attention") or rope).get("rope_theta")
    out[name] = c
print(json.dumps(out))
"""


def test_the_defaults_for_fields_a_saved_config_leaves_out_are_transformers_own():
    if not EVAL_PYTHON or not os.path.exists(EVAL_PYTHON):
        pytest.skip("no environment with transformers (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
    from vitmm.interop import hf_lm
    from vitmm.interop.hf import clip

    run = subprocess.run([EVAL_PYTHON, "-c", DEFAULTS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    ours = {**hf_lm.LM_DEFAULTS, **clip.SIGLIP_DEFAULTS, "clip_vision_model": clip.VISION_DEFAULTS}
    differ = {(name, k): (v, theirs[name].get(k)) for name, table in ours.items() for k, v in table.items()
              if theirs[name].get(k) != v}
    assert differ == {}


def test_an_lms_text_template_reads_typed_parts_once_exported():
    """transformers' and lmms-eval's messages carry a list of typed parts; the template a converted
    LM brings reads strings: exported, it reads both (an image part as ``<image>\\n``), as
    transformers renders templates; a VLM's own template that reads parts is left as it is."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from vitmm.interop.vlm.common import with_typed_parts

    text_only = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    render = lambda template, messages: env.from_string(template).render(  # noqa: E731
        messages=messages, add_generation_prompt=True)
    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
             {"role": "user", "content": "and the shape?"}]
    plain = [{"role": "user", "content": "<image>\nwhat colour?"}, {"role": "assistant", "content": "red"},
             {"role": "user", "content": "and the shape?"}]
    assert render(with_typed_parts(text_only), typed) == render(text_only, plain)
    assert render(with_typed_parts(text_only), plain) == render(text_only, plain)
    own = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<img>{% else %}"
           "{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    assert with_typed_parts(own) == own
    llava_hf = ("{% for m in messages %}{{ m['role'].upper() + ': ' }}{% for c in m['content'] | selectattr('type', "
                "'equalto', 'image') %}<image>\n{% endfor %}{% for c in m['content'] | selectattr('type', 'equalto', "
                "'text') %}{{ c['text'] }}{% endfor %}{% endfor %}")  # reads parts with selectattr: left as it is
    assert with_typed_parts(llava_hf) == llava_hf


@pytest.mark.parametrize("method, code", [("bicubic", 3), (None, 2), ("lanczos", 1)])
def test_the_processors_resampling_is_the_runs(method, code):
    """PIL's codes (what every transformers image processor's ``resample`` reads): a run resizing
    with Lanczos exports Lanczos, not bilinear."""
    from vitmm.interop.vlm import llava

    how = f", method='{method}'" if method else ""
    pp = f"decode|pad_to_square|resize(32{how})|normalize(0.5, 0.5)"
    assert llava._image_processor(pp, 32, (0.5,) * 3, (0.5,) * 3)["resample"] == code
