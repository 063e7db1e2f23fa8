"""Ask a trained VLM about an image: the run's own preprocessing, prompt format (its LM's chat
template where the run used one), merged LoRA adapters and KV-cache greedy decoding.

    python -m vitmm.chat --workdir workdirs/smol/smollm2_stage2_lora --index 3 \\
        --question "What colour is the circle?"
    python -m vitmm.chat --workdir workdirs/llava_s2 --image photo.jpg --question "Describe the image."

    from vitmm import chat
    vlm = chat.load("workdirs/smol/smollm2_stage2_lora")
    answer = vlm.ask(image_uint8_hwc, "How many stars are there?")

The run's ``init.vision`` / ``init.lm`` folders must still exist (they say how the tower and LM
were built); the parameters come from the workdir's newest checkpoint.
"""

from __future__ import annotations

import argparse
import sys

import ml_collections
import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm import decode
from vitmm.data import preprocess


class Chat:
    def __init__(self, workdir, step: int | None = None):
        from vitmm.train import tasks
        from vitmm.train.parallel import Parallel

        self.config = ml_collections.ConfigDict(ckpt_lib.load_config(workdir, step))
        if self.config.get("task") != "vlm":
            raise ValueError(f"{workdir} holds a {self.config.get('task', 'contrastive')!r} run, not a VLM.")
        self.tokenizer = tasks.tokenizer_for(self.config)
        self.task = tasks.from_config(self.config, Parallel("jit"), self.tokenizer)
        self.params = self.task.eval_params(ckpt_lib.load_params(workdir, step))
        # A run on conversations (raw LLaVA-style data): its own pp, the question as a one-turn
        # conversation. Otherwise the question-answering pp without the random choice of a question.
        self._conversation = "conversation_tokens" in self.config.input.pp
        if self._conversation:
            qa = self.config.input.pp
        else:
            qa = self.config.evals.qa.get("pp") if self.config.get("evals") and "qa" in self.config.evals else None
            qa = qa or "decode|resize({image_size})|normalize({image_mean}, {image_std})|choose|qa_tokens({max_len})"
        self._pp = preprocess.parse(tasks.pp_string(self.config, qa.replace("choose|", "")), self.tokenizer)
        self._decoder = decode.GreedyDecoder(self.task.model)

    def _example(self, image: np.ndarray, question: str) -> dict:
        if not self._conversation:
            return self._pp({"image": image, "question": question, "answer": ""}, np.random.default_rng(0))
        turns = [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": ""}]
        return self._pp({"images": [image], "conversations": turns}, np.random.default_rng(0))

    def ask(self, image: np.ndarray, question: str, max_new_tokens: int = 16) -> str:
        """The greedy answer to ``question`` about ``image`` (uint8 ``[H, W, 3]``)."""
        image = np.asarray(image)
        if image.dtype != np.uint8 or not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (1, 3, 4))):
            raise ValueError(f"ask: the image must be uint8 [H, W, 3] (or [H, W], 1 or 4 channels); got {image.dtype} "
                             f"{image.shape}. Read a file with vitmm.data.images.decode_image(path.read_bytes()).")
        ex = self._example(image, question)
        n = int(ex["prompt_len"])
        out = self._decoder({"params": self.params}, ex["image"][None], ex["ids"][None, :n],
                            np.array([n]), max_new_tokens, self.tokenizer.eos_id,
                            bool(self.config.model.get("prefix_lm")), np.array([ex["image_pos"]]))[0].tolist()
        eos = self.tokenizer.eos_id
        return self.tokenizer.decode(out[: out.index(eos)] if eos in out else out)


def load(workdir, step: int | None = None) -> Chat:
    return Chat(workdir, step)


def main(argv=None) -> int:
    from vitmm import xla_flags

    xla_flags.use_vitmm_defaults()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a `python -m vitmm.train` VLM workdir")
    parser.add_argument("--question", action="append", required=True, help="repeat to ask several")
    parser.add_argument("--image", help="an image file (JPEG, PNG, WebP, ...)")
    parser.add_argument("--index", type=int, default=0, help="without --image: this example of --split")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    args = parser.parse_args(argv)
    from vitmm.data import pipeline

    vlm = load(args.workdir)
    if args.image:
        from vitmm.data.images import decode_image
        from vitmm.data.skips import BadExample

        try:
            image = decode_image(open(args.image, "rb").read())  # noqa: SIM115 - read at once
        except (OSError, BadExample) as err:
            print(f"python -m vitmm.chat: cannot read --image {args.image}: {err}", file=sys.stderr)
            return 2
        print(f"[{args.image}: {image.shape[1]}x{image.shape[0]}]")
        for question in args.question:
            print(f"user: {question}\nassistant: {vlm.ask(image, question, args.max_new_tokens)}")
        return 0
    if not (vlm.config.get("evals") and "qa" in vlm.config.evals):
        print(f"python -m vitmm.chat: {args.workdir} was trained on raw data with no dataset to pick --index from; "
              "pass --image FILE.", file=sys.stderr)
        return 2
    data = vlm.config.evals.qa.data
    source = pipeline.get_source(data.name, args.split, data.get("data_dir") or vlm.config.input.get("data_dir"),
                                 keys=("image", "caption"))
    example = preprocess.parse("decode")(dict(source[args.index]), None)
    print(f"[{data.name} {args.split} #{args.index}: {example['caption']}]")
    for question in args.question:
        print(f"user: {question}\nassistant: {vlm.ask(example['image'], question, args.max_new_tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
