"""Multi-turn conversations as one VLM sequence: token ids and the assistant-turn mask against
transformers' ``apply_chat_template`` outputs (stored in ``tests/fixtures/data/conversations.json``
by ``make_conversations.py``), the plain layout, the truncation rule and the bad cases; and a
text-only example through the VLM equals the LM alone."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.data import preprocess, skips
from vitmm.data import tokenizer as tok_lib
from vitmm.data.chat_render import conversation_messages

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
HF = json.loads((FIXTURES / "data/conversations.json").read_text())
LLAVA_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny GGUF's tokenizer, converted as `python -m vitmm.interop --from gguf` does."""
    from vitmm.interop import gguf_lm

    _, _, tokenizer, _ = gguf_lm.load(FIXTURES / "interop/gguf_llama/tiny.gguf")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    return tok_lib.get_tokenizer(str(path), bos_id=HF["bos_id"], eos_id=HF["eos_id"], pad_id=HF["pad_id"])


def _llava(messages):
    return [{"from": LLAVA_ROLES[m["role"]], "value": m["content"]} for m in messages]


@pytest.mark.parametrize("case", HF["cases"], ids=lambda c: f"{c['template']}-{len(c['messages'])}-{len(c['text'])}")
def test_conversations_tokenize_as_transformers_with_the_image_where_its_token_was(case, tiny_tokenizer):
    tiny_tokenizer.chat_template = HF["templates"][case["template"]]
    reference, mask = np.array(case["input_ids"]), np.array(case["assistant_masks"])
    image = reference == HF["image_token_id"]
    fn = preprocess.parse("conversation_tokens(256)", tiny_tokenizer)
    ex = fn({"conversations": _llava(case["messages"]), "num_images": int(image.sum())}, None)
    n = int((~image).sum())
    np.testing.assert_array_equal(ex["ids"][:n], reference[~image])
    np.testing.assert_array_equal(ex["answer_mask"][:n], mask[~image])  # every assistant turn, with its EOS
    assert (ex["ids"][n:] == HF["pad_id"]).all() and ex["answer_mask"][n:].sum() == 0
    assert bool(ex["has_image"]) == bool(image.any())
    if image.any():
        assert int(ex["image_pos"]) == int(np.argmax(image))  # the visual tokens go where <image> stood
    assert int(ex["prompt_len"]) == int(np.argmax(mask[~image]))  # the tokens before the first answer
    assert ex["_truncated"] == 0


# Qwen3's rule, in brief: only the answers after the last question carry a <think> block, so the
# rendering of a conversation's first exchange is not a prefix of the whole conversation's.
LAST_QUERY_TEMPLATE = """{%- set ns = namespace(last=0) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor -%}
{%- for m in messages -%}
{%- if m.role == 'user' %}<u>{{ m.content }}EOS
{% elif loop.index0 > ns.last %}<a><think></think>{{ m.content }}EOS
{% else %}<a>{{ m.content }}EOS
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<a>{% endif -%}"""


def test_a_template_that_renders_earlier_answers_anew_still_masks_each_answer(tiny_tokenizer):
    """Each answer is found in the one rendering, from its header's end to the EOS after it, nothing
    of the questions (the second question quotes the first answer, which must not be taken for it)."""
    eos = tiny_tokenizer.token(HF["eos_id"])
    tiny_tokenizer.chat_template = LAST_QUERY_TEMPLATE.replace("EOS", eos)
    fn = preprocess.parse("conversation_tokens(256)", tiny_tokenizer)
    turns = [{"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"},
             {"from": "human", "value": "you said red"}, {"from": "gpt", "value": "red"}]
    ex = fn({"conversations": turns, "num_images": 1}, None)
    ids, mask = ex["ids"], ex["answer_mask"] > 0
    spans = np.split(np.flatnonzero(mask), np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    # from the end of the assistant's header, as the one-exchange (prefix) rule takes it: the last answer's
    # think block is trained as it is generated, the earlier answer as the history renders it
    assert [tiny_tokenizer.decode(ids[s[:-1]]).strip() for s in spans] == ["red", "<think></think>red"]
    assert [int(ids[s[-1]]) for s in spans] == [HF["eos_id"]] * 2


def test_a_reply_prompt_is_the_templates_generation_prompt_when_earlier_answers_render_anew(tiny_tokenizer):
    """A multi-turn request to an LM whose template renders earlier answers differently once the
    conversation goes on (Qwen3's rule): its prompt is what the template gives with
    ``add_generation_prompt``, as transformers' generation prompt, earlier answer included."""
    from vitmm.lm_chat import LMChat

    tiny_tokenizer.chat_template = LAST_QUERY_TEMPLATE.replace("EOS", tiny_tokenizer.token(HF["eos_id"]))
    chat = LMChat.__new__(LMChat)
    chat.tokenizer, chat._tokens = tiny_tokenizer, preprocess.parse("conversation_tokens(256)", tiny_tokenizer)
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
             {"from": "gpt", "value": "hello"}, {"from": "human", "value": "again"}]
    example = chat.prepare([], turns)
    prompt = tiny_tokenizer.chat(conversation_messages(turns, reply=True), add_generation_prompt=True)
    assert prompt.endswith("<u>again" + tiny_tokenizer.token(HF["eos_id"]) + "\n<a>") and "<a>hello" in prompt
    assert list(example["ids"][: int(example["prompt_len"])]) == tiny_tokenizer.encode(prompt)
    with pytest.raises(ValueError, match=r"^The conversation is too long for this model \(\d+ prompt tokens with "
                                         r"max_len=8\); send fewer earlier turns or a shorter question\.$"):
        chat._tokens = preprocess.parse("conversation_tokens(8)", tiny_tokenizer)
        chat.prepare([], turns)


