"""PaliGemma (``tests/fixtures/interop/hf_paligemma``, written by ``make_fixtures.py --only vlm``)
imported into a vitmm VLM workdir: the processor's pixels and ids, the logits (≤ 1e-5 of the
largest) and the greedy answers equal transformers'; ``vitmm.serve`` and ``vitmm.chat`` prompt it as
the processor does; an export reads back to the same parameters."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import asked_example, import_hf, served_example

from vitmm.interop import vlm as hf_vlm

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/hf_paligemma"
IMAGE_TOKEN = 320  # the fixture tokenizer's <image>


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_hf(FIXTURE, tmp_path_factory)


def test_paligemma_gives_transformers_pixels_ids_logits_and_greedy_answers(imported):
    """SigLIP's normed output, the linear projector, Gemma; the image first, then BOS, the prompt and
    a newline, attended both ways (``prefix_lm``) as the processor's ``token_type_ids`` make
    transformers attend; logits ≤ 1e-5 of the largest (its positions start at 1, vitmm's at 0: RoPE
    sees the same offsets), the same greedy answers."""
    _, vlm = imported
    ref = np.load(FIXTURE / "io.npz")
    assert vlm.config.model.prefix_lm and vlm.config.model.connector.name == "linear"
    for i, prompt in enumerate(json.loads((FIXTURE / "prompts.json").read_text())):
        example = vlm.prepare([ref[f"image_{i}"]], [{"from": "human", "value": prompt}])
        np.testing.assert_allclose(example["image"], ref[f"pixel_values_{i}"][0].transpose(1, 2, 0), atol=1e-6)
        n, hf_ids = int(example["prompt_len"]), ref[f"input_ids_{i}"][0]
        image = hf_ids == IMAGE_TOKEN
        assert int(example["image_pos"]) == 0 and image[:16].all() and image.sum() == 16  # the image first
        assert list(example["ids"][:n]) == list(hf_ids[16:]) and (ref[f"token_type_ids_{i}"] == 0).all()
        logits = np.asarray(vlm.task.model.apply({"params": vlm.params}, jnp.asarray(example["image"][None]),
                                                 jnp.asarray(example["ids"][None, :n]), prompt_len=jnp.array([n]),
                                                 prefix_lm=True, image_pos=jnp.array([0])))
        want = ref[f"logits_{i}"][0]
        assert np.abs(logits[0] - want).max() <= 1e-5 * np.abs(want).max()
        assert list(vlm.generate(example, 6)) == list(ref[f"answer_{i}"])
    # no image sent: the template still writes its <image> (the black stand-in goes there), as it always has one
    example = vlm.prepare([], [{"from": "human", "value": "caption en"}])
    assert int(example["image_pos"]) == 0 and len(list(vlm.generate(example, 2))) == 2


def test_serve_and_chat_give_the_processors_prompt_with_no_newline_before_the_task_prefix(imported, monkeypatch):
    """An ``image_url`` part and the task prefix as a ``text`` part, in either order (``vitmm.serve``),
    and ``ask`` (``vitmm.chat --image``): BOS, the prefix and one newline, the processor's ids
    (``caption en`` is sensitive to a newline more)."""
    _, vlm = imported
    ref, prompts = np.load(FIXTURE / "io.npz"), json.loads((FIXTURE / "prompts.json").read_text())
    for i, prompt in enumerate(prompts):
        question, want = prompt.removeprefix("<image>"), list(ref[f"input_ids_{i}"][0][16:])
        for example in (served_example(vlm, [ref[f"image_{i}"]], question),
                        served_example(vlm, [ref[f"image_{i}"]], question, text_first=True),
                        asked_example(vlm, [ref[f"image_{i}"]], question, monkeypatch)):
            assert list(example["ids"][: int(example["prompt_len"])]) == want


def test_paligemma_exports_and_imports_back_to_the_same_parameters(imported, tmp_path, capsys):
    """``--format hf`` on an imported PaliGemma (prefix attention: PaliGemma's layout), read back."""
    from vitmm.export import main as export

    out, vlm = imported
    assert export(["--workdir", str(out), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert "architecture: PaliGemmaForConditionalGeneration" in capsys.readouterr().out
    _, params, _ = hf_vlm.load_paligemma(tmp_path / "hf")
    assert jax.tree.all(jax.tree.map(np.array_equal, params, vlm.params))
