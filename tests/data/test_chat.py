"""Chat templates: rendered as transformers renders them (stored outputs of its
``apply_chat_template``), and VLM prompts built from them with an ``<image>`` placeholder and an
assistant-only answer mask."""

import json
import pathlib

import jinja2
import numpy as np
import pytest

from vitmm.data import preprocess
from vitmm.data import tokenizer as tok_lib

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/gguf_llama"
CHAT = json.loads((FIXTURE / "chat.json").read_text())


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny GGUF's tokenizer, converted as `python -m vitmm.interop --from gguf` does."""
    from vitmm.interop import gguf_lm

    _, _, tokenizer, template = gguf_lm.load(FIXTURE / "tiny.gguf")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    return tok_lib.get_tokenizer(str(path), bos_id=1, eos_id=2, pad_id=2, chat_template=template)


@pytest.mark.parametrize("case", CHAT["cases"], ids=lambda c: f"{c['template']}-{len(c['messages'])}")
def test_chat_templates_render_as_transformers_renders_them(case, tiny_tokenizer):
    tiny_tokenizer.chat_template = CHAT["templates"][case["template"]]
    assert tiny_tokenizer.chat(case["messages"], case["add_generation_prompt"]) == case["text"]


def test_templates_get_transformers_tojson_a_fixed_strftime_now_tools_and_documents():
    """Tools as JSON as transformers writes them (no escaping); a ``strftime_now`` that formats one fixed
    day (Llama 3's default, so its templates render as without one), so a run's tokens are the same
    every day and Mistral-Small-3's unguarded call renders; ``tools`` and ``documents`` None, as
    transformers passes them, so an unguarded ``tools is not none`` takes no tools branch."""
    template = ("{% if strftime_now is defined %}{{ strftime_now('%d %b %Y') }}{% else %}26 Jul 2024{% endif %} "
                "{{ messages[0]['content'] | tojson }}")
    assert tok_lib.render_chat(template, [{"role": "user", "content": "<a & b>"}], False) == '26 Jul 2024 "<a & b>"'
    template = ('{%- set today = strftime_now("%Y-%m-%d") %}{{ today }}{% if tools is not none %}{{ tools | tojson }}'
                "{% endif %}{% if documents is not none %}docs{% endif %}")
    assert tok_lib.render_chat(template, [], False) == "2024-07-26"
    assert tok_lib.render_chat(template, [], False, tools=[{"name": "f"}]).endswith('[{"name": "f"}]')


def test_a_template_can_refuse_a_conversation(tiny_tokenizer):
    tiny_tokenizer.chat_template = CHAT["templates"]["inst"]
    with pytest.raises(jinja2.exceptions.TemplateError, match="Only user and assistant roles"):
        tiny_tokenizer.chat([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])


@pytest.mark.parametrize("template, system", [("chatml", None), ("smollm2", None),
                                              ("smollm2", "Answer with one word.")])
def test_chat_qa_tokens_put_the_image_at_the_placeholder_and_mask_only_the_answer(template, system, tiny_tokenizer):
    tok = tiny_tokenizer
    tok.chat_template = CHAT["templates"][template]
    head = [{"role": "system", "content": system}] if system else []
    case = next(c for c in CHAT["cases"] if c["template"] == template and c["messages"][:len(head)] == head
                and len(c["messages"]) == len(head) + 1 and (system or c["messages"][0]["role"] != "system"))
    before, after = case["text"].split("<image>")  # transformers' rendering of the prompt
    fn = preprocess.parse(f"qa_tokens(128, chat=True, system={system!r})", tok)
    ex = fn({"question": "what colour is the circle?", "answer": "red"}, np.random.default_rng(0))
    p, n = int(ex["image_pos"]), int(ex["prompt_len"])
    assert ex["ids"][:p].tolist() == tok.encode(before)
    assert ex["ids"][p:n].tolist() == tok.encode(after)
    answer = ex["ids"][ex["answer_mask"] > 0].tolist()
    assert answer == tok.encode("red") + [tok.eos_id]  # the answer and the end of the turn, nothing else
    assert ex["answer_mask"][:n].sum() == 0
    assert ex["ids"][n + len(answer):].tolist() == [tok.pad_id] * (128 - n - len(answer))


def test_chat_qa_tokens_fail_clearly(tiny_tokenizer):
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        preprocess.parse("qa_tokens(64, chat=True)", tok_lib.ByteTokenizer())
    tiny_tokenizer.chat_template = CHAT["templates"]["chatml"]
    fn = preprocess.parse("qa_tokens(8, chat=True)", tiny_tokenizer)
    with pytest.raises(ValueError, match="more than max_len=8; raise model.max_len"):
        fn({"question": "what colour is the circle?", "answer": "red"}, np.random.default_rng(0))


def test_normalize_matches_value_range_at_one_half_and_applies_per_channel_statistics():
    image = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, -1)
    half = preprocess.parse("normalize()")({"image": image}, None)["image"]
    np.testing.assert_allclose(half, preprocess.parse("value_range(-1, 1)")({"image": image}, None)["image"],
                               atol=1e-6, rtol=0)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    clip = preprocess.parse(f"normalize({mean}, {std})")({"image": image}, None)["image"]
    assert clip.dtype == np.float32
    np.testing.assert_allclose(clip[3, 5], (53 / 255 - np.array(mean)) / np.array(std), rtol=1e-6)