def _scene_conversation(exchanges: int, image: bool = True):
    turns = []
    for i in range(exchanges):
        question = ("<image>\n" if image and i == 0 else "") + f"question {i}?"
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": f"answer number {i}"}]
    return turns


def test_plain_layout_puts_bos_then_turns_with_eos_after_each_answer():
    tok = tok_lib.ByteTokenizer()
    fn = preprocess.parse("conversation_tokens(96)")
    turns = [{"from": "system", "value": "Be brief."}] + _scene_conversation(2)
    ex = fn({"conversations": turns, "num_images": 1}, None)
    expected = ([tok.bos_id] + tok.encode("Be brief.\n") + tok.encode("\nquestion 0? ") + tok.encode("answer number 0")
                + [tok.eos_id] + tok.encode("question 1? ") + tok.encode("answer number 1") + [tok.eos_id])
    n = len(expected)
    assert ex["ids"][:n].tolist() == expected and (ex["ids"][n:] == tok.pad_id).all()
    assert int(ex["image_pos"]) == 1 + len("Be brief.\n")  # the <image> tag itself has no token
    answer = tok.decode(ex["ids"][ex["answer_mask"] > 0])
    assert answer == "answer number 0answer number 1" and ex["answer_mask"].sum() == 2 * (15 + 1)


def test_too_long_conversations_lose_whole_exchanges_from_the_end_or_are_skipped():
    turns = _scene_conversation(3)
    full = preprocess.parse("conversation_tokens(200)")({"conversations": turns, "num_images": 1}, None)
    length = int((full["ids"] != 0).sum())
    cut = preprocess.parse(f"conversation_tokens({length - 1})")({"conversations": turns, "num_images": 1}, None)
    assert cut["_truncated"] == 1
    last = len("question 2? ") + len("answer number 2") + 1  # the third exchange, EOS included
    assert int((cut["ids"] != 0).sum()) == length - last
    np.testing.assert_array_equal(cut["ids"][:length - last], full["ids"][:length - last])  # two exchanges, intact
    assert tok_lib.ByteTokenizer().decode(cut["ids"][cut["answer_mask"] > 0]) == "answer number 0answer number 1"
    with pytest.raises(skips.BadExample, match="too_long"):
        preprocess.parse(f"conversation_tokens({length - 1}, overflow='skip')")(
            {"conversations": turns, "num_images": 1}, None)
    with pytest.raises(skips.BadExample, match="too_long"):  # not even the first exchange fits
        preprocess.parse("conversation_tokens(20)")({"conversations": turns, "num_images": 1}, None)
    # The image's turn is never dropped: an image in the last exchange cannot be truncated away.
    late = _scene_conversation(3, image=False)
    late[4]["value"] = "<image>\n" + late[4]["value"]
    with pytest.raises(skips.BadExample, match="too_long"):
        preprocess.parse(f"conversation_tokens({length - 1})")({"conversations": late, "num_images": 1}, None)
    capped = preprocess.parse("conversation_tokens(200, max_answer=32)")(
        {"conversations": turns, "num_images": 1}, None)
    assert capped["_truncated"] == 1 and capped["answer_mask"].sum() == 32


