"""`vitmm.serve`'s request checks, batching and HTTP edges without a trained model: a fake chat
whose decoder emits fixed tokens, or a tiny tokenizer's prompts (the model-backed tests are in
tests/test_serve.py)."""

import pathlib
import socket
import threading
import time

import pytest

from vitmm import serve
from vitmm.data import ops_text

TOKENIZER = pathlib.Path(__file__).parent / "fixtures/interop/hf_llava/tokenizer.json"  # <|im_start|> 1, <|im_end|> 2


class _FakeChat:
    """A chat whose decoder emits token 7 (``end``, an EOS id, where ``eos_at`` says) one step a
    millisecond, counting its steps: the batcher's bookkeeping without a model. Its EOS ids are 0
    and 9 (an instruct LM's EOS and end of turn)."""

    max_images = 1

    def __init__(self, eos_at=None, text=None, end=0):
        self.eos_at, self.steps, self.end = eos_at or {}, 0, end
        self.tokenizer = type("Tok", (), {"eos_id": 0, "eos_ids": (0, 9),
                                          "decode": staticmethod(text or (lambda ids: "x" * len(ids)))})

    def prepare(self, images, turns):
        return {}

    def stream_batch(self, examples, max_new_tokens, temperature, top_p, seed):
        import numpy as np

        for step in range(max_new_tokens):
            self.steps = step + 1
            time.sleep(0.001)
            yield np.array([self.end if self.eos_at.get(row) == step else 7 for row in range(len(examples))])

    def num_prompt_tokens(self, example):
        return 1


def _request(max_tokens, **more):
    return dict(example={}, max_tokens=max_tokens, temperature=0, top_p=1.0, seed=0, stop=[], **more)


def _engine(chat) -> serve.Engine:
    """An ``Engine`` over ``chat``, model ``"m"``, without a workdir."""
    from vitmm import serve_batching

    engine = serve.Engine.__new__(serve.Engine)
    engine.chat, engine.model_name, engine.local_root = chat, "m", None
    engine.batcher = serve_batching.Batcher(chat)
    return engine


def _refusal(engine, **body) -> serve.RequestError:
    with pytest.raises(serve.RequestError) as err:
        engine.parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    return err.value


