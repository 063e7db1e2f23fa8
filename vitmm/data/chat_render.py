"""A conversation as the segments its chat template (or the plain format) renders — prompt text, each
answer, each answer's end of turn — and those segments as token ids with the answer mask and the
images' places (``assemble``): what ``data.ops_text``'s ``qa_tokens`` and ``conversation_tokens``
train on, and the prompt ``vitmm.chat`` and ``vitmm.serve`` generate from."""

from __future__ import annotations

IMAGE_PLACEHOLDER = "<image>"  # where a chat prompt's visual tokens go (LLaVA's convention)

def conversation_messages(turns, reply: bool = False) -> list[dict]:
    """``[{"role", "content"}]`` from LLaVA's turns, checked: an optional system turn, then user and
    assistant alternating, starting with the user and ending with the assistant (``reply``: with the
    user, whose turn is to be answered)."""
    from vitmm.data.skips import BadExample

    if not isinstance(turns, list) or not turns:
        raise BadExample("empty_conversation")
    messages = []
    for turn in turns:
        role = ROLES.get(turn.get("from", turn.get("role")) if isinstance(turn, dict) else None)
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            raise BadExample("unknown_role", f"turn {turn!r}"[:120])
        messages.append({"role": role, "content": content})
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles[0] == "system" else roles
    if not body or len(body) % 2 != reply or any(r != ("user", "assistant")[i % 2] for i, r in enumerate(body)):
        raise BadExample("turns_not_alternating", "/".join(roles))
    return messages


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def reply_segments(messages, tokenizer, as_trained: bool) -> list[tuple[str, str]]:
    """The generation prompt for ``messages`` (ending with a user turn) as segments: one text, or
    (``as_trained``) the earlier exchanges as ``chat_segments`` renders them for training, then the
    rest of the prompt, when the earlier exchanges' rendering is a prefix of the prompt's."""
    prompt = tokenizer.chat(messages, add_generation_prompt=True)
    if not as_trained or not any(m["role"] == "assistant" for m in messages):
        return [("text", prompt)]
    earlier = tokenizer.chat(messages[:-1])
    if not prompt.startswith(earlier):
        return [("text", prompt)]
    return chat_segments(messages[:-1], tokenizer, None) + [("text", prompt[len(earlier):])]


def chat_segments(messages, tokenizer, separator) -> list[tuple[str, str]]:
    """``[(kind, text)]``, kind ``text``, ``answer`` or ``answer_eos``, whose concatenation is the chat
    template's rendering of ``messages``; each answer segment runs from the end of the generation
    prompt to the end of that assistant turn."""
    del separator
    full = tokenizer.chat(messages)
    segments, at = [], 0
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.chat(messages[:j], add_generation_prompt=True)
        upto = tokenizer.chat(messages[: j + 1])
        if not (full.startswith(upto) and upto.startswith(prompt) and len(prompt) >= at):
            return _located_segments(messages, tokenizer, full)
        answer, content = full[len(prompt):len(upto)], message["content"].strip()
        segments.append(("text", full[at:len(prompt)]))
        if answer.rstrip().endswith(content):
            # A template that ends an assistant turn with nothing after its text (llava-hf's) gets EOS
            # right after the text, as LLaVA's own conversation format has it (``answer</s>``; what the
            # template writes after it, a separator, is the prompt's); one with an end marker keeps its own.
            cut = len(answer.rstrip())
            segments += [("answer_eos", answer[:cut]), ("text", answer[cut:])]
        else:
            segments.append(("answer", answer))
        at = len(upto)
    segments.append(("text", full[at:]))
    return segments


def _located_segments(messages, tokenizer, full: str) -> list[tuple[str, str]]:
    """``chat_segments`` for a template that renders a conversation's earlier turns differently
    once it goes on (Qwen3's: only the answer after the last question carries its ``<think>``
    block), so a prefix's rendering is not a prefix of the whole: each answer is found in the one
    rendering, as the text before the first end-of-turn (EOS) token that follows it."""
    from vitmm.data.skips import BadExample

    ends = [tokenizer.token(i) for i in getattr(tokenizer, "eos_ids", (tokenizer.eos_id,))]

    def next_end(after: int) -> tuple[int, str]:
        """Where the first end-of-turn text (of any id the LM stops at) at or after ``after`` is, and which."""
        found = [(full.find(end, after), end) for end in ends]
        return min(((i, end) for i, end in found if i >= 0), default=(-1, ends[0]))

    segments, at, read = [], 0, 0  # read: past the last turn found (a question may quote an answer)
    for j, message in enumerate(messages):
        content = message["content"].strip()
        if message["role"] != "assistant":
            found = full.find(content, read) if content else -1
            read = read if found < 0 else found + len(content)
            continue
        content = content.split("</think>")[-1].strip()  # a template may drop a reasoning block it was given
        before = tokenizer.chat(messages[:j])  # the assistant's header: e.g. "<|im_start|>assistant\n"
        header = tokenizer.chat(messages[:j], add_generation_prompt=True)[len(before):]
        stop, end = next_end(read)
        while stop >= 0 and not (content and full[:stop].rstrip().endswith(content)
                                 and full[:stop].rstrip().rindex(content) >= read):
            stop, end = next_end(stop + len(end))
        if stop < 0:
            raise BadExample("answer_not_rendered", f"the chat template does not render the answer {content[:60]!r} "
                                                    f"before an end-of-turn (any of {ends})")
        start = full[:stop].rstrip().rindex(content)
        opened = full.rfind(header, read, start) if header else -1
        if opened >= 0:  # from the end of the assistant's header, as the prefix rule takes it (a think block too)
            start = opened + len(header)
        else:  # from the whitespace the template writes before the text (Mistral's "[/INST] " + answer), as the
            while start > read and full[start - 1].isspace():  # prefix rule takes it from the prompt's end
                start -= 1
        segments += [("text", full[at:start]), ("answer", full[start:stop + len(end)])]
        at = read = stop + len(end)
    segments.append(("text", full[at:]))
    return segments


