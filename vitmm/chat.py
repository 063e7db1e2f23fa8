"""Ask a trained VLM about an image: the run's own preprocessing, prompt format (its LM's chat
template where the run used one), merged LoRA adapters and KV-cache greedy decoding.

    python -m vitmm.chat --workdir workdirs/smol/smollm2_stage2_lora --index 3 \\
        --question "What colour is the circle?"

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
        # The run's question-answering preprocessing without the random choice of a question.
        qa = self.config.evals.qa.get("pp") if self.config.get("evals") and "qa" in self.config.evals else None
        qa = qa or "decode|resize({image_size})|normalize({image_mean}, {image_std})|choose|qa_tokens({max_len})"
        self._pp = preprocess.parse(tasks.pp_string(self.config, qa.replace("choose|", "")), self.tokenizer)
        self._decoder = decode.GreedyDecoder(self.task.model)

    def ask(self, image: np.ndarray, question: str, max_new_tokens: int = 16) -> str:
        """The greedy answer to ``question`` about ``image`` (uint8 ``[H, W, 3]``)."""
        ex = self._pp({"image": image, "question": question, "answer": ""}, np.random.default_rng(0))
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
    parser.add_argument("--index", type=int, default=0, help="the image: this example of --split")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    args = parser.parse_args(argv)
    from vitmm.data import pipeline

    vlm = load(args.workdir)
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
