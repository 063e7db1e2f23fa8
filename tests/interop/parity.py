"""What the interop parity tests share: the fixture folder, the tolerance, reading a fixture's
inputs and reference outputs, the SigLIP two-tower comparison (transformers' outputs, read
from the hf and the big_vision files alike), and a LoRA run from an imported whole VLM."""

import pathlib

import jax.numpy as jnp
import numpy as np

from vitmm.models.two_towers import TwoTowers

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"
ATOL = 1e-4  # max abs difference in float32
RESIZED_RTOL = 1e-5  # at a new resolution: max abs difference ≤ 1e-5 × the reference's largest value


def load_io(name: str) -> dict:
    """A fixture's inputs and reference outputs."""
    return dict(np.load(FIXTURES / name / "io.npz"))


def images(ref: dict, key: str = "pixel_values") -> jnp.ndarray:
    return jnp.asarray(ref[key].transpose(0, 2, 3, 1))  # NCHW → NHWC


def resized_hw(ref: dict) -> tuple[int, int]:
    """The fixture's second resolution (non-square), ``(height, width)`` in pixels."""
    return tuple(ref["pixel_values_resized"].shape[2:4])


def assert_close_relative(got, want, what: str, rtol: float = RESIZED_RTOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rtol, f"{what}: max abs difference {err:.2e} of the largest value (allowed {rtol:.0e})"


def check_siglip(kwargs: dict, params: dict, ref: dict):
    """A loaded SigLIP ``TwoTowers`` against transformers' outputs; returns ``(zimg, ztxt)``."""
    zimg, ztxt, out = TwoTowers(**kwargs).apply({"params": params}, images(ref),
                                                jnp.asarray(ref["input_ids"], jnp.int32))
    checks = {
        "vision_last_hidden_state": out["img/encoded"],  # SigLIP's is after post_layernorm
        "vision_pooler_output": out["img/pooled"],       # the MAP head
        "image_embeds": zimg,
        "text_last_hidden_state": out["txt/encoded"],
        "text_embeds": ztxt,
        "logits_per_image": out["t"] * zimg @ ztxt.T + out["b"],
    }
    for key, got in checks.items():
        np.testing.assert_allclose(np.asarray(got), ref[key], atol=ATOL, rtol=0, err_msg=key)
    return zimg, ztxt


def flat_logits(vlm, example: dict) -> tuple[np.ndarray, dict]:
    """A prepared prompt of an imported VLM that runs on flat sequences (``vitmm.chat.Chat`` of a
    Qwen2-VL or Idefics3 workdir) through the full forward, alone in a row: its logits ``[S, vocab]``
    and its sequence (``data.sequences.prompt_sequence``)."""
    from vitmm.data import sequences
    from vitmm.models.vlm import VLM
    from vitmm.train.sequence_layout import SequenceLayout

    mrope = vlm.task.model.mrope
    layout = SequenceLayout.of(vlm.task, vlm._num_visual(example["image"]), (1, 1) if mrope else None)
    seq = layout.prompt(example)  # with the tower packed, M-RoPE's grids are each image's own
    tower = layout.tower is not None
    row = {k: v[None] for k, v in sequences.one_row(seq, 128, 16, 128 if tower else 0).items()}
    images = sequences.tower_batch(row) if tower else jnp.asarray(row["images"])
    positions = np.moveaxis(row["mrope"], -1, 0) if mrope else row["positions"]
    logits = vlm.task.model.apply({"params": vlm.params}, images, jnp.asarray(row["tokens"]),
                                  jnp.asarray(row["visual"]), jnp.asarray(row["segment_ids"]), jnp.asarray(positions),
                                  method=VLM.packed)
    return np.asarray(logits[0, :len(seq["tokens"])]), seq


def finetune_imported(imported: pathlib.Path, tmp_path: pathlib.Path, sequences: dict) -> tuple[dict, dict, dict]:
    """Two LoRA steps (``configs/llava_finetune.py``) from the imported VLM workdir ``imported`` on eight
    LLaVA examples of 24 px, as flat sequences (``input.sequences``); ``(the run's saved config, the
    imported parameters, the run's)``. The run is ``tmp_path / "run"``."""
    from vitmm import checkpoint as ckpt_lib
    from vitmm import config_args
    from vitmm.data import examples
    from vitmm.train import trainer

    data = examples.write_llava(tmp_path / "data", 8, resolution=24)
    config = config_args.load(pathlib.Path(__file__).resolve().parents[2] / "configs/llava_finetune.py",
                              "lora=4,smoke,steps=2", **{
                                  "init.checkpoint": str(imported), "input.data_path": str(data),
                                  "input.image_folder": str(data.parent),
                                  **{f"input.sequences.{k}": v for k, v in sequences.items()}})
    run = tmp_path / "run"
    trainer.train(config, run)
    return ckpt_lib.load_config(run), ckpt_lib.load_params(imported), ckpt_lib.load_params(run)


def served_example(vlm, images: list, text: str, text_first: bool = False) -> dict:
    """The example ``vitmm.serve`` prepares for one user message of ``image_url`` parts (lossless
    PNG) and a ``text`` part after them (before them: ``text_first``, lmms-eval's order)."""
    import base64

    from vitmm import serve
    from vitmm.data import examples

    engine = serve.Engine.__new__(serve.Engine)
    engine.chat, engine.model_name, engine.local_root = vlm, "m", None
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                        + base64.b64encode(examples.encode(image, "png")).decode()}}
             for image in images]
    text_part = [{"type": "text", "text": text}]
    content = text_part + parts if text_first else parts + text_part
    return engine.parse({"model": "m", "messages": [{"role": "user", "content": content}]})["example"]


def asked_example(vlm, images: list, question: str, monkeypatch) -> dict:
    """The example ``Chat.ask`` (``vitmm.chat --image``) decodes from, nothing decoded."""
    seen = []
    monkeypatch.setattr(vlm, "generate", lambda example, max_new_tokens: seen.append(example) or iter(()))
    vlm.ask(images if len(images) > 1 else images[0], question)
    return seen[0]


def import_hf(fixture: pathlib.Path, tmp_path_factory) -> tuple[pathlib.Path, object]:
    """A transformers fixture folder imported (``python -m vitmm.interop --from hf``) and loaded for
    chat: ``(workdir, vitmm.chat.VLM)``, for a module's tests to share."""
    from vitmm import chat
    from vitmm.interop.__main__ import main

    out = tmp_path_factory.mktemp(fixture.name) / "w"
    main(["--from", "hf", "--src", str(fixture), "--out", str(out)])
    return out, chat.load(out)
