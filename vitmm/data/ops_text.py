"""The text ops of ``data.preprocess`` (registered there as ``tokenize`` and ``qa_tokens``):
token ids for the towers, and question/answer sequences for the VLM, plain or in an LM's chat
template."""

from __future__ import annotations

import numpy as np

from vitmm.data import chat_render
from vitmm.data import tokenizer as tok_lib


def tokenize(key, max_len, out_key=None, tokenizer=None, add_bos=True, add_eos=True, padding="pad",
             truncation="right"):
    tokenizer = tokenizer or tok_lib.ByteTokenizer()
    out_key = out_key or f"{key}_tokens"

    def fn(ex, rng):
        text = ex[key]
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        result = tok_lib.tokenize(tokenizer, text, max_len, add_bos=add_bos, add_eos=add_eos,
                                  padding=padding, truncation=truncation)
        ex[out_key] = result.ids
        ex[f"{out_key}_truncated"] = np.bool_(result.truncated)
        return ex

    return fn


IMAGE_PLACEHOLDER = chat_render.IMAGE_PLACEHOLDER  # where a chat prompt's visual tokens go (LLaVA's convention)


def qa_tokens(max_len, question_key="question", answer_key="answer", tokenizer=None, separator=" ", chat=False,
              system=None, max_answer=None):
    """A question and its answer as one VLM sequence: ``ids`` (int32 ``[max_len]``, PAD after),
    ``answer_mask`` (1 on the tokens the VLM is trained to produce), ``prompt_len`` (the tokens
    before the answer) and ``qa_truncated``.

    Plain (``chat=False``): ``[BOS] question separator answer [EOS]``; the image goes after BOS
    (``image_pos`` 1).
    A question too long for ``max_len`` is cut from the right so that the whole answer fits.

    ``chat=True``: the tokenizer's chat template (a converted LM's) renders a user turn
    ``"<image>\nquestion"`` (after a ``system`` turn when given) and the assistant's answer,
    tokenized as ``conversation_tokens`` does; the answer mask covers the assistant's answer up to
    and including EOS (the template's end of turn, or the EOS put after an answer the template ends
    bare), ``image_pos`` is where ``<image>`` stood (the visual tokens go there), and the text
    after EOS is dropped. A chat example that does not fit ``max_len`` is an error.

    ``max_answer``: an answer of more tokens (EOS included) is an error (a VLM whose loss reads
    ``model.loss_positions`` answer tokens per example would drop the rest).
    """
    tokenizer = tokenizer or tok_lib.ByteTokenizer()
    fn = _qa_chat(max_len, question_key, answer_key, tokenizer, system) if chat else \
        _qa_plain(max_len, question_key, answer_key, tokenizer, separator)
    if max_answer is None:
        return fn

    def checked(ex, rng):
        ex = fn(ex, rng)
        if ex["answer_mask"].sum() > max_answer:
            raise ValueError(f"qa_tokens: the answer {ex[answer_key]!r} is {int(ex['answer_mask'].sum())} tokens with "
                             f"EOS, more than max_answer={max_answer} (model.loss_positions, the answer tokens the "
                             "loss reads); raise model.loss_positions.")
        return ex

    return checked


def _qa_plain(max_len, question_key, answer_key, tokenizer, separator):

    def fn(ex, rng):
        question = tokenizer.encode(ex[question_key] + separator)
        answer = tokenizer.encode(ex[answer_key]) + [tokenizer.eos_id]
        room = max_len - 1 - len(answer)
        if room < 1:
            raise ValueError(f"qa_tokens: answer {ex[answer_key]!r} does not fit max_len={max_len}.")
        truncated = len(question) > room
        question = question[:room]
        seq = [tokenizer.bos_id] + question + answer
        ids = np.full(max_len, tokenizer.pad_id, np.int32)
        ids[: len(seq)] = seq
        mask = np.zeros(max_len, np.float32)
        mask[1 + len(question): len(seq)] = 1.0
        ex["ids"], ex["answer_mask"] = ids, mask
        ex["prompt_len"], ex["qa_truncated"] = np.int32(1 + len(question)), np.bool_(truncated)
        ex["image_pos"] = np.int32(1)
        return ex

    return fn


