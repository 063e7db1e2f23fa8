"""Qwen2-VL (``tests/fixtures/interop/hf_qwen2_vl``, written by ``make_fixtures.py --only qwen2_vl``)
imported into a vitmm VLM workdir: its processor's patches (``smart_resize``, two frames, the 2×2
windows together), ids and visual tokens' places, the logits (≤ 1e-5 of the largest, M-RoPE) and
the greedy answers equal transformers', for one image, one resized down and two in one turn."""

import json
import pathlib

import jax
import numpy as np
import pytest
from parity import asked_example, finetune_imported, flat_logits, import_hf, served_example

from vitmm.interop.vlm import qwen2_vl as hf_qwen2_vl

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/hf_qwen2_vl"
IMAGE_PAD = 323  # the fixture tokenizer's <|image_pad|>


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_hf(FIXTURE, tmp_path_factory)


def test_qwen2_vl_gives_transformers_patches_ids_logits_and_greedy_answers(imported):
    _, vlm = imported
    ref, prompts = np.load(FIXTURE / "io.npz"), json.loads((FIXTURE / "prompts.json").read_text())
    assert vlm.config.model.mrope and vlm.config.model.connector.to_dict() == {"name": "patch_merger", "merge": 2}
    for i, prompt in enumerate(prompts):  # 24x40; 50x50 (resized down to 32x32); 30x18 and 16x16 together
        images = [ref[f"image_{k}"] for k in prompt["images"]]
        example = vlm.prepare(images, [{"from": "human", "value": prompt["text"]}])
        logits, seq = flat_logits(vlm, example)
        hf_ids, want = ref[f"input_ids_{i}"][0], ref[f"logits_{i}"][0]
        patches = ref[f"pixel_values_{i}"]  # [N, (RGB, frame, row, col)] in merge-window order
        n = len(patches)
        np.testing.assert_allclose(seq["tower_patches"], patches.reshape(n, 3, 2, 4, 4).transpose(0, 3, 4, 2, 1)
                                   .reshape(n, -1), atol=1e-6)
        assert [list(g) for g in seq["grids"]] == [list(g[1:]) for g in ref[f"image_grid_thw_{i}"]]
        assert list(np.where(seq["visual"] >= 0, IMAGE_PAD, seq["tokens"])) == list(hf_ids)  # text and places
        assert np.abs(logits - want).max() <= 1e-5 * np.abs(want).max()
        assert list(vlm.generate(example, 6)) == list(ref[f"answer_{i}"])


def test_serve_and_chat_give_the_processors_prompt_with_no_newline_after_the_image(imported, monkeypatch):
    """An ``image_url`` part then a ``text`` part (``vitmm.serve``), and ``ask`` (``vitmm.chat
    --image``): the text follows ``<|vision_end|>`` directly, as in the processor's prompt
    (``prompts.json``); with the text first (lmms-eval's order) the image follows the text."""
    _, vlm = imported
    ref, prompts = np.load(FIXTURE / "io.npz"), json.loads((FIXTURE / "prompts.json").read_text())

    def text(example):  # the prompt with <|image_pad|> where each image's visual tokens go
        ids = list(example["ids"][: int(example["prompt_len"])])
        for at in sorted(example.get("image_positions", [example["image_pos"]]), reverse=True):
            ids.insert(int(at), IMAGE_PAD)
        return vlm.tokenizer._tok.decode(ids, skip_special_tokens=False)

    for prompt in (prompts[0], prompts[2]):  # one image; two
        images, question = [ref[f"image_{k}"] for k in prompt["images"]], prompt["messages"][0]["content"][-1]["text"]
        assert text(served_example(vlm, images, question)) == prompt["prompt"]
        assert text(asked_example(vlm, images, question, monkeypatch)) == prompt["prompt"]
    first = text(served_example(vlm, [ref["image_0"]], "what colour is the circle?", text_first=True))
    assert first.endswith("user\nwhat colour is the circle?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                          "<|im_start|>assistant\n")


def test_usage_counts_each_images_own_visual_tokens_in_any_order(imported):
    """``usage.prompt_tokens`` of two images of different sizes is the flat prompt's length, whichever
    comes first (it counted the first image's tokens for each)."""
    _, vlm = imported
    ref = np.load(FIXTURE / "io.npz")
    one, other = ref["image_0"], ref["image_2"]  # 24x40 and 30x18: 15 and 8 visual tokens
    alone = [vlm.prepare([image], [{"from": "human", "value": "<image>what?"}]) for image in (one, other)]
    assert [vlm.num_prompt_tokens(ex) for ex in alone] == [int(ex["prompt_len"]) + vlm._num_visual(ex["image"])
                                                          for ex in alone]
    both = [vlm.prepare(pair, [{"from": "human", "value": "<image><image>what?"}]) for pair in ([one, other],
                                                                                              [other, one])]
    text = int(both[0]["prompt_len"])
    assert [vlm.num_prompt_tokens(ex) for ex in both] == [text + 15 + 8] * 2


def test_a_video_is_refused_in_one_line_not_run_another_way(imported):
    _, vlm = imported
    with pytest.raises(ValueError, match="Video through an imported Qwen2-VL's image steps is not supported yet"):
        vlm.prepare([], [{"from": "human", "value": "<video>\nWhat happens?"}],
                    video=[np.zeros((8, 8, 3), np.uint8)] * 4)


def test_the_rotation_order_swap_is_its_own_inverse_and_keeps_the_scores():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(5, 2 * 8)), rng.normal(size=(7, 2 * 8))
    swapped = hf_qwen2_vl.rope_order(q, 2)
    assert np.array_equal(hf_qwen2_vl.rope_order(swapped, 2), q) and not np.array_equal(swapped, q)
    np.testing.assert_allclose(swapped @ hf_qwen2_vl.rope_order(k, 2).T, q @ k.T, rtol=1e-12)