@pytest.mark.parametrize("turns, images, reason", [
    ([], 0, "empty_conversation"),
    ([{"from": "gpt", "value": "a"}], 0, "turns_not_alternating"),
    ([{"from": "human", "value": "q"}], 0, "turns_not_alternating"),
    ([{"from": "human", "value": "<image> q"}, {"from": "gpt", "value": "a"}], 0, "image_tag_mismatch"),
    ([{"from": "human", "value": "q"}, {"from": "gpt", "value": "<image>"}], 1, "image_tag_mismatch"),
    ([{"from": "narrator", "value": "q"}, {"from": "gpt", "value": "a"}], 0, "unknown_role"),
    ([{"from": "human", "value": None}, {"from": "gpt", "value": "a"}], 0, "unknown_role"),
])
def test_bad_conversations_are_bad_examples(turns, images, reason):
    with pytest.raises(skips.BadExample, match=reason):
        preprocess.parse("conversation_tokens(64)")({"conversations": turns, "num_images": images}, None)


def test_conversation_settings_fail_clearly():
    with pytest.raises(ValueError, match="overflow='cut'; choose one of"):
        preprocess.parse("conversation_tokens(64, overflow='cut')")
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        preprocess.parse("conversation_tokens(64, template='chat')")
    with pytest.raises(ValueError, match="image_text='<|vision_start|>' must hold <image> once"):
        preprocess.parse("conversation_tokens(64, image_text='<|vision_start|>')")


def test_image_text_wraps_each_image_tag_and_the_visual_tokens_go_inside():
    """``image_text`` (Qwen2-VL's vision markers; a quoted ``|`` does not cut the pp): the tag's text
    around the image, ``image_pos`` between the two."""
    turns = [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "yo"}]
    plain = preprocess.parse("conversation_tokens(64)")({"conversations": turns, "num_images": 1}, None)
    wrapped = preprocess.parse("conversation_tokens(64, image_text='[|<image>|]')")(
        {"conversations": turns, "num_images": 1}, None)
    pos, ids = int(wrapped["image_pos"]), list(wrapped["ids"])
    assert ids[pos - 2:pos] == [ord("[") + 1, ord("|") + 1] and ids[pos:pos + 2] == [ord("|") + 1, ord("]") + 1]
    assert int(wrapped["prompt_len"]) == int(plain["prompt_len"]) + 4


# transformers' VLM chat templates take each turn as content parts: llava-hf's (images first, an
# assistant turn ending with nothing after its text, {% generation %} around it) and SmolVLM's.
LLAVA_HF = ("{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
            "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
            "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
            "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
            "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', "
            "'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
SMOLVLM = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]"
           "['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}"
           "{% if line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
           "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


