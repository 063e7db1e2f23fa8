"""`vitmm.chat`'s image input: what `Chat.ask`/`Chat.prepare` take (uint8 arrays, PIL images made
RGB as files are) and the one-line error for anything else, on a `Chat` with no model loaded (the
check comes before the model is used; asking a trained VLM is tested in tests/train and
tests/test_serve.py)."""

import pathlib
import re

import numpy as np
import pytest
from PIL import Image

from vitmm import chat

TAKEN = r"^The image must be uint8 \[H, W, 3\] \(\[H, W\], \[H, W, 1\] and \[H, W, 4\] are made RGB\) or a PIL image; "


class Unloaded(chat.Chat):
    """``Chat`` without a workdir: a question-answering pp that returns what it was given."""

    def __init__(self):
        self._conversation, self.tokenizer, self._qa_alone = False, None, None
        self._pp = lambda example, rng: example


@pytest.mark.parametrize("image, message", [
    (np.zeros((32, 32)), r"got float64 \(32, 32\): float pixels have no agreed range, scale them to 0\.\.255 and "
                         r"cast with \.astype\(np\.uint8\)\.$"),
    (np.full((8, 8, 3), np.nan, np.float32), r"got float32 \(8, 8, 3\): float pixels"),
    (np.zeros((8, 8, 3), np.int64), r"got int64 \(8, 8, 3\): cast values in 0\.\.255 with \.astype\(np\.uint8\)\.$"),
    (np.zeros((8, 8, 3), bool), r"got bool \(8, 8, 3\): cast"),
    (np.zeros((3, 8, 8), np.uint8), r"got uint8 \(3, 8, 8\): channels go last, e\.g\. image\.transpose\(1, 2, 0\)\.$"),
    (np.zeros((8, 8, 2), np.uint8), r"got uint8 \(8, 8, 2\): 2 channels, pass 1, 3 or 4\.$"),
    (np.zeros((2, 8, 8, 3), np.uint8), r"got uint8 \(2, 8, 8, 3\): pass one image, not a batch\.$"),
    (np.zeros(8, np.uint8), r"got uint8 \(8,\): pass rows × columns \(× channels\)\.$"),
    (np.zeros((0, 8, 3), np.uint8), r"got uint8 \(0, 8, 3\), which has no pixels\.$"),
    (Image.new("RGB", (0, 0)), r"got uint8 \(0, 0, 3\), which has no pixels\.$"),
    ("photo.jpg", r"got the path 'photo\.jpg': read the file with vitmm\.data\.images\.decode_image\(open\(path, "
                  r"'rb'\)\.read\(\)\)\.$"),
    (pathlib.Path("photo.jpg"), r"got the path 'photo\.jpg': read the file"),
    (b"\x89PNG\r\n\x1a\n", r"got 8 bytes: read the file"),
    (None, r"got a NoneType: pass pixels, or read the file"),
    ([[1, 2], [3]], r"got a list: pass pixels"),
], ids=["2d-float", "nan", "int64", "bool", "channels-first", "2-channels", "batch", "1d", "empty", "empty-pil",
        "path-str", "path", "bytes", "none", "ragged-list"])
def test_anything_but_pixels_fails_in_one_line_naming_it_and_the_fix(image, message):
    with pytest.raises(ValueError, match=TAKEN + message) as err:
        Unloaded().ask(image, "What is it?")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("image, shape", [
    (np.zeros((6, 5, 3), np.uint8), (6, 5, 3)),
    (np.zeros((6, 5), np.uint8), (6, 5)),  # greyscale, [H, W, 1] and RGBA: the pp's decode makes them RGB
    (np.zeros((6, 5, 1), np.uint8), (6, 5, 1)),
    (np.zeros((6, 5, 4), np.uint8), (6, 5, 4)),
    (Image.new("RGB", (5, 6), (10, 20, 30)), (6, 5, 3)),
    (Image.new("L", (5, 6)), (6, 5, 3)),
    (Image.new("RGBA", (5, 6)), (6, 5, 4)),  # its alpha kept for the pp's decode(alpha=…)
    (Image.new("I;16", (5, 6)), (6, 5, 3)),
], ids=["rgb", "grey", "grey-1", "rgba", "pil-rgb", "pil-l", "pil-rgba", "pil-16-bit"])
def test_uint8_arrays_and_pil_images_reach_the_pp(image, shape):
    example = Unloaded().prepare([image], [{"from": "human", "value": "<image>\nWhat is it?"}])
    assert example["image"].dtype == np.uint8 and example["image"].shape == shape
    assert example["question"] == "What is it?"


def test_a_palette_image_gives_its_colours_not_its_palette_indices():
    image = Image.new("P", (5, 6), 1)
    image.putpalette([0, 0, 0, 200, 100, 50])
    example = Unloaded().prepare([image], [{"from": "human", "value": "<image>\n?"}])
    assert example["image"].shape == (6, 5, 3) and (example["image"] == [200, 100, 50]).all()