def test_an_imported_qwen2_vl_fine_tunes_with_lora_on_its_own_image_steps_and_chats(imported, tmp_path):
    """``init.checkpoint`` = the imported workdir: the run takes its image steps (own sizes, two
    frames) with its model; LoRA trains on flat sequences with the tower packed, the tower and the LM
    stay as imported, and the run chats."""
    from vitmm import chat

    out, _ = imported
    saved, before, after = finetune_imported(out, tmp_path, {"length": 192, "max_images": 2, "tower_length": 128})
    assert "smart_resize" in saved["input"]["pp"] and "temporal_patch(2)" in saved["input"]["pp"]
    assert np.array_equal(after["tower"]["embedding"]["kernel"], before["tower"]["embedding"]["kernel"])
    assert "lora" in after
    assert isinstance(chat.load(tmp_path / "run").ask(np.zeros((20, 40, 3), np.uint8), "what?", 3), str)


def test_an_export_imports_back_to_the_same_parameters_and_image_steps(imported, tmp_path, capsys):
    """``--format hf`` on the imported Qwen2-VL (M-RoPE: Qwen2-VL's layout), read back; transformers
    runs it as the original (``test_hf_vlm.py``'s ``in_transformers``)."""
    from vitmm.export import main as export

    out, vlm = imported
    assert export(["--workdir", str(out), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert "architecture: Qwen2VLForConditionalGeneration" in capsys.readouterr().out
    config, params, _ = hf_qwen2_vl.load_qwen2_vl(tmp_path / "hf")
    assert jax.tree.all(jax.tree.map(np.array_equal, params, vlm.params))
    assert config["input"]["pp"] == vlm.config.input.pp


def test_min_and_max_pixels_override_size_as_transformers_reads_them():
    """Editing ``max_pixels`` is how a user caps Qwen2-VL's image tokens; transformers'
    ``Qwen2VLImageProcessor`` lets ``min_pixels``/``max_pixels`` override ``size``."""
    images = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "resample": 3}
    assert "smart_resize(3136, 12845056, 8," in hf_qwen2_vl._image_pp(images, 4, 2, "src")
    assert "smart_resize(64, 256, 8," in hf_qwen2_vl._image_pp({**images, "min_pixels": 64, "max_pixels": 256},
                                                                4, 2, "src")


def test_what_qwen2_vl_cannot_hold_is_named():
    vision = dict(width=32, mlp_dim=48, num_heads=4, patch_size=4, posemb="learn", class_token=False, pool="none")
    tower = {"embedding": {"kernel": np.zeros((4, 4, 3, 32))}}
    model = dict(connector={"name": "pixel_shuffle", "merge": 2}, mrope=True, vision_layer=-1,
                 lm={"qkv_bias": True})
    problems = hf_qwen2_vl.export_problems(model, vision, tower, [("naflex", (16, 4), {"merge": 2})])
    assert len(problems) == 3, problems
    assert "posemb='learn' (needs 'rope2d')" in problems[0] and "mlp_dim=48" in problems[0]
    assert "one frame" in problems[0] and "pixel_shuffle" in problems[1] and "['naflex']" in problems[2]


def test_vitmm_serve_decodes_requests_of_different_image_sizes_together_as_alone(imported):
    """The imported Qwen2-VL behind ``vitmm.serve`` (the real ``openai`` client): two requests with
    images of different sizes decoded in one batch (the tower's patches packed, M-RoPE a row each)
    get the greedy answers they get alone."""
    import base64
    import threading

    import openai

    from vitmm import serve
    from vitmm.data import examples

    out, vlm = imported
    ref = np.load(FIXTURE / "io.npz")
    images = [ref["image_0"], ref["image_2"]]  # 24x40 and 30x18: 15 and 8 visual tokens
    alone = [vlm.ask(image, "what is it?", 4) for image in images]
    engine = serve.Engine(out)
    url, stop = serve.start_in_thread(engine)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    engine.batcher.window, answers = 0.5, [None, None]

    def ask(i):
        data = "data:image/png;base64," + base64.b64encode(examples.encode(images[i], "png")).decode()
        answers[i] = client.chat.completions.create(model=out.name, max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}},
                                         {"type": "text", "text": "what is it?"}]}]).choices[0].message.content

    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        stop()
    assert answers == alone and max(engine.batcher.batch_sizes) == 2
