"""Idefics3 / SmolVLM (``tests/fixtures/interop/hf_idefics3``, written by ``make_fixtures.py --only
idefics3``) imported into a vitmm VLM workdir: its processor's tiles (the longest edge resized,
split into tiles plus the whole image, Lanczos), its text around them (rows, columns, the global
image), the logits (≤ 1e-5 of the largest) and the greedy answers equal transformers'; exported
back, the same parameters (transformers runs the export: ``test_hf_vlm.py``'s ``in_transformers``)."""

import json
import pathlib

import jax
import numpy as np
import pytest
from parity import finetune_imported, flat_logits, import_hf

from vitmm.data import tiles
from vitmm.interop.vlm import idefics3 as hf_idefics3

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/hf_idefics3"
IMAGE = 320  # the fixture tokenizer's <image>


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_hf(FIXTURE, tmp_path_factory)


def test_idefics3_gives_transformers_tiles_ids_logits_and_greedy_answers(imported):
    _, vlm = imported
    ref, prompts = np.load(FIXTURE / "io.npz"), json.loads((FIXTURE / "prompts.json").read_text())
    assert vlm.config.model.connector.to_dict() == {"name": "pixel_shuffle", "merge": 2, "norm": False, "depth": 1,
                                                    "use_bias": False}
    for i, prompt in enumerate(prompts):  # 24x40: 2x3 tiles; 30x18: 3x2; 16x16: 3x3; each + the whole image
        example = vlm.prepare([ref[f"image_{i}"]], [{"from": "human", "value": prompt["text"]}])
        logits, seq = flat_logits(vlm, example)
        np.testing.assert_allclose(seq["images"], ref[f"pixel_values_{i}"][0].transpose(0, 2, 3, 1), atol=1e-6)
        assert list(np.where(seq["visual"] >= 0, IMAGE, seq["tokens"])) == list(ref[f"input_ids_{i}"][0])
        want = ref[f"logits_{i}"][0]
        assert np.abs(logits - want).max() <= 1e-5 * np.abs(want).max()
        assert list(vlm.generate(example, 6)) == list(ref[f"answer_{i}"])


def test_an_image_within_one_tile_stays_one_with_the_global_marks():
    frames, text = tiles.split(np.zeros((10, 7, 3), np.uint8), 16, 16)
    assert [f.shape for f in frames] == [(16, 16, 3)] and text == "<fake_token_around_image><global-img><image>" \
                                                                  "<fake_token_around_image>"
    assert tiles.resized_size(10, 7, 16) == (16, 12) and tiles.encoder_size(16, 12, 16) == (16, 16)
    # A text-only example's placeholder is a tile's size: it batches with tiled examples.
    text_only = tiles.idefics3_tiles(64, 16)({"has_image": np.bool_(False), "image": np.zeros((1, 1, 3), np.float32)},
                                            None)
    assert text_only["image"].shape == (16, 16, 3) and "image_texts" not in text_only


def test_paligemmas_template_puts_its_one_image_prefix_on_the_first_turn_only():
    import jinja2

    from vitmm.data import pipeline
    from vitmm.interop.vlm.paligemma import PALIGEMMA_TEMPLATE

    messages = [{"role": "user", "content": "<image>\nhow many?"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "which colour?"}, {"role": "assistant", "content": "red"}]
    text = jinja2.Environment().from_string(PALIGEMMA_TEMPLATE).render(messages=messages, bos_token="<bos>",
                                                                       eos_token="<eos>")
    assert text == "<image><bos>\nhow many?\n2<eos>which colour?\nred<eos>"
    with pytest.raises(ValueError, match=r"image_positions in some only\); some have several images.*"
                                         r"input.sequences"):
        pipeline.collate([{"ids": np.zeros(3)}, {"ids": np.zeros(3), "image_positions": np.zeros(2)}])


def test_an_export_imports_back_to_the_same_parameters_and_image_steps(imported, tmp_path, capsys):
    from vitmm.export import main as export

    out, vlm = imported
    assert export(["--workdir", str(out), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert "architecture: Idefics3ForConditionalGeneration" in capsys.readouterr().out
    config, params, _ = hf_idefics3.load_idefics3(tmp_path / "hf")
    assert jax.tree.all(jax.tree.map(np.array_equal, params, vlm.params))
    assert config["input"]["pp"] == vlm.config.input.pp


def test_what_idefics3_cannot_hold_is_named():
    vision = dict(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=4, class_token=True, posemb="learn")
    model = dict(connector={"name": "pixel_shuffle", "merge": 2}, vision_layer=-2, lm={"qkv_bias": True})
    problems = hf_idefics3.export_problems(model, vision, {}, [("resize", (16,), {})])
    assert len(problems) == 5 and "class_token=True (needs False)" in problems[0] and "norm=False" in problems[1], \
        problems
    assert "normed output" in problems[2] and "Llama" in problems[3] and "['resize']" in problems[4]


def test_an_imported_idefics3_fine_tunes_with_lora_on_its_tiles_and_chats(imported, tmp_path):
    """``init.checkpoint`` = the imported workdir: the run takes its tiling (``idefics3_tiles``) and
    trains with LoRA on flat sequences of tiles; the tower stays as imported; the run chats."""
    from vitmm import chat

    out, _ = imported
    saved, before, after = finetune_imported(out, tmp_path, {"length": 256, "max_images": 20})
    assert "idefics3_tiles" in saved["input"]["pp"]
    assert np.array_equal(after["tower"]["embedding"]["kernel"], before["tower"]["embedding"]["kernel"])
    assert "lora" in after
    assert isinstance(chat.load(tmp_path / "run").ask(np.zeros((20, 40, 3), np.uint8), "what?", 3), str)
