"""Ask a trained VLM about an image: the run's own preprocessing, prompt format (its LM's chat
template where the run used one), merged LoRA adapters and KV-cache greedy decoding.

    python -m vitmm.chat --workdir workdirs/smol/smollm2_stage2_lora --index 3 \\
        --question "What colour is the circle?"
    python -m vitmm.chat --workdir workdirs/llava_s2 --image photo.jpg --question "Describe the image."
    python -m vitmm.chat --workdir workdirs/llava_multi --image a.jpg --image b.jpg --question "What differs?"

    from vitmm import chat
    vlm = chat.load("workdirs/smol/smollm2_stage2_lora")
    answer = vlm.ask(image_uint8_hwc, "How many stars are there?")

How the tower and LM were built and the tokenizer come from the copies the run pinned of its
``init.vision`` / ``init.lm`` folders (``WORKDIR/sources``; ``vitmm.train.sources``); the
parameters from the workdir's newest checkpoint. A converted LM folder
(``python -m vitmm.interop --from hf|gguf``) is asked text only: ``--workdir workdirs/smollm2
--question "..."``, ``chat.load(folder).ask(question)``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm import decode
from vitmm.data import images as images_lib
from vitmm.data import preprocess
from vitmm.lm_chat import LMChat, reply_prompt, round_up


def served_pp(config, why: bool = False):
    """The pp ``Chat`` (so ``vitmm.serve``) prompts with, fields filled: a run on conversations (raw
    LLaVA-style data) its own training pp, the question as a one-turn conversation; otherwise the
    pp of the evaluator named ``qa`` (else ``QAAccuracy.PP``) without its random choice of a
    question. ``why``: ``(pp, where it comes from)``."""
    from vitmm.train import pp_template
    from vitmm.train.vlm_evaluators import QAAccuracy

    if "conversation_tokens" in config.input.pp:
        qa, source = config.input.pp, "the run's training pp: it was trained on conversations"
    elif config.get("evals") and "qa" in config.evals and config.evals.qa.get("pp"):
        qa, source = config.evals.qa.pp, "evals.qa's pp"
    else:
        qa, source = QAAccuracy.PP, "the default qa pp: the run has no evals.qa pp"
    spec = pp_template.pp_string(config, qa.replace("choose|", ""))
    return (spec, source) if why else spec


def video_slots(config, spec: str) -> int:
    """The image slots a video fills in a run's prompts (``spec``, its ``served_pp``): its
    ``decode``'s ``num_frames``, merged ``temporal_patch``'s size at a time. A ``ValueError`` for a
    run that takes no video: an imported VLM, one not trained on flat conversations, or one whose
    rows hold fewer slots (``input.sequences.max_images``: its training skipped every video)."""
    ops = preprocess.ops(spec)
    imported = {"smart_resize": "Qwen2-VL", "idefics3_tiles": "Idefics3"}
    for name in (name for name, _, _ in ops if name in imported):  # their processors' video tokens are not vitmm's
        raise ValueError(f"Video through an imported {imported[name]}'s image steps is not supported yet; send images.")
    frames = [kw.get("num_frames", a[3] if len(a) > 3 else 8) for name, a, kw in ops if name == "decode"]
    sizes = [kw.get("size", a[0] if a else 2) for name, a, kw in ops if name == "temporal_patch"]
    slots = -(-int(frames[0]) // int(sizes[0] if sizes else 1)) if frames else 0
    sq = config.input.get("sequences")
    if not (sq and sq.get("length")) or "conversation_tokens" not in spec or not 0 < slots <= int(sq.max_images):
        raise ValueError("This model takes no video (a run on input.sequences with frames takes one).")
    return slots


class Chat:
    max_images = 1  # images one prompt may hold; a run on flat sequences (input.sequences) sets its own
    image_separator = "\n"  # the text after an image's <image> tag: LLaVA's convention, which its data has
    _flat = False

    def __init__(self, workdir, step: int | None = None):
        from vitmm.train import sources, tasks
        from vitmm.train.parallel import Parallel

        self.config = sources.run_config(workdir, step)
        if self.config.get("task") != "vlm":
            raise ValueError(f"{workdir} holds a {self.config.get('task', 'contrastive')!r} run, not a VLM (or a "
                             "`python -m vitmm.interop` LM folder).")
        self.tokenizer = tasks.tokenizer_for(self.config)
        self.task = tasks.from_config(self.config, Parallel("jit"), self.tokenizer)
        self.params = self.task.eval_params(ckpt_lib.load_params(workdir, step))
        self._conversation = "conversation_tokens" in self.config.input.pp
        spec = served_pp(self.config)
        self._decoder = decode.GreedyDecoder(self.task.model, self.tokenizer.vocab_size)
        sq = self.config.input.get("sequences")
        # images one prompt may hold: a run on flat sequences (input.sequences) took its decode's max_images
        decoded = [kw.get("max_images", a[1] if len(a) > 1 else 1) for name, a, kw in preprocess.ops(spec)
                   if name == "decode"]
        self._flat = bool(sq and sq.get("length"))  # trained on flat sequences: prompts are made the same way
        self._spec = spec  # flat AnyRes: its final normalize goes to the views (SequenceLayout.split_affine)
        self._set_pp(preprocess.split_image_affine(spec)[0] if self._flat and self.task.model.anyres else spec)
        self.max_images = min(int(sq.max_images), *decoded) if self._flat else 1
        # An imported VLM is prompted as transformers prompts it; a run trained here as it was trained.
        self._imported = bool((self.config.get("source") or {}).get("architecture"))
        if self._imported:  # its processor puts an image part right before the text
            self.image_separator = ""  # (Qwen2-VL's, PaliGemma's templates keep a "\n")

    def _set_pp(self, spec: str):
        """The run's pp for ``spec``, and its ``qa_tokens`` step alone, whose ``qa_truncated`` says
        a question was cut to fit (a ``keep(...)`` after it in the pp may drop that key)."""
        self._pp = preprocess.parse(spec, self.tokenizer)
        qa = [(args, kwargs) for name, args, kwargs in preprocess.ops(spec) if name == "qa_tokens"]
        self._qa_alone = preprocess.qa_tokens(*qa[-1][0], **{"tokenizer": self.tokenizer, **qa[-1][1]}) if qa else None

    def prepare(self, images: list, turns: list[dict], video=None) -> dict:
        """The preprocessed prompt for LLaVA-style ``turns`` (``{"from", "value"}``, ``<image>``
        where each of ``images``, uint8 ``[H, W, 3]`` or a PIL image, goes) ending with a user turn:
        the run's own pp and prompt format. ``video``: a video file's bytes (or a list of frames)
        for the turns' ``<video>``, for a run on flat sequences (its frames sampled as it trained).
        ``ValueError`` for what this run cannot take."""
        if not turns or turns[-1]["from"] != "human":
            raise ValueError("The conversation must end with a user turn.")
        if video is not None:
            return self._prepare_video(images, turns, video)
        if len(images) > self.max_images:
            raise ValueError(f"{len(images)} images; this model takes at most {self.max_images}.")
        images = [images_lib.caller_image(image) for image in images]
        tags = sum(t["value"].count("<image>") for t in turns)
        if tags != len(images):
            raise ValueError(f"{tags} <image> tag(s) in the text for {len(images)} image(s).")
        rng = np.random.default_rng(0)
        if self._conversation:
            return reply_prompt(self._pp, {"images": list(images), "conversations": turns}, rng,
                                as_trained=not self._imported)
        if any(t["from"] == "system" for t in turns):
            raise ValueError("This model was trained on single questions with its own system prompt (a qa format): "
                             "send no system message.")
        if len(turns) != 1 or len(images) != 1:
            raise ValueError("This model was trained on single questions about one image: send one user message with "
                             "one image.")
        question = turns[0]["value"].replace("<image>", "").strip()
        if self._qa_alone is not None:  # the plain format cuts a long question to fit: refused, never cut
            alone = self._qa_alone({"question": question, "answer": ""}, None)
            if alone["qa_truncated"]:
                raise ValueError(f"The question does not fit this model's max_len of {len(alone['ids'])} tokens; "
                                 "send a shorter question.")
        return self._pp({"image": images[0], "question": question, "answer": ""}, rng)

    def _prepare_video(self, images: list, turns: list[dict], video) -> dict:
        video_slots(self.config, self._spec)  # a frames=K run with images=1 too: a video is not its images
        if images:
            raise ValueError("A video goes alone, without images.")
        return reply_prompt(self._pp, {"images": [], "video": video, "conversations": turns}, np.random.default_rng(0),
                            "video", as_trained=not self._imported)

    def num_prompt_tokens(self, example: dict) -> int:
        """The prompt's text tokens and the visual tokens the LM sees."""
        if example.get("more_images") or self._flat:  # the flat sequence decoded: each image its own tokens
            return len(self._sequence_layout(example)[0].prompt(example)["tokens"])
        shown = int(example.get("has_image", True))
        if "visual_mask" in example:  # AnyRes views made on the host: their real tokens
            return int(example["prompt_len"]) + shown * int(np.sum(example["visual_mask"]))
        return int(example["prompt_len"]) + shown * self._num_visual(example["image"])

    def _visual(self, examples: list[dict]) -> tuple[np.ndarray | None, np.ndarray | None, int]:
        """``(visual_mask, layout, visual tokens a row)`` for prompts decoded together: AnyRes views
        made on the host (the ``anyres`` op) bring where each token comes from and which are real;
        a text-only prompt's visual tokens are masked out."""
        shown = np.array([bool(ex.get("has_image", True)) for ex in examples])
        if "anyres_layout" in examples[0]:
            layout = np.stack([ex["anyres_layout"] for ex in examples])
            mask = np.stack([ex["visual_mask"] for ex in examples]) & shown[:, None]
            if "anyres_weights" in examples[0]:  # LLaVA-OneVision's downsampled grids: four tokens mixed a token
                return mask, (layout, np.stack([ex["anyres_weights"] for ex in examples])), layout.shape[1]
            return mask, layout, layout.shape[1]
        num_visual = self._num_visual(examples[0]["image"])
        return (None if shown.all() else np.repeat(shown[:, None], num_visual, axis=1)), None, num_visual

    def _num_visual(self, image) -> int:
        from vitmm.models.vlm import VLM

        return int(self.task.model.apply({"params": self.params}, tuple(image.shape[:2]),
                                         method=VLM.num_visual_tokens))

    def generate(self, example: dict, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0):
        """Yields the answer's token ids one at a time, an EOS id (one of ``tokenizer.eos_ids``) last if
        the answer ends."""
        if example.get("more_images") or self._flat:  # several images, own sizes: flat sequences
            for row in self.stream_batch([example], max_new_tokens, temperature, top_p, seed):
                yield int(row[0])
                if int(row[0]) in self.tokenizer.eos_ids:
                    return
            return
        n = int(example["prompt_len"])
        visual_mask, layout, _ = self._visual([example])
        eos = self.tokenizer.eos_ids
        for row in self._decoder.stream({"params": self.params}, example["image"][None], example["ids"][None, :n],
                                        np.array([n]), max_new_tokens, eos, bool(self.config.model.get("prefix_lm")),
                                        np.array([example["image_pos"]]), visual_mask, layout, temperature, top_p,
                                        seed):
            yield int(row[0])
            if int(row[0]) in eos:
                return

    def stream_batch(self, examples: list[dict], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0):
        """``[len(examples)]`` tokens a step for prompts of ``prepare`` decoded together (a finished
        row repeats EOS). Shapes are rounded up (prompt columns to a multiple of 32, the cache to one
        of 64) so that a server compiles a handful of programs, not one per mix of requests."""
        if any(ex.get("more_images") for ex in examples) or self._flat:
            yield from self._stream_sequences(examples, max_new_tokens, temperature, top_p, seed)
            return
        lengths = np.array([int(ex["prompt_len"]) for ex in examples])
        ids = np.full((len(examples), round_up(int(lengths.max()), 32)), self.tokenizer.pad_id, np.int32)
        for row, ex in enumerate(examples):
            ids[row, : lengths[row]] = ex["ids"][: lengths[row]]
        visual_mask, layout, num_visual = self._visual(examples)
        yield from self._decoder.stream(
            {"params": self.params}, np.stack([ex["image"] for ex in examples]), ids, lengths, max_new_tokens,
            self.tokenizer.eos_ids, bool(self.config.model.get("prefix_lm")),
            np.array([ex["image_pos"] for ex in examples]), visual_mask, layout, temperature, top_p, seed,
            round_up(ids.shape[1] + num_visual + max_new_tokens, 64))

    def _stream_sequences(self, examples: list[dict], max_new_tokens: int, temperature: float, top_p: float,
                          seed: int):
        """``stream_batch`` for prompts with several images: flat sequences (``data.sequences``),
        image slots rounded up to ``max_images``."""
        from vitmm.data import sequences

        layout, grid = self._sequence_layout(examples[0])
        tower = layout.tower  # images at their own sizes: the tower's tokens packed
        seqs = [layout.prompt(ex) for ex in examples]
        lengths = np.array([len(seq["tokens"]) for seq in seqs])
        slots = max(self.max_images, *(len(seq["grids" if tower else "images"]) for seq in seqs))  # video: more
        tower_length = round_up(max(len(seq.get("tower_kinds", ())) for seq in seqs), 64) if tower else 0
        rows = [sequences.one_row(seq, round_up(int(lengths.max()), 32), slots, tower_length) for seq in seqs]
        stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        images = sequences.tower_batch(stacked) if tower else stacked["images"]
        yield from self._decoder.stream_sequences(
            {"params": self.params}, images, np.stack([r["tokens"] for r in rows]),
            np.stack([r["visual"] for r in rows]), lengths, max_new_tokens, self.tokenizer.eos_ids,
            bool(self.config.model.get("prefix_lm")), temperature, top_p, seed,
            round_up(rows[0]["tokens"].shape[0] + max_new_tokens, 64),
            None if grid is None else np.moveaxis(np.stack([r["mrope"] for r in rows]), -1, 0))

    def _sequence_layout(self, example: dict):
        """``(SequenceLayout, M-RoPE token grid or None)`` that lays prompts out as flat sequences,
        sized by ``example``'s first image."""
        from vitmm.models.vlm import VLM
        from vitmm.train.sequence_layout import SequenceLayout

        grid = self.task.model.apply({"params": self.params}, example["image"].shape[:2],
                                     method=VLM.token_grid) if self.task.model.mrope else None
        layout = SequenceLayout.of(self.task, self._num_visual(example["image"]), grid)
        return layout.split_affine(self._spec)[1], grid

    def ask(self, image, question: str, max_new_tokens: int = 16) -> str:
        """The greedy answer to ``question`` about ``image`` (uint8 ``[H, W, 3]`` or a PIL image; a
        list of them for a run that takes several, each shown as ``<image>`` before the question)."""
        several = isinstance(image, (list, tuple)) and image and all(
            isinstance(x, np.ndarray) or hasattr(x, "convert") for x in image)  # arrays or PIL images, not pixels
        images = list(image) if several else [image]
        typed = question.count("<image>")
        if typed:  # counted here: the message names the tags the caller typed, not those added below
            raise ValueError(f"The question holds {typed} <image> tag(s) of its own; leave them out: one is put "
                             f"before the question for each of the {len(images)} image(s).")
        tags = "".join("<image>" + self.image_separator for _ in images)
        example = self.prepare(images, [{"from": "human", "value": f"{tags}{question}"}])
        eos = self.tokenizer.eos_ids
        return self.tokenizer.decode([t for t in self.generate(example, max_new_tokens) if t not in eos])