def test_a_qa_format_run_refuses_a_question_too_long_and_a_system_message():
    """A run with a ``qa`` prompt format (``qa_tokens``, which cuts a long training question to fit)
    refuses a question that does not fit rather than answering its beginning, and a system message
    rather than dropping it (the run's own system prompt is used), also when the pp's last
    ``keep(...)`` drops the ``qa_truncated`` that says a question was cut."""
    chat = Unloaded()
    chat._set_pp("qa_tokens(16)|keep('ids', 'prompt_len')")
    image = np.zeros((4, 4, 3), np.uint8)
    assert chat.prepare([image], [{"from": "human", "value": "<image>\nshort?"}])["prompt_len"] == 1 + len("short? ")
    with pytest.raises(ValueError, match=r"^The question does not fit this model's max_len of 16 tokens; send a "
                                         r"shorter question\.$"):
        chat.prepare([image], [{"from": "human", "value": "<image>\nwhat is the colour of the big circle?"}])
    with pytest.raises(ValueError, match=r"^This model was trained on single questions with its own system prompt "
                                         r"\(a qa format\): send no system message\.$"):
        chat.prepare([image], [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "<image>\n?"}])


def test_ask_refuses_image_tags_typed_in_the_question_counting_the_typed_ones():
    with pytest.raises(ValueError, match=r"^The question holds 1 <image> tag\(s\) of its own; leave them out: one is "
                                         r"put before the question for each of the 1 image\(s\)\.$"):
        Unloaded().ask(np.zeros((4, 4, 3), np.uint8), "<image> What colour?")


@pytest.mark.parametrize("question, message", [
    ("<image> What colour?", r"'<image> What colour\?': The question holds 1 <image> tag\(s\) of its own; "),
    ("how many stars " * 10, r"'how many stars how many stars how many stars how many sta\.\.\.': The question does "
                             r"not fit this model's max_len of 16 tokens; send a shorter question\.$"),
], ids=["image-tag", "too-long"])
def test_the_cli_refuses_a_question_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys, question, message):
    """``python -m vitmm.chat`` prints a refused question as one line and exits 2 (docs/failures.md)."""
    vlm = Unloaded()
    vlm._set_pp("qa_tokens(16)|keep('ids', 'prompt_len')")
    monkeypatch.setattr(chat, "load", lambda workdir: vlm)
    Image.new("RGB", (4, 4), (200, 0, 0)).save(tmp_path / "red.png")
    assert chat.main(["--workdir", "W", "--image", str(tmp_path / "red.png"), "--question", question]) == 2
    err = capsys.readouterr().err
    assert re.match(r"^python -m vitmm\.chat: --question " + message, err) and err.count("\n") == 1


def test_the_cli_refuses_a_conversation_too_long_for_a_language_model_in_one_line(monkeypatch, capsys):
    class Refusing(chat.LMChat):
        def __init__(self):
            pass

        def ask(self, question, max_new_tokens=16):
            raise ValueError("The conversation is too long for this model (5031 prompt tokens with max_len=4096); "
                             "send a shorter question.")

    monkeypatch.setattr(chat, "load", lambda workdir: Refusing())
    assert chat.main(["--workdir", "W", "--question", "hello " * 5000]) == 2
    assert capsys.readouterr().err == ("python -m vitmm.chat: --question 'hello hello hello hello hello hello hello "
                                       "hello hello hel...': The conversation is too long for this model (5031 "
                                       "prompt tokens with max_len=4096); send a shorter question.\n")


def test_index_shows_the_qa_evaluator_s_example_of_a_run_on_scenes_at_random_sizes(monkeypatch, capsys):
    """``--index`` reads the example as the qa evaluator does (``pipeline.source_for``): for an
    any_size run its scenes made on the fly (``scenes_any``), not the TFDS scenes its config still names."""
    from vitmm import config_args
    from vitmm.data import pipeline, preprocess
    from vitmm.train import tasks

    vlm = Unloaded()
    vlm.config = config_args.load(pathlib.Path(__file__).parents[1] / "configs/vlm_scenes.py", "smoke,any_size=True")
    shown = []
    vlm.ask = lambda image, question, max_new_tokens: shown.append(image) or "yes"
    monkeypatch.setattr(chat, "load", lambda workdir: vlm)
    assert chat.main(["--workdir", "W", "--index", "3", "--question", "Is there a star?"]) == 0
    expected = preprocess.parse("decode")(dict(pipeline.source_for(tasks.evals_config(vlm.config)["qa"]["data"])[3]),
                                          None)
    assert (shown[0] == expected["image"]).all()
    assert capsys.readouterr().out.startswith(f"[scenes_any validation #3: {expected['caption']}]\nuser: ")

    assert chat.main(["--workdir", "W", "--index", "512", "--question", "?"]) == 2
    assert capsys.readouterr().err == ("python -m vitmm.chat: --index 512: scenes_any validation has examples 0 "
                                       "to 511.\n")
    assert chat.main(["--workdir", "W", "--split", "val", "--question", "?"]) == 2
    assert capsys.readouterr().err == ("python -m vitmm.chat: --split val: scenes_any (scenes made on the fly) has the "
                                       "splits ['train', 'validation', 'test'].\n")