def _qa_chat(max_len, question_key, answer_key, tokenizer, system):
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("qa_tokens(chat=True) needs a tokenizer with a chat template: set init.lm to a converted "
                         "LM (`python -m vitmm.interop --from hf|gguf`), whose tokenizer and template the run uses.")
    head = [{"role": "system", "content": system}] if system else []

    def fn(ex, rng):
        user = head + [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}\n{ex[question_key]}"}]
        prompt = tokenizer.chat(user, add_generation_prompt=True)
        messages = user + [{"role": "assistant", "content": ex[answer_key]}]
        full = tokenizer.chat(messages)
        if IMAGE_PLACEHOLDER in str(ex[answer_key]):  # (its token would be vitmm's own, past the LM's vocabulary)
            from vitmm.data.skips import BadExample

            raise BadExample("image_tag_mismatch", f"an {IMAGE_PLACEHOLDER} tag in the answer {ex[answer_key]!r}")
        if not full.startswith(prompt) or prompt.count(IMAGE_PLACEHOLDER) != 1:
            raise ValueError("qa_tokens(chat=True): the chat template must render the prompt as a prefix of the whole "
                             f"exchange with one {IMAGE_PLACEHOLDER}; got {prompt!r} and {full!r}.")
        # conversation_tokens' rule: the whole exchange tokenized at once, EOS after an answer the template ends bare
        segments = chat_render.chat_segments(messages, tokenizer, None)
        seq, mask, image_at = chat_render.assemble(segments, tokenizer, "qa_tokens(chat=True)")
        prompt_len, end = mask.index(1), len(mask) - mask[::-1].index(1)  # the text after the answer's EOS is dropped
        seq = seq[:end]
        if not image_at[0]:
            raise ValueError("qa_tokens(chat=True): the chat template puts no token before <image>.")
        if len(seq) > max_len:
            raise ValueError(f"qa_tokens(chat=True): the exchange is {len(seq)} tokens, more than max_len={max_len}; "
                             "raise model.max_len.")
        ids = np.full(max_len, tokenizer.pad_id, np.int32)
        ids[: len(seq)] = seq
        answer = np.zeros(max_len, np.float32)
        answer[prompt_len:end] = 1.0
        ex["ids"], ex["answer_mask"], ex["image_pos"] = ids, answer, np.int32(image_at[0])
        ex["prompt_len"], ex["qa_truncated"] = np.int32(prompt_len), np.bool_(False)
        return ex

    return fn


# ----------------------------------------------------------------------------------------------
#                                    Multi-turn conversations
# ----------------------------------------------------------------------------------------------
OVERFLOWS = ("truncate_turns", "skip")


