"""The table of loaders: one signature for every source, options checked against the source."""

import inspect
import pathlib

import pytest

from vitmm.interop import convert

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"


def test_every_source_loads_with_one_signature():
    for name, loader in convert.LOADERS.items():
        params = inspect.signature(loader).parameters
        assert list(params)[:3] == ["src", "tower", "image_size"], name
        assert params["tower"].kind is inspect.Parameter.KEYWORD_ONLY and params["tower"].default == "both", name


def test_each_source_gives_the_two_tower_form_and_refuses_what_it_lacks():
    model, params = convert.load("hf", FIXTURES / "hf_vit", tower="vision")
    assert model["text"] is None and set(params) == {"img"}
    model, params = convert.load("timm", FIXTURES / "timm_vit" / "model.safetensors", num_heads=2)
    assert model["text"] is None and model["image"]["num_heads"] == 2
    with pytest.raises(ValueError, match="has no text tower"):
        convert.load("timm", FIXTURES / "timm_vit" / "model.safetensors", tower="text", num_heads=2)
    with pytest.raises(ValueError, match=r"\['quick_gelu'\] do not apply to 'timm'.*num_heads"):
        convert.load("timm", FIXTURES / "timm_vit" / "model.safetensors", quick_gelu=True)
    with pytest.raises(ValueError, match="choose one of"):
        convert.load("keras", FIXTURES / "hf_vit")


def test_language_models_convert_with_their_tokenizer_and_chat_template(tmp_path, capsys):
    import json

    import jax.numpy as jnp
    import numpy as np

    from vitmm import checkpoint
    from vitmm.interop import __main__ as cli
    from vitmm.models.lm import LM

    cli.main(["--from", "gguf", "--src", str(FIXTURES / "gguf_llama" / "tiny.gguf"), "--out", str(tmp_path / "g")])
    config, params = checkpoint.load_config(tmp_path / "g"), checkpoint.load_params(tmp_path / "g")
    ref = np.load(FIXTURES / "gguf_llama" / "io.npz")
    logits = LM(**config["model"]["lm"]).apply({"params": params["lm"]}, jnp.asarray(ref["input_ids"]))
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-5 * np.abs(ref["logits"]).max())
    assert config["chat_template"].startswith("{% for message")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str((tmp_path / "g" / "tokenizer.json").read_text())
    assert tok.encode(str(ref["strings"][0])).ids == ref["encoded_0"].tolist()
    cli.main(["--from", "hf", "--src", str(FIXTURES / "hf_qwen2"), "--out", str(tmp_path / "q")])
    assert checkpoint.load_config(tmp_path / "q")["model"]["lm"]["qkv_bias"]
    with pytest.raises(SystemExit, match="2"):
        cli.main(["--from", "gguf", "--src", str(FIXTURES / "gguf_llama" / "tiny.gguf"), "--out", str(tmp_path / "x"),
                  "--image_size", "224"])
    assert "is a language model" in capsys.readouterr().err
    assert json.loads((tmp_path / "g" / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_an_lm_conversion_stopped_before_its_checkpoint_can_be_run_again(tmp_path, monkeypatch):
    """The tokenizer is written first and the checkpoint last (whole or not at all): a conversion
    stopped between them leaves a folder a rerun completes, not one refused for its checkpoint."""
    from vitmm.interop import convert

    def stopped(*args):
        raise KeyboardInterrupt

    src = FIXTURES / "gguf_llama" / "tiny.gguf"
    monkeypatch.setattr(convert, "write", stopped)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_language_model("gguf", src, tmp_path / "g")
    assert (tmp_path / "g" / "tokenizer.json").is_file() and not (tmp_path / "g" / "checkpoints").exists()
    monkeypatch.undo()
    assert convert.convert_language_model("gguf", src, tmp_path / "g") == tmp_path / "g"
    assert (tmp_path / "g" / "checkpoints").is_dir()


def test_an_hf_lm_without_tokenizer_json_converts_with_a_warning(tmp_path, capsys):
    """A VLM run reads the LM folder's tokenizer: its absence is said at conversion, not at that run."""
    from vitmm.interop import convert

    convert.convert_language_model("hf", FIXTURES / "hf_llama", tmp_path / "lm")
    assert "has no tokenizer.json" in capsys.readouterr().out and not (tmp_path / "lm/tokenizer.json").exists()


def test_an_lm_records_every_eos_id_its_configs_list_and_its_tokenizer_stops_on_each(tmp_path):
    """Gemma-it's ``config.json`` names ``<eos>`` (1) but its turns end with ``<end_of_turn>`` (107),
    which ``generation_config.json`` lists: both are recorded, the first pads. A folder converted
    before ``eos_ids`` were recorded keeps its one id."""
    import json
    import shutil

    from vitmm import checkpoint
    from vitmm.data import tokenizer as tok_lib
    from vitmm.lm_chat import LMChat

    src = tmp_path / "gemma2_it"
    shutil.copytree(FIXTURES / "hf_gemma2", src)
    shutil.copy(FIXTURES / "hf_llava" / "tokenizer.json", src / "tokenizer.json")
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 107]}))
    convert.convert_language_model("hf", src, tmp_path / "lm")
    assert checkpoint.load_config(tmp_path / "lm")["tokens"] == {"bos_id": 2, "pad_id": 0, "eos_id": 1,
                                                                 "eos_ids": [1, 107]}
    assert LMChat(tmp_path / "lm").tokenizer.eos_ids == (1, 107)
    assert tok_lib.get_tokenizer(str(src / "tokenizer.json"), bos_id=2, eos_id=1, pad_id=0).eos_ids == (1,)
    llama3 = convert.special_ids({"eos_token_id": [128001, 128008, 128009]}, generation={"eos_token_id": 128009})
    assert llama3["eos_id"] == 128001 and llama3["eos_ids"] == [128001, 128008, 128009]