@pytest.mark.parametrize(("template", "prompt", "answer", "eos"), [
    (LLAVA_HF, ["USER: ", "\nWhat is shown? ASSISTANT:"], " A cat.", True),  # EOS added right after the text
    (SMOLVLM.replace("<end_of_utterance>", "<|im_end|>"),  # the tiny tokenizer's EOS ends each turn
     ["<|im_start|>User:", "What is shown?<|im_end|>\nAssistant:"], " A cat.<|im_end|>\n", False),
])
def test_templates_that_take_content_parts_render_the_turns_as_transformers_parts(tmp_path, template, prompt, answer,
                                                                                    eos):
    """A template that shows no string content gets each turn as parts (``<image>`` an image part,
    the text around it stripped next to it): the rendering of ``[{"type": "image"}, {"type": "text",
    "text": "What is shown?"}]``, the visual tokens where the template put its ``<image>``."""
    from vitmm.interop import gguf_lm

    _, _, tok, _ = gguf_lm.load(FIXTURES / "interop/gguf_llama/tiny.gguf")
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    tokenizer = tok_lib.HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=2, pad_id=2, chat_template=template)
    turns = [{"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "A cat."}]
    ex = preprocess.parse("conversation_tokens(96)", tokenizer)({"conversations": turns, "num_images": 1}, None)
    before, after = (tokenizer.encode(text) for text in prompt)
    n = int(ex["prompt_len"])
    assert int(ex["image_pos"]) == len(before) and list(ex["ids"][:n]) == before + after
    want = tokenizer.encode(answer) + ([tokenizer.eos_id] if eos else [])
    end = want.index(tokenizer.eos_id) + 1  # the answer is learned up to its EOS
    assert list(ex["ids"][n:n + len(want)]) == want and ex["answer_mask"][n:].sum() == end == \
        ex["answer_mask"][n:n + end].sum()


def test_a_reply_prompt_renders_earlier_answers_as_training_did_for_a_run_trained_here(tiny_tokenizer):
    """A template whose assistant turn ends bare (llava-hf's): training puts EOS after each answer, so
    a run trained here is prompted with it after the earlier answers (the training ids up to the last
    answer), while an imported model gets transformers' generation prompt, which has none."""
    from vitmm.lm_chat import reply_prompt

    tiny_tokenizer.chat_template = LLAVA_HF
    pp = preprocess.parse("conversation_tokens(256)", tiny_tokenizer)
    turns = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."},
             {"from": "human", "value": "What colour?"}, {"from": "gpt", "value": "Red."}]
    trained = pp({"conversations": turns, "num_images": 1}, None)
    last_answer = int(np.flatnonzero(np.diff(trained["answer_mask"], prepend=0) > 0)[-1])
    ours = reply_prompt(pp, {"conversations": turns[:3], "num_images": 1}, as_trained=True)
    assert list(ours["ids"][: int(ours["prompt_len"])]) == list(trained["ids"][:last_answer])
    assert int(ours["image_pos"]) == int(trained["image_pos"])
    imported = reply_prompt(pp, {"conversations": turns[:3], "num_images": 1})
    prompt = tiny_tokenizer.chat(conversation_messages(turns[:3], reply=True), add_generation_prompt=True)
    before, after = prompt.split("<image>")
    want = tiny_tokenizer.encode(before) + tiny_tokenizer.encode(after)
    assert list(imported["ids"][: int(imported["prompt_len"])]) == want and tiny_tokenizer.eos_id not in want


def test_a_text_only_example_through_the_vlm_is_the_lm_alone():
    """``has_image=False``: the visual tokens are masked out of attention and positions, so every
    text logit equals the LM's on the text alone (float32, 1e-5)."""
    from vitmm.models import lm as lm_lib
    from vitmm.models import vlm as vlm_lib

    vision = dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=8, pool="gap", class_token=False,
                  posemb="sincos2d")
    lm_kw = dict(vocab_size=259, width=32, depth=2, num_heads=2)
    model = vlm_lib.VLM(vision, {"name": "pool", "budget": 4}, lm_kw)
    ex = preprocess.parse("conversation_tokens(48)")({"conversations": _scene_conversation(1, image=False)}, None)
    ids = jnp.asarray(ex["ids"])[None]
    images = jnp.ones((1, 16, 16, 3))
    variables = model.init(jax.random.key(0), images, ids)
    m = 4
    logits = model.apply(variables, images, ids, image_pos=ex["image_pos"][None],
                         visual_mask=jnp.zeros((1, m), bool))
    text = vlm_lib.text_logits(logits, m, ex["image_pos"][None])
    alone = lm_lib.LM(**lm_kw).apply({"params": variables["params"]["language"]}, ids)
    n = int((ex["ids"] != 0).sum())
    # Position image_pos - 1 (BOS) is predicted by the last visual row, which is padding here; every
    # other text position sees exactly what the LM alone sees.
    rows = [i for i in range(n - 1) if i != int(ex["image_pos"]) - 1]
    np.testing.assert_allclose(np.asarray(text[0, rows]), np.asarray(alone[0, rows]), atol=1e-5, rtol=0)
    assert ex["answer_mask"][int(ex["image_pos"])] == 0  # that position never carries the loss


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_answer_is_learned_up_to_any_end_of_turn_id_the_lm_stops_at(tmp_path):
    """An instruct LM whose turns end with a token other than its EOS (Llama 3's ``<|eot_id|>``,
    Gemma's ``<end_of_turn>``): conversion records it among ``eos_ids``, the answer is learned up to
    it (and decoding stops at it); a template whose turns end with none of them is refused in one line."""
    from vitmm.interop import gguf_lm

    _, _, tok, _ = gguf_lm.load(FIXTURES / "interop/gguf_llama/tiny.gguf")
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    end_of_turn = tok_lib.HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=2, pad_id=2).encode("<|im_end|>")
    assert end_of_turn == [2]  # the tiny tokenizer's <|im_end|>: here an end of turn, the EOS another id
    turns = [{"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "A cat."}]
    for eos_ids, ok in (([2], True), (None, False)):
        tokenizer = tok_lib.HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=0, pad_id=0,
                                        chat_template=CHATML, eos_ids=eos_ids)
        op = preprocess.parse("conversation_tokens(96)", tokenizer)
        if not ok:
            with pytest.raises(ValueError, match=r"holds none of the ids the LM stops at \[0\]"):
                op({"conversations": turns, "num_images": 1}, None)
            continue
        ex = op({"conversations": turns, "num_images": 1}, None)
        learned = ex["ids"][ex["answer_mask"] > 0].tolist()
        assert learned == tokenizer.encode("A cat.<|im_end|>") and learned[-1] == 2


def _sentencepiece(path, prepend_scheme):
    """A tiny SentencePiece-style ``tokenizer.json`` in the two layouts real checkpoints ship: the
    legacy one (``Prepend('▁')`` + ``Replace(' ', '▁')`` normalizer: Llama 2, Vicuna, Mistral v0.1)
    or a ``Metaspace(prepend_scheme='first')`` pre-tokenizer (Mistral v0.3); either adds a ``▁`` at
    the start of each string it is given. BPE trained on a few phrases (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    corpus = ["A red circle.", "What is in the picture?", "And the square?", "Blue, to the right.", "A cat.",
              "USER: ASSISTANT:", "assistant user system\n"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ["<image>", "<|im_start|>", "<|im_end|>"]])
    spec = json.loads(tok.to_str())
    spec["model"]["vocab"]["▁▁"] = max(spec["model"]["vocab"].values()) + 1
    spec["model"]["merges"].insert(0, ["▁", "▁"])  # Llama's first merge
    if prepend_scheme == "legacy":
        spec["pre_tokenizer"] = None
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    else:
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend_scheme,
                                 "split": False}
    path.write_text(json.dumps(spec))
    return path


CHATML_TIGHT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # no newline between turns
INST = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
        "{% elif m.role == 'assistant' %}{{ ' ' + m.content + eos_token }}{% endif %}{% endfor %}")
# transformers' apply_chat_template(tokenize=True, return_assistant_tokens_mask=True) with {% generation %}
# around each assistant turn, on these tokenizers (<image> an added token, its id taken out): the pieces
# and the trained ones
SENTENCEPIECE_HF = {
    ("legacy", "chatml"): (
        "<|im_start|> ▁user \n <unk> o o <unk> : ▁ ▁ \n Wh at ▁is ▁in ▁the ▁picture? <|im_end|> <|im_start|> "
        "▁assistant \n A ▁red ▁circle. <|im_end|>", "A ▁red ▁circle. <|im_end|>", 9),
    ("legacy", "inst"): (
        "<s> ▁ <unk> I N S T <unk> ▁ <unk> o o <unk> : ▁ ▁ \n Wh at ▁is ▁in ▁the ▁picture? ▁ <unk> <unk> I N S T "
        "<unk> ▁A ▁red ▁circle. </s>", "▁A ▁red ▁circle. </s>", 15),
    ("first", "chatml"): (
        "<|im_start|> user \n <unk> o o <unk> : ▁ \n Wh at ▁is ▁in ▁the ▁picture? <|im_end|> <|im_start|> as "
        "sistan t \n A ▁red ▁circle. <|im_end|>", "A ▁red ▁circle. <|im_end|>", 9),
    ("first", "inst"): (
        "<s> <unk> I N S T <unk> ▁ <unk> o o <unk> : ▁ \n Wh at ▁is ▁in ▁the ▁picture? ▁ <unk> <unk> I N S T "
        "<unk> ▁A ▁red ▁circle. </s>", "▁A ▁red ▁circle. </s>", 14),
}


@pytest.mark.parametrize("layout, template", list(SENTENCEPIECE_HF),
                         ids=[f"{layout}-{template}" for layout, template in SENTENCEPIECE_HF])
def test_a_sentencepiece_lm_gets_transformers_ids_and_mask_with_no_extra_leading_piece(tmp_path, layout, template):
    """The whole rendering is tokenized at once, as transformers does: tokenized apart, each answer
    (and the text after ``<image>``) would start with a ``▁`` that the LM never produces there."""
    eos = "<|im_end|>" if template == "chatml" else "</s>"
    path = _sentencepiece(tmp_path / "tokenizer.json", layout)
    tokenizer = tok_lib.HFTokenizer(path, bos_id=1, pad_id=0, eos_id=tok_lib.HFTokenizer(path).token_id(eos),
                                    chat_template=CHATML_TIGHT if template == "chatml" else INST)
    turns = [{"from": "human", "value": "Look: <image>\nWhat is in the picture?"},
             {"from": "gpt", "value": "A red circle."}]
    ex = preprocess.parse("conversation_tokens(64)", tokenizer)({"conversations": turns, "num_images": 1}, None)
    pieces, trained, image_pos = SENTENCEPIECE_HF[layout, template]
    n = len(pieces.split(" "))
    assert [tokenizer.token(i) for i in ex["ids"][:n]] == pieces.split(" ") and (ex["ids"][n:] == 0).all()
    assert [tokenizer.token(i) for i in ex["ids"][ex["answer_mask"] > 0]] == trained.split(" ")
    assert ex["answer_mask"][n - len(trained.split(" ")):n].all() and int(ex["image_pos"]) == image_pos
    qa = preprocess.parse("qa_tokens(64, chat=True)", tokenizer)(  # the same rule, one exchange
        {"question": "What is in the picture?", "answer": "A red circle."}, None)
    answer = [tokenizer.token(i) for i in qa["ids"][qa["answer_mask"] > 0]]
    assert answer == trained.split(" ") and qa["answer_mask"][int(qa["prompt_len"])] == 1


MISTRAL_V3 = """{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- endif %}
{%- endfor %}"""


def test_an_answer_found_in_a_rerendered_conversation_starts_at_the_templates_space_before_it(tiny_tokenizer):
    """Mistral v0.3's template writes the system turn into the last user turn, so a conversation with
    one takes the located path; its answer is ``' ' + answer + EOS``, trained with the space, as
    transformers' mask (``{% generation %}`` around it) and the prefix rule (no system turn) have it."""
    tiny_tokenizer.chat_template = MISTRAL_V3
    turns = [{"from": "human", "value": "<image>\nWhat is in the picture?"}, {"from": "gpt", "value": "A red circle."}]
    fn = preprocess.parse("conversation_tokens(128)", tiny_tokenizer)
    want = tiny_tokenizer.encode(" A red circle.") + [HF["eos_id"]]
    for head in ([], [{"from": "system", "value": "Be brief."}]):
        ex = fn({"conversations": head + turns, "num_images": 1}, None)
        assert ex["ids"][ex["answer_mask"] > 0].tolist() == want


def test_a_rerendered_conversation_finds_answers_ending_with_any_end_of_turn_id(tmp_path):
    """An LM whose turns end with an id other than its EOS (Llama 3's ``<|eot_id|>``), with a
    template that renders earlier turns anew (Qwen3's rule): every exchange is found, up to that id."""
    from vitmm.interop import gguf_lm

    _, _, tok, _ = gguf_lm.load(FIXTURES / "interop/gguf_llama/tiny.gguf")
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    tokenizer = tok_lib.HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=0, pad_id=0, eos_ids=[2],
                                    chat_template=LAST_QUERY_TEMPLATE.replace("EOS", "<|im_end|>"))
    turns = [{"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"},
             {"from": "human", "value": "and now?"}, {"from": "gpt", "value": "blue"}]
    ex = preprocess.parse("conversation_tokens(256)", tokenizer)({"conversations": turns, "num_images": 1}, None)
    want = tokenizer.encode("red<|im_end|>") + tokenizer.encode("<think></think>blue<|im_end|>")
    assert ex["ids"][ex["answer_mask"] > 0].tolist() == want and want.count(2) == 2