def conversation_tokens(max_len, tokenizer=None, template="auto", overflow="truncate_turns", max_answer=None,
                        separator=" ", image_text=IMAGE_PLACEHOLDER):
    """A LLaVA-style conversation (``conversations``: ``[{"from": "human" | "gpt" | "system",
    "value"}]``) as one VLM sequence: ``ids`` (int32 ``[max_len]``, PAD after), ``answer_mask`` (1 on
    every assistant turn's tokens up to and including its EOS), ``prompt_len`` (the tokens before the
    first answer), ``image_pos`` (where ``<image>`` stood; 1 for a text-only example, whose visual
    tokens the VLM masks out through ``has_image``).

    ``template``: ``"chat"`` renders the turns with the LM's chat template (a system turn kept), as
    transformers' ``apply_chat_template`` does; ``"plain"``: ``[BOS] (system\\n) user separator
    answer [EOS] user separator answer [EOS] …``; ``"auto"``: chat when the tokenizer has a template.
    With several images (``num_images`` > 1), ``image_positions`` holds each ``<image>``'s place
    (``image_pos`` the first's); only ``data.sequences`` (``input.sequences``) trains on them.
    ``image_text``: what each ``<image>`` tag becomes after the turns are rendered (as a processor
    expands the chat template's text), the visual tokens going where its own ``<image>`` stands
    (Qwen2-VL's ``'<|vision_start|><image><|vision_end|>'``); an example's ``image_texts`` (one a
    tag, e.g. ``idefics3_tiles``'s for its tiles) come first, each ``<image>`` in them then an image.
    A video's frames (``video_frames`` consecutive tags, ``decode``'s) are wrapped once, as one group:
    Qwen2-VL puts a video in one ``<|vision_start|>…<|vision_end|>``, and its M-RoPE positions
    (``data.sequences.mrope_positions``) need the video's visual tokens together.

    ``overflow`` (a sequence longer than ``max_len`` text tokens, or with more than ``max_answer``
    answer tokens): ``"truncate_turns"`` drops whole user/assistant exchanges from the end until it
    fits (``_truncated`` counts the dropped ones) and skips the example (``too_long``) when even the
    first does not fit or the image's turn would go; ``"skip"`` skips it. The visual tokens are
    never cut and an answer is never cut short.

    An example with ``add_generation_prompt`` set is a prompt for the reply to its final user turn
    (``vitmm.chat``, ``vitmm.serve``): the turns rendered as transformers' generation prompt
    (``add_generation_prompt=True``; the plain layout ends with the user's ``separator``),
    ``prompt_len`` all of it, no answer; one over ``max_len`` is ``too_long``, never cut. With
    ``reply_as_trained`` also set (a run trained here), the earlier exchanges are rendered as
    training renders them (EOS after an answer the template ends bare, llava-hf's), unless the
    template renders them anew once the conversation goes on (Qwen3's): then as transformers' prompt.

    Bad conversations (empty, unknown roles, turns that do not alternate, a number of ``<image>``
    tags other than ``num_images``) raise ``skips.BadExample``.
    """
    from vitmm.data.skips import BadExample

    tokenizer = tokenizer or tok_lib.ByteTokenizer()
    if overflow not in OVERFLOWS:
        raise ValueError(f"conversation_tokens overflow={overflow!r}; choose one of {OVERFLOWS}.")
    if template not in ("auto", "chat", "plain"):
        raise ValueError(f"conversation_tokens template={template!r}; choose 'auto', 'chat' or 'plain'.")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has_template:
        raise ValueError("conversation_tokens(template='chat') needs a tokenizer with a chat template: set init.lm to "
                         "a converted LM (`python -m vitmm.interop --from hf|gguf`).")
    chat = template == "chat" or (template == "auto" and has_template)
    render = chat_render.chat_segments if chat else chat_render.plain_segments
    if image_text.count(IMAGE_PLACEHOLDER) != 1:
        raise ValueError(f"conversation_tokens image_text={image_text!r} must hold {IMAGE_PLACEHOLDER} once (where "
                         "the visual tokens go).")

    def fn(ex, rng):
        reply = bool(ex.get("add_generation_prompt"))
        messages = chat_render.conversation_messages(ex["conversations"], reply)
        num_images = int(ex.get("num_images", 0))
        tags = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if tags != num_images:
            raise BadExample("image_tag_mismatch", f"{tags} {IMAGE_PLACEHOLDER} tag(s) for {num_images} image(s)")
        if any(IMAGE_PLACEHOLDER in m["content"] for m in messages if m["role"] != "user"):
            raise BadExample("image_tag_mismatch", f"an {IMAGE_PLACEHOLDER} tag outside a user turn")
        texts = [t.replace(IMAGE_PLACEHOLDER, image_text) for t in ex.get("image_texts", [IMAGE_PLACEHOLDER] * tags)]
        if int(ex.get("video_frames", 0)) == tags > 0 and "image_texts" not in ex:  # a video: one group
            before, after = image_text.split(IMAGE_PLACEHOLDER)
            texts = [IMAGE_PLACEHOLDER] * tags
            texts[0], texts[-1] = before + texts[0], texts[-1] + after
        if reply:
            segments = chat_render.reply_segments(messages, tokenizer, bool(ex.get("reply_as_trained"))) if chat else \
                chat_render.plain_segments(messages, tokenizer, separator)
            ids, _, image_at = chat_render.assemble(_expand_images(segments, texts), tokenizer)
            if len(ids) > max_len:
                raise BadExample("too_long", f"{len(ids)} prompt tokens with max_len={max_len}")
            return _written(ex, ids, [0] * len(ids), image_at, max_len, tokenizer, len(ids), 0)
        head = 1 if messages[0]["role"] == "system" else 0
        exchanges = keep = (len(messages) - head) // 2
        while True:
            kept = messages[: head + 2 * keep]
            segments = _expand_images(render(kept, tokenizer, separator), texts)
            ids, mask, image_at = chat_render.assemble(segments, tokenizer)
            if len(ids) <= max_len and (max_answer is None or sum(mask) <= max_answer):
                break
            keep -= 1
            if overflow == "skip" or keep == 0 or \
                    sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages[: head + 2 * keep]) < tags:
                raise BadExample("too_long", f"{len(ids)} text tokens with max_len={max_len}"
                                 + (f", {sum(mask)} answer tokens with max_answer={max_answer}" if max_answer else ""))
        return _written(ex, ids, mask, image_at, max_len, tokenizer, mask.index(1), exchanges - keep)

    return fn


def _written(ex, ids, mask, image_at, max_len, tokenizer, prompt_len, truncated) -> dict:
    """``ex`` with a conversation's ``ids`` and ``answer_mask`` padded to ``max_len``, its
    ``prompt_len``, where its images go and how many exchanges were dropped."""
    out = np.full(max_len, tokenizer.pad_id, np.int32)
    out[: len(ids)] = ids
    answer = np.zeros(max_len, np.float32)
    answer[: len(mask)] = mask
    ex["ids"], ex["answer_mask"], ex["prompt_len"] = out, answer, np.int32(prompt_len)
    ex["image_pos"] = np.int32(image_at[0] if image_at else 1)
    ex["has_image"] = np.bool_(bool(image_at))
    if len(image_at) > 1:  # several images: where each goes (``data.sequences`` reads them)
        ex["image_positions"] = np.asarray(image_at, np.int32)
    ex["_truncated"] = truncated
    return ex


def _expand_images(segments, texts: list[str]) -> list[tuple[str, str]]:
    """``segments`` with the k-th ``<image>`` of their text replaced by ``texts[k]`` (one the template
    wrote itself, past the turns' own, as PaliGemma's does, stays as it is)."""
    out, k = [], 0
    for kind, text in segments:
        if kind == "text" and IMAGE_PLACEHOLDER in text:
            pieces = text.split(IMAGE_PLACEHOLDER)
            text = pieces[0] + "".join((texts[k + i] if k + i < len(texts) else IMAGE_PLACEHOLDER) + piece
                                       for i, piece in enumerate(pieces[1:]))
            k += len(pieces) - 1
        out.append((kind, text))
    return out