def test_the_decoder_stops_when_every_answer_is_complete_or_no_longer_read():
    from vitmm import serve_batching

    chat = _FakeChat(eos_at={0: 2})  # the first request's answer ends at its third token
    batcher = serve_batching.Batcher(chat, window=0.2)
    answers = [None, None]
    threads = [threading.Thread(target=lambda i=i, n=n: answers.__setitem__(i, list(batcher.submit(_request(n)))))
               for i, n in enumerate((1000, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert answers == [[7, 7, 0], [7, 7, 7]] and batcher.batch_sizes == [2] and chat.steps == 3  # not 1000
    chat.steps = 0
    reader = batcher.submit(_request(1000))
    assert [next(reader), next(reader)] == [7, 7]
    reader.close()  # a stop string found, or the client gone
    time.sleep(0.5)
    assert chat.steps < 100
    gone = threading.Event()
    gone.set()  # its client went away while it waited in the queue: no decode (no prefill) for it
    seen = len(batcher.batch_sizes)
    assert list(batcher.submit(_request(5, cancelled=gone))) == [] and batcher.batch_sizes[seen:] == []


def test_a_character_spelled_out_over_several_tokens_is_streamed_whole():
    """A byte-fallback tokenizer (Llama 2's, Mistral's, Gemma's) decodes each pending byte of a
    character as U+FFFD until the character is complete: none of them may reach the client."""
    data = "X€Y".encode()  # € is three bytes: three tokens

    def decode(ids):
        raw = bytes(data[i - 1] for i in ids)
        for cut in range(len(raw), -1, -1):
            try:
                return raw[:cut].decode() + "\ufffd" * (len(raw) - cut)
            except UnicodeDecodeError:
                continue

    chat = _FakeChat(text=decode)
    chat.stream_batch = lambda examples, n, *a: iter([[k] for k in range(1, len(data) + 1)] + [[0]])
    pieces = list(_engine(chat).completion(_request(16)))
    assert "".join(p for p, end in pieces) == "X€Y" and not any("\ufffd" in p for p, _ in pieces)
    assert pieces[-1][1][0] == "stop"


@pytest.mark.parametrize("text, stop, expected", [("x 🤖🤖 y", "🤖🤖", "x "), ("私は日本人です", "日本", "私は"),
                                                   ("ab€€c", "€€", "ab")])
def test_a_stop_string_starting_with_a_multibyte_character_shows_none_of_it(text, stop, expected):
    """One token a byte (``ByteTokenizer``): while the stop string's second character is spelled out
    the text ends in U+FFFD, which must not use up the hold, so its first character is never sent."""
    from vitmm.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    chat = _FakeChat(text=tok.decode)
    chat.stream_batch = lambda examples, n, *a: iter([[k] for k in tok.encode(text)] + [[0]])
    pieces = list(_engine(chat).completion({**_request(64), "stop": [stop]}))
    assert "".join(p for p, end in pieces) == expected and pieces[-1][1][0] == "stop"


@pytest.mark.parametrize("stop", [["yz", "z"], ["z", "yz"]])
def test_the_text_ends_before_the_earliest_stop_string_whichever_is_listed_first(stop):
    """The token that spells out ``z`` completes both stop strings at once (``xyz``: "yz" at 1, "z"
    at 2); OpenAI's API ends the text before the first one in the text, "x", in any order."""
    from vitmm.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    chat = _FakeChat(text=tok.decode)
    chat.stream_batch = lambda examples, n, *a: iter([[k] for k in tok.encode("xyzw")] + [[0]])
    pieces = list(_engine(chat).completion({**_request(64), "stop": stop}))
    assert "".join(p for p, end in pieces) == "x" and pieces[-1][1][0] == "stop"


def test_a_port_in_use_is_refused_in_one_line_before_the_model_loads(tmp_path):
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "vitmm.serve", "--workdir", str(tmp_path / "never_read"),
                              "--port", str(port)], capture_output=True, text=True, timeout=120,
                             cwd=str(serve.__file__).rsplit("/vitmm/", 1)[0])
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        f"python -m vitmm.serve: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use); "
        "check --host, choose another --port, or stop what holds it."]


@pytest.mark.parametrize("name", ["missing", "a_file.txt", ""])
def test_allow_local_files_that_is_not_a_folder_is_refused_at_startup_in_one_line(tmp_path, capsys, name):
    (tmp_path / "a_file.txt").write_text("x")
    folder = str(tmp_path / name) if name else ""
    # refused before the port is taken or the (here nonexistent) workdir is read
    assert serve.main(["--workdir", str(tmp_path / "never_read"), "--port", "0", "--allow_local_files", folder]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m vitmm.serve: --allow_local_files {folder!r} is not a folder; give an existing folder "
                   "to serve local images from."]


@pytest.mark.parametrize("body, param, message", [
    ({"stream_options": "yes"}, "stream_options", "'stream_options' must be an object"),
    ({"stream": True, "stream_options": ["x"]}, "stream_options", "'stream_options' must be an object"),
    ({"stream": "false"}, "stream", "'stream' must be true or false; got 'false'."),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "'stream_options.include_usage' must be true or false"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role",
     "must be system, developer, user or assistant; got 'robot'."),
    ({"n": 2}, "n", "'n' must be 1 (one choice a request); got 2."),
    ({"n": True}, "n", "'n' must be 1 (one choice a request); got True."),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content",
     "a text part whose 'text' is not a string: 5"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "/data/clip.mp4"}}]}]},
     "messages[0].content", "Local video paths are refused; start the server with --allow_local_files ROOT, or send "
     "the video as a base64 data URL."),
], ids=["options-string", "options-list", "stream-string", "include-usage-string", "role", "n", "n-true",
      "text-part", "local-video"])