def test_chat_qa_tokens_end_a_bare_assistant_turn_with_eos_as_conversations_do(tiny_tokenizer):
    """llava-hf's template leaves the assistant turn bare: qa_tokens(chat=True) trains ``answer EOS``
    as conversation_tokens does (it was refused, with advice to convert the LM again)."""
    tiny_tokenizer.chat_template = LLAVA_HF
    fn = preprocess.parse("qa_tokens(64, chat=True)", tiny_tokenizer)
    ex = fn({"question": "What is shown?", "answer": "A cat."}, None)
    n = int(ex["prompt_len"])
    want = tiny_tokenizer.encode(" A cat.") + [tiny_tokenizer.eos_id]
    assert ex["ids"][ex["answer_mask"] > 0].tolist() == want and ex["answer_mask"][n:n + len(want)].all()
    prompt = tiny_tokenizer.encode("USER: ") + tiny_tokenizer.encode("\nWhat is shown? ASSISTANT:")
    assert ex["ids"][:n].tolist() == prompt and int(ex["image_pos"]) == len(tiny_tokenizer.encode("USER: "))
    with pytest.raises(skips.BadExample, match="image_tag_mismatch: an <image> tag in the answer"):
        fn({"question": "What is shown?", "answer": "A <image> cat."}, None)  # never vitmm's own token as an id