def plain_segments(messages, tokenizer, separator) -> list[tuple[str, str]]:
    segments = [("bos", "")]
    for message in messages:
        if message["role"] == "system":
            segments.append(("text", message["content"] + "\n"))
        elif message["role"] == "user":
            segments.append(("text", message["content"] + separator))
        else:
            segments.append(("answer_eos", message["content"]))
    return segments


def answer_end(answer: list[int], tokenizer, op: str, text: str) -> int:
    """Where an assistant turn's learned tokens end: after its first end-of-turn id (the EOS, or
    another the LM stops at, e.g. Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``:
    ``tokenizer.eos_ids``, which decoding stops at too)."""
    ends = tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
    at = next((i for i, t in enumerate(answer) if t in ends), None)
    if at is None:
        raise ValueError(f"{op}: the assistant's turn {text!r} holds none of the ids the LM stops at {list(ends)}; "
                         "convert the LM again (python -m vitmm.interop) so that its generation_config.json's or "
                         "GGUF's end-of-turn ids are recorded.")
    return at + 1


def assemble(segments, tokenizer, op="conversation_tokens") -> tuple[list[int], list[int], list[int]]:
    """Token ids, the answer mask and each image's token index from ``segments``; each ``<image>``
    stands where its visual tokens go (no token for the tag itself), an ``answer_eos`` segment gets
    the EOS right after it. A tokenizer that gives offsets (``tokenizer.json``'s) tokenizes the text
    between BOS segments at once, as transformers' ``apply_chat_template`` does, and an answer is
    the tokens that overlap its characters (a SentencePiece LM's pieces tokenized apart would
    each start with a ``▁``); the others (bytes, words) tokenize each segment on its own."""
    if not hasattr(tokenizer, "encode_offsets"):
        return _assemble_apart(segments, tokenizer, op)
    ids, mask, image_at, run = [], [], [], []
    for kind, text in [*segments, ("bos", None)]:
        if kind != "bos":
            run.append((kind, text))
            continue
        if run:  # the text since the last BOS: tokenized at once
            _assemble_at_once(run, tokenizer, op, ids, mask, image_at)
        if text is not None:
            ids.append(tokenizer.bos_id)
            mask.append(0)
        run = []
    return ids, mask, image_at


def _assemble_at_once(segments, tokenizer, op, ids, mask, image_at):
    """``assemble`` for segments with no BOS among them, appended to ``ids``, ``mask`` and
    ``image_at``: one string tokenized with ``<image>`` and the EOS as tokens of their own."""
    eos = tokenizer.token(tokenizer.eos_id)
    full, images, answers = "", set(), []
    for kind, text in segments:
        if kind == "text":
            at = text.find(IMAGE_PLACEHOLDER)
            while at >= 0:
                images.add(len(full) + at)
                at = text.find(IMAGE_PLACEHOLDER, at + 1)
        else:
            answers.append((len(full), len(full) + len(text) + (len(eos) if kind == "answer_eos" else 0), text))
        full += text + (eos if kind == "answer_eos" else "")
    tokens, offsets = tokenizer.encode_offsets(full, (IMAGE_PLACEHOLDER, eos))
    answer_tokens = [[] for _ in answers]  # each answer's indices in ids
    k = 0
    for token, (start, end) in zip(tokens, offsets, strict=True):
        if start in images and end == start + len(IMAGE_PLACEHOLDER):
            image_at.append(len(ids))
            continue
        while k < len(answers) and start >= answers[k][1]:
            k += 1
        if k < len(answers) and max(start + 1, end) > answers[k][0]:  # overlaps it (a prepended ▁ has no width)
            answer_tokens[k].append(len(ids))
        ids.append(token)
        mask.append(0)
    for at, (_, _, text) in zip(answer_tokens, answers, strict=True):
        for i in at[: answer_end([ids[i] for i in at], tokenizer, op, text)]:
            mask[i] = 1


def _assemble_apart(segments, tokenizer, op) -> tuple[list[int], list[int], list[int]]:
    """``assemble`` for a tokenizer without offsets: each segment (and each piece of one around
    ``<image>``) tokenized on its own."""
    ids, mask, image_at = [], [], []
    for kind, text in segments:
        if kind == "bos":
            ids.append(tokenizer.bos_id)
            mask.append(0)
            continue
        if kind == "text":
            for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
                if i:
                    image_at.append(len(ids))
                piece_ids = tokenizer.encode(piece) if piece else []
                ids += piece_ids
                mask += [0] * len(piece_ids)
            continue
        answer = tokenizer.encode(text) if text else []
        if kind == "answer_eos":
            answer.append(tokenizer.eos_id)
        end = answer_end(answer, tokenizer, op, text)
        ids += answer
        mask += [1] * end + [0] * (len(answer) - end)
    return ids, mask, image_at  # [0, …]: the image first, before BOS (PaliGemma's layout)
