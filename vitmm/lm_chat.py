"""A converted language model asked as ``vitmm.chat`` asks a VLM (``LMChat``, what ``vitmm.serve``
serves for an LM folder), and the prompt helpers both share."""

from __future__ import annotations

import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm import decode


class LMChat:
    """A converted language model (a ``python -m vitmm.interop --from hf|gguf`` LM folder) asked
    the way ``Chat`` asks a VLM, text only: the LM's chat template (plain ``[BOS] question``
    without one), the KV-cache generator; what ``vitmm.serve`` serves for an LM folder."""

    max_images = 0
    max_len = 4096  # prompt tokens taken

    def __init__(self, folder, step: int | None = None):
        from vitmm.data import ops_text
        from vitmm.data import tokenizer as tok_lib

        config = ckpt_lib.load_config(folder, step)
        path = f"{folder}/tokenizer.json"
        ids = {k: v for k, v in (config.get("tokens") or {}).items() if v is not None}
        self.tokenizer = tok_lib.get_tokenizer(path, chat_template=config.get("chat_template"), **ids)
        self.params = ckpt_lib.load_params(folder, step)["lm"]
        self.generator = decode.Generator(config["model"]["lm"], self.tokenizer.vocab_size)
        self._tokens = ops_text.conversation_tokens(self.max_len, self.tokenizer)

    def prepare(self, images: list, turns: list[dict]) -> dict:
        """The prompt's ``ids`` and ``prompt_len`` for LLaVA-style text ``turns`` ending with a user
        turn (system turns and earlier answers kept); ``ValueError`` for images or a bad conversation."""
        if images or any("<image>" in t["value"] for t in turns):
            raise ValueError("This is a language model: it takes no images.")
        if not turns or turns[-1]["from"] != "human":
            raise ValueError("The conversation must end with a user turn.")
        out = reply_prompt(self._tokens, {"conversations": turns})
        return {"ids": out["ids"], "prompt_len": out["prompt_len"]}

    def num_prompt_tokens(self, example: dict) -> int:
        return int(example["prompt_len"])

    def stream_batch(self, examples: list[dict], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0):
        """``Chat.stream_batch`` for the LM: prompts left-padded (to a multiple of 32 columns)."""
        ids, mask = decode.left_pad([list(ex["ids"][: int(ex["prompt_len"])]) for ex in examples],
                                    self.tokenizer.pad_id)
        extra = round_up(ids.shape[1], 32) - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (extra, 0)), constant_values=self.tokenizer.pad_id)
        mask = np.pad(mask, ((0, 0), (extra, 0)))
        yield from self.generator.stream(self.params, ids, mask, max_new_tokens, self.tokenizer.eos_ids, temperature,
                                         top_p, seed, round_up(ids.shape[1] + max_new_tokens, 64))

    def generate(self, example: dict, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0):
        """Yields the answer's token ids one at a time, an EOS id (one of ``tokenizer.eos_ids``) last if
        the answer ends."""
        for row in self.stream_batch([example], max_new_tokens, temperature, top_p, seed):
            yield int(row[0])
            if int(row[0]) in self.tokenizer.eos_ids:
                return

    def ask(self, question: str, max_new_tokens: int = 16) -> str:
        """The greedy answer to ``question``."""
        example = self.prepare([], [{"from": "human", "value": question}])
        eos = self.tokenizer.eos_ids
        return self.tokenizer.decode([t for t in self.generate(example, max_new_tokens) if t not in eos])


def reply_prompt(pp, example: dict, rng=None, what: str = "conversation", as_trained: bool = False) -> dict:
    """``pp`` on ``example``, whose ``conversations`` end with the user turn to reply to: the prompt
    is the chat template's generation prompt (``add_generation_prompt``), earlier turns and answers
    in it (``ops_text.conversation_tokens``); ``as_trained`` (a run trained here): the earlier
    exchanges as its training rendered them. What the ``what`` or the template refuses is a
    ``ValueError`` in one line; a conversation too long for the model is refused, not cut."""
    import jinja2

    from vitmm.data.skips import BadExample

    try:
        return pp({**example, "add_generation_prompt": True, "reply_as_trained": as_trained}, rng)
    except BadExample as bad:
        if bad.reason == "too_long":
            raise ValueError(f"The conversation is too long for this model ({bad.detail}); send fewer earlier turns "
                             "or a shorter question.") from None
        raise ValueError(f"The {what} cannot be used ({bad.reason}: {bad.detail}).") from None
    except jinja2.TemplateError as err:  # the template's raise_exception, e.g. Gemma's "System role not supported"
        raise ValueError(f"The model's chat template refuses this conversation: {err}") from None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
