"""Byte tokenizer, local Hugging Face tokenizer.json, explicit truncation."""

import json

import numpy as np
import pytest

from vitmm.data import tokenizer as tok_lib


def test_byte_tokenizer_round_trip_and_specials():
    tok = tok_lib.ByteTokenizer()
    text = "a red circle — ünïcode"
    assert tok.decode(tok.encode(text)) == text
    out = tok_lib.tokenize(tok, "hi", 6)
    np.testing.assert_array_equal(out.ids, [257, ord("h") + 1, ord("i") + 1, 258, 0, 0])
    assert (out.length, out.truncated) == (4, False)
    assert out.ids.argmax() == 3  # EOS has the largest id: CLIP's argmax finds it
    sticky = tok_lib.tokenize(tok, "hi", 6, padding="eos")
    np.testing.assert_array_equal(sticky.ids[3:], [258, 258, 258])


def test_truncation_is_explicit_and_keeps_eos():
    tok = tok_lib.ByteTokenizer()
    out = tok_lib.tokenize(tok, "abcdefgh", 5)
    assert out.truncated and out.length == 5
    np.testing.assert_array_equal(out.ids, [257, 98, 99, 100, 258])
    with pytest.raises(ValueError, match="does not fit max_len=5"):
        tok_lib.tokenize(tok, "abcdefgh", 5, truncation="error")
    with pytest.raises(ValueError, match="truncation="):
        tok_lib.tokenize(tok, "a", 5, truncation="left")


def _write_word_level_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "a": 4, "red": 5, "circle": 6}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    json.loads(path.read_text())  # a real tokenizer.json


def test_hf_tokenizer_from_local_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    _write_word_level_tokenizer(path)
    tok = tok_lib.get_tokenizer(str(path))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 7)
    out = tok_lib.tokenize(tok, "a red blue circle", 8)
    np.testing.assert_array_equal(out.ids, [1, 4, 5, 3, 6, 2, 0, 0])
    assert tok.decode(out.ids) == "a red <unk> circle"


def test_hf_tokenizer_missing_file_and_missing_specials(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        tok_lib.HFTokenizer(tmp_path / "nope.json")
    from tokenizers import Tokenizer, models

    path = tmp_path / "bare.json"
    Tokenizer(models.WordLevel(vocab={"x": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(ValueError, match="bos_id="):
        tok_lib.HFTokenizer(path)
    assert tok_lib.HFTokenizer(path, bos_id=0, eos_id=1).pad_id == 1  # pads with EOS


def test_word_tokenizer_round_trips_closed_vocabulary_and_marks_unknown_words():
    from vitmm.data.tokenizer import WordTokenizer

    corpus = ["what colour is the shape at the top left?", "is there a star?", "yes", "no", "red"]
    tok = WordTokenizer.from_texts(corpus)
    assert tok.words[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"] and tok.vocab_size == len(tok.words)
    assert WordTokenizer.from_texts(reversed(corpus)).words == tok.words  # sorted: order-independent ids
    for text in corpus:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("is there a hexagon?")[3] == tok.unk_id
    ids = tok.encode("is there a star?")
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "is there a star?"
    with pytest.raises(ValueError, match="unique"):
        WordTokenizer(["a", "a"])


def test_truncation_and_padding_saved_in_a_tokenizer_json_are_ignored_as_transformers_does(tmp_path):
    """``enable_truncation``/``enable_padding`` are saved in ``tokenizer.json``; transformers resets
    them on every call, and ``tokenize`` must see the whole text to report it truncated."""
    import pathlib

    from tokenizers import Tokenizer

    src = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/hf_llava/tokenizer.json"
    text = "a long sentence about a red circle that goes on"
    plain = tok_lib.HFTokenizer(src, bos_id=1, eos_id=2)
    saved = Tokenizer.from_file(str(src))
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=32, pad_id=2)
    saved.save(str(tmp_path / "tokenizer.json"))
    tok = tok_lib.HFTokenizer(tmp_path / "tokenizer.json", bos_id=1, eos_id=2)
    assert len(plain.encode(text)) > 4
    assert tok.encode(text) == plain.encode(text)
    assert tok.encode_offsets(text) == plain.encode_offsets(text)
    assert tok_lib.tokenize(tok, text, 6).truncated


def test_a_file_that_is_not_a_tokenizer_json_is_named_in_one_line(tmp_path):
    """tokenizers' own ``Exception: expected `,` or `}` …`` reached the console as a traceback, exit 1."""
    for text in ('{"a": 1, "b":', '{"a": 1}', "\x00\x01"):
        bad = tmp_path / "tokenizer.json"
        bad.write_text(text)
        with pytest.raises(ValueError) as err:
            tok_lib.HFTokenizer(bad)
        message = str(err.value)
        assert message.startswith(f"{bad} is not a tokenizer.json the tokenizers library reads (")
        assert "\n" not in message
        assert message.endswith("; pass the tokenizer.json of a Hugging Face model folder.")
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="No tokenizer.json at"):
        tok_lib.HFTokenizer(folder)