def load(workdir, step: int | None = None) -> Chat | LMChat:
    """A VLM workdir's ``Chat``, or an LM folder's ``LMChat``; ``ValueError`` for anything else."""
    config = ckpt_lib.load_config(workdir, step)
    if config.get("task") is None and "lm" in (config.get("model") or {}):
        return LMChat(workdir, step)
    return Chat(workdir, step)


def main(argv=None) -> int:
    from vitmm import console, xla_flags

    xla_flags.use_vitmm_defaults()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True,
                        help="a `python -m vitmm.train` VLM workdir (or a `python -m vitmm.interop` LM folder)")
    parser.add_argument("--question", action="append", required=True, help="repeat to ask several")
    parser.add_argument("--image", action="append",
                        help="an image file (JPEG, PNG, WebP, ...); repeat for several (a run on input.sequences)")
    parser.add_argument("--video", help="a video file for a run that took videos (configs' frames=N)")
    parser.add_argument("--index", type=int, default=0, help="without --image: this example of --split")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--verbose", action="store_true", help="the libraries' INFO lines and usual warnings too")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens {args.max_new_tokens}: at least 1.")
    console.quiet(args.verbose)
    from vitmm.data import pipeline, scenes

    try:
        vlm = load(args.workdir)
    except (ValueError, FileNotFoundError) as err:
        print(f"python -m vitmm.chat: {err}", file=sys.stderr)
        return 2
    if isinstance(vlm, LMChat):
        if args.image or args.video:
            print(f"python -m vitmm.chat: {args.workdir} is a language model; it takes no "
                  f"{'--image' if args.image else '--video'}.", file=sys.stderr)
            return 2
        for question in args.question:
            try:
                answer = vlm.ask(question, args.max_new_tokens)
            except ValueError as err:
                return _refused(question, err)
            print(f"user: {question}\nassistant: {answer}")
        return 0
    if args.video:
        try:
            data = open(args.video, "rb").read()  # noqa: SIM115 - read at once
            for question in args.question:
                example = vlm.prepare(args.image or [], [{"from": "human", "value": f"<video>\n{question}"}], data)
                eos = vlm.tokenizer.eos_ids
                answer = vlm.tokenizer.decode([t for t in vlm.generate(example, args.max_new_tokens) if t not in eos])
                print(f"user: {question}\nassistant: {answer}")
        except (OSError, ValueError) as err:
            print(f"python -m vitmm.chat: --video {args.video}: {err}", file=sys.stderr)
            return 2
        return 0
    if args.image:
        from vitmm.data.images import decode_image
        from vitmm.data.skips import BadExample

        if len(args.image) > vlm.max_images:
            print(f"python -m vitmm.chat: {len(args.image)} --image files; this model takes at most {vlm.max_images}.",
                  file=sys.stderr)
            return 2
        images = []
        for path in args.image:
            try:
                images.append(decode_image(open(path, "rb").read(), alpha="keep"))  # noqa: SIM115 - read at once
            except (OSError, BadExample) as err:
                print(f"python -m vitmm.chat: cannot read --image {path}: {err}", file=sys.stderr)
                return 2
            print(f"[{path}: {images[-1].shape[1]}x{images[-1].shape[0]}]")
        for question in args.question:
            try:
                answer = vlm.ask(images if len(images) > 1 else images[0], question, args.max_new_tokens)
            except ValueError as err:
                return _refused(question, err)
            print(f"user: {question}\nassistant: {answer}")
        return 0
    from vitmm.train import tasks

    qa = tasks.evals_config(vlm.config).get("qa") if vlm.config.get("evals") else None
    if qa is None:
        print(f"python -m vitmm.chat: {args.workdir} was trained on raw data with no dataset to pick --index from; "
              "pass --image FILE.", file=sys.stderr)
        return 2
    # The example as the qa evaluator reads it (pipeline.source_for, its data settings): scenes at
    # random sizes made on the fly (scenes_any) come before a TFDS name, which such a run may keep.
    data = {**qa["data"], "split": args.split}
    name = "scenes_any" if data.get("scenes_any") else data.get("name") or "the qa data"
    if data.get("scenes_any") and args.split not in scenes.SPLIT_IDS:
        print(f"python -m vitmm.chat: --split {args.split}: {name} (scenes made on the fly) has the splits "
              f"{list(scenes.SPLIT_IDS)}.", file=sys.stderr)
        return 2
    try:
        source = pipeline.source_for(data, keys=("image", "caption"))
    except (ValueError, FileNotFoundError) as err:
        print(f"python -m vitmm.chat: the qa evaluator's data ({name}, --split {args.split}): {err}", file=sys.stderr)
        return 2
    if not 0 <= args.index < len(source):
        print(f"python -m vitmm.chat: --index {args.index}: {name} {args.split} has examples 0 to "
              f"{len(source) - 1}.", file=sys.stderr)
        return 2
    example = preprocess.parse("decode")(dict(source[args.index]), None)
    caption = f": {example['caption']}" if example.get("caption") is not None else ""
    print(f"[{name} {args.split} #{args.index}{caption}]")
    for question in args.question:
        try:
            answer = vlm.ask(example["image"], question, args.max_new_tokens)
        except ValueError as err:
            return _refused(question, err)
        print(f"user: {question}\nassistant: {answer}")
    return 0


def _refused(question: str, err: ValueError) -> int:
    """A question the model refuses (too long, its own ``<image>`` tags, a conversation too long):
    one line naming it (its start, when long) and why, exit 2, as for any bad input."""
    shown = question if len(question) <= 60 else question[:57] + "..."
    print(f"python -m vitmm.chat: --question {shown!r}: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