def test_a_gguf_lm_records_its_end_of_turn_ids_as_eos():
    """llama.cpp records the end of turn apart from EOS (Gemma-it: ``<eos>`` 1, ``<end_of_turn>`` 107;
    Llama 3: ``<|eot_id|>``, ``<|eom_id|>``): each becomes an EOS id, the GGUF's EOS first (it pads).
    So does every token llama.cpp ends generation on by its text, which its converter writes no key
    for: the SmolLM2-shaped file's ``<|endoftext|>`` (0) after its EOS ``<|im_end|>`` (2), Qwen2.5's
    ``<|endoftext|>`` (151643), as its ``generation_config.json`` lists it."""
    from vitmm.interop import gguf_lm

    gemma = {"tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
             "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.eot_token_id": 107}
    assert convert.gguf_special_ids(gemma) == {"bos_id": 2, "eos_id": 1, "pad_id": 0, "eos_ids": [1, 107]}
    llama3 = {"tokenizer.ggml.eos_token_id": 128009, "tokenizer.ggml.eot_token_id": 128009,
              "tokenizer.ggml.eom_token_id": 128008}
    assert convert.gguf_special_ids(llama3)["eos_ids"] == [128009, 128008]
    metadata, _ = gguf_lm.read_metadata(FIXTURES / "gguf_llama" / "tiny.gguf")
    ids = convert.gguf_special_ids(metadata)
    assert ids["eos_id"] == metadata["tokenizer.ggml.eos_token_id"] == 2 and ids["eos_ids"] == [2, 0]
    tokens = ["a"] * 151665
    tokens[151643], tokens[151644], tokens[151645] = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
    qwen = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.bos_token_id": 151643,
            "tokenizer.ggml.eos_token_id": 151645, "tokenizer.ggml.padding_token_id": 151643}
    assert convert.gguf_special_ids(qwen)["eos_ids"] == [151645, 151643]
    assert convert.gguf_special_ids({"tokenizer.ggml.tokens": ["<eos>", "<|user|>"], "tokenizer.ggml.eos_token_id": 0}
                                    )["eos_ids"] == [0]  # no text of llama.cpp's list: the EOS alone


def test_a_vlm_export_lists_every_eos_id_and_a_reimport_records_them_all():
    """``generation_config.json`` gets every EOS id the run stops on (a list when several, as
    transformers' ``generate`` takes it; one id stays an int), and importing the export reads them
    back: Gemma-it's ``<eos>`` (1), then ``<end_of_turn>`` (107)."""
    from vitmm.data import tokenizer as tok_lib
    from vitmm.interop.vlm.common import generation_ids

    path = str(FIXTURES / "hf_llava" / "tokenizer.json")
    tok = tok_lib.get_tokenizer(path, bos_id=2, eos_id=1, pad_id=0, eos_ids=[1, 107])
    generation = generation_ids(tok)
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0}
    text_config = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}  # what the export's config.json holds
    assert convert.special_ids(text_config, generation=generation)["eos_ids"] == [1, 107]
    assert generation_ids(tok_lib.get_tokenizer(path, bos_id=2, eos_id=1, pad_id=0))["eos_token_id"] == 1


def test_a_list_of_named_chat_templates_gives_the_one_named_default(tmp_path):
    """Some tokenizer_config.json files hold named templates (``[{"name": "default", ...},
    {"name": "tool_use", ...}]``); transformers runs the one named "default", and so does vitmm. A
    list with no "default" is refused in one line naming the file and the names."""
    import json

    from vitmm.interop import io

    named = [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": "{{ messages }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert io.chat_template(tmp_path) == "{{ messages }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ValueError, match=r"^\S*tokenizer_config.json holds chat templates named \['tool_use'\] and "
                                         r"none named 'default'.*chat_template.jinja[^\n]*$"):
        io.chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ plain }}"}))
    assert io.chat_template(tmp_path) == "{{ plain }}"