def test_malformed_settings_and_parts_are_400s_naming_the_param(body, param, message):
    err = _refusal(_engine(_FakeChat()), **body)
    assert err.status == 400 and err.param == param and message in str(err)
    parsed = _engine(_FakeChat()).parse({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                        "stream": None, "stream_options": None, "n": None})
    assert parsed["stream"] is False and parsed["include_usage"] is False  # null: the defaults, as OpenAI's


def test_a_chat_templates_refusal_is_a_400_naming_it():
    """A template's ``raise_exception`` (Gemma's on a system turn) is the client's error, not the server's."""
    from vitmm.data import tokenizer as tok_lib
    from vitmm.lm_chat import LMChat

    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    chat = LMChat.__new__(LMChat)
    chat.tokenizer = tok_lib.get_tokenizer(str(TOKENIZER), bos_id=1, eos_id=2, pad_id=0, chat_template=template)
    chat._tokens = ops_text.conversation_tokens(64, chat.tokenizer)
    example = chat.prepare([], [{"from": "human", "value": "hi"}])
    assert list(example["ids"][:example["prompt_len"]]) == chat.tokenizer.encode("<|im_start|>hi<|im_end|>")
    err = _refusal(_engine(chat), messages=[{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "hi"}])
    assert err.status == 400 and err.param == "messages"
    assert str(err) == "The model's chat template refuses this conversation: System role not supported"


def test_every_eos_id_ends_an_answer_in_serve_lm_chat_and_chat():
    """An instruct LM's end of turn (9 here; Llama 3's <|eot_id|>, Gemma's <end_of_turn>) ends the
    answer as its EOS does: ``finish_reason`` stop, nothing of it in the text, no step more."""
    from vitmm.chat import Chat
    from vitmm.lm_chat import LMChat

    chat = _FakeChat(eos_at={0: 2}, end=9)
    pieces = list(_engine(chat).completion(_request(1000)))
    assert "".join(p for p, _ in pieces) == "xx" and pieces[-1][1][0] == "stop" and chat.steps == 3
    assert pieces[-1][1][1]["completion_tokens"] == 3  # the end of turn was generated: counted, as vLLM counts it
    for cls in (LMChat, Chat):
        asked = cls.__new__(cls)
        asked._flat, asked.tokenizer = True, chat.tokenizer
        asked.stream_batch = lambda examples, n, *a: iter([[7], [9], [7]])
        assert list(asked.generate({"more_images": [None]}, 16)) == [7, 9]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("text", [None, lambda ids: ""], ids=["text", "no_text"])
def test_a_request_stops_decoding_when_its_client_goes_away(text, stream):
    """The client sends a request for 4,000 tokens and hangs up: its row stops within a fraction of
    a second instead of decoding to the end for no one (clients that time out and retry piled such
    decodes up, and the decoder serves no one else meanwhile), streamed or not, also when its tokens
    decode to no text (special tokens that are not EOS)."""
    import json

    chat = _FakeChat(text=text)
    url, stop = serve.start_in_thread(_engine(chat))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                       "temperature": 0, "stream": stream}).encode()
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 10
            while chat.steps < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.3)
        stopped_at = chat.steps
        time.sleep(0.3)
        assert 20 <= stopped_at == chat.steps < 4000
    finally:
        stop()


def test_a_failure_mid_stream_reaches_the_openai_client_as_an_error():
    """Once a stream has begun its status is sent: a failure after that is an error event in OpenAI's
    shape, which the openai client raises with the message, not a cut connection ("Connection error.")."""
    import openai

    chat = _FakeChat()

    def fails(examples, max_new_tokens, *args):
        yield [7]
        raise RuntimeError("the device fell over")

    chat.stream_batch = fails
    url, stop = serve.start_in_thread(_engine(chat))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, temperature=0, stream=True)
        with pytest.raises(openai.APIError, match="RuntimeError: the device fell over"):
            list(stream)
    finally:
        stop()
