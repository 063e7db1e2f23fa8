"""`vitmm.serve`: the OpenAI Chat Completions API over a trained VLM workdir, asked with the real
`openai` client (and raw HTTP for malformed requests) on a server the test starts on a free port."""

import base64
import importlib
import json
import pathlib
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from vitmm import serve
from vitmm.config_args import load
from vitmm.data import examples, scenes
from vitmm.train import trainer


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A LLaVA-style smoke VLM (text-only examples mixed in) served on 127.0.0.1."""
    root = tmp_path_factory.mktemp("serve")
    examples.write_llava(root / "data", 16, resolution=32, text_only_every=4)
    config = load("configs/llava_pretrain.py", "smoke", **{"input.data_path": str(root / "data/data.json")})
    trainer.train(config, root / "vlm_smoke")
    engine = serve.Engine(root / "vlm_smoke", allow_local_files=root / "data")
    url, stop = serve.start_in_thread(engine)
    yield dict(url=url, engine=engine, root=root)
    stop()


def _http(url: str, body: bytes | None = None) -> tuple[int, dict]:
    """``(status, JSON body)`` of a raw GET (or POST of ``body``)."""
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(examples.encode(image, "png")).decode()


def _ask(image, question):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                         {"type": "text", "text": question}]}]


IMAGE = scenes.generate("easy", 32, 3)["image"]


def test_the_openai_client_gets_what_vitmm_chat_answers_with_usage(server):
    reply = _client(server).chat.completions.create(model="vlm_smoke", messages=_ask(IMAGE, "Describe the image."),
                                                    max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == server["engine"].chat.ask(IMAGE, "Describe the image.", 6)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.model == "vlm_smoke"
    example = server["engine"].chat.prepare([IMAGE], [{"from": "human", "value": "<image>\nDescribe the image."}])
    visual = server["engine"].chat._num_visual(example["image"])
    assert reply.usage.prompt_tokens == int(example["prompt_len"]) + visual
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert 1 <= reply.usage.completion_tokens <= 6


def test_streaming_gives_the_same_text_and_usage_last(server):
    client = _client(server)
    kwargs = dict(model="vlm_smoke", messages=_ask(IMAGE, "What is there?"), max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    plain = list(client.chat.completions.create(stream=True, **kwargs))  # usage only when asked: every chunk a choice
    assert all(c.choices for c in plain) and "".join(c.choices[0].delta.content or "" for c in plain) == text


def test_text_only_multi_turn_seeded_sampling_and_stop_strings(server):
    client = _client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell 'red'."},
                {"role": "assistant", "content": "r e d"}, {"role": "user", "content": "And 'blue'?"}]
    greedy = client.chat.completions.create(model="vlm_smoke", messages=messages, max_tokens=8, temperature=0)
    assert isinstance(greedy.choices[0].message.content, str)
    sampled = [client.chat.completions.create(model="vlm_smoke", messages=messages, max_tokens=8, temperature=1.0,
                                              top_p=0.9, seed=7).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed, the same draw
    text = client.chat.completions.create(model="vlm_smoke", messages=_ask(IMAGE, "?"), max_tokens=8,
                                          temperature=0).choices[0].message.content
    if len(text) >= 2:
        stop = text[1]
        cut = client.chat.completions.create(model="vlm_smoke", messages=_ask(IMAGE, "?"), max_tokens=8,
                                             temperature=0, stop=[stop])
        assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"



def test_a_reply_is_to_the_last_question_with_the_earlier_turns_in_its_prompt(server):
    """The prompt runs to the last (empty) answer, not the first; a conversation too long to keep its
    last question is refused, not answered as its first exchange."""
    chat = server["engine"].chat
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Spell 'red'."},
             {"from": "gpt", "value": "r e d"}, {"from": "human", "value": "And 'blue'?"}]
    example = chat.prepare([], turns)
    prompt = chat.tokenizer.decode(list(example["ids"][: int(example["prompt_len"])]))
    assert "Spell 'red'." in prompt and "r e d" in prompt and prompt.rstrip().endswith("And 'blue'?")
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 4} for i in range(21)]
    status, body = _http(server["url"] + "/v1/chat/completions",
                         json.dumps({"model": "vlm_smoke", "messages": long, "max_tokens": 4}).encode())
    assert status == 400 and "too long for this model" in body["error"]["message"]


def test_models_health_and_a_local_file_under_the_allowed_folder(server):
    assert [m.id for m in _client(server).models.list()] == ["vlm_smoke"]
    assert _http(server["url"] + "/health") == (200, {"status": "ok", "model": "vlm_smoke"})
    path = server["root"] / "data/images/000000.jpg"
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}},
                                             {"type": "text", "text": "?"}]}]
    reply = _client(server).chat.completions.create(model="vlm_smoke", messages=messages, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1
    # The same file as file://localhost/…, as a path relative to the allowed folder, and inline as base64 with
    # MIME line breaks: the same prompt each time.
    wrapped = base64.encodebytes(path.read_bytes()).decode()  # a line break every 76 characters
    engine = server["engine"]
    same = [engine.parse({"model": "vlm_smoke", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]})["example"]["image"]
        for url in (f"file://{path}", f"file://localhost{path}", "images/000000.jpg",
                    "data:image/jpeg;base64," + wrapped)]
    assert all((image == same[0]).all() for image in same[1:])


PNG = _data_url(IMAGE)
def _huge_png() -> str:
    """A 7000 × 7000 PNG of ~10 KB (one bit a pixel): refused from its header, never decoded."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (7000, 7000)).save(buffer, "png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


HUGE = _huge_png()
BAD = [
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ("no messages", {"model": "vlm_smoke", "messages": []}, 400, "'messages' must be a non-empty list"),
    ("bad role", {"model": "vlm_smoke", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role must be"),
    ("bad base64", {"model": "vlm_smoke", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]}, 400, "not valid base64"),
    ("not an image", {"model": "vlm_smoke", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hello").decode()}}]}]},
     400, "cannot be decoded"),
    ("remote url", {"model": "vlm_smoke", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}]}]}, 400, "not fetched"),
    ("outside the allowed folder", {"model": "vlm_smoke", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "/etc/hostname"}}]}]}, 403, "outside --allow_local_files"),
    ("two images", {"model": "vlm_smoke", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG}}, {"type": "image_url", "image_url": {"url": PNG}}]}]},
     400, "at most 1"),
    ("max_tokens 0", {"model": "vlm_smoke", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "'max_tokens' must be an integer in [1, 4096]"),
    ("temperature 3", {"model": "vlm_smoke", "messages": [{"role": "user", "content": "hi"}], "temperature": 3},
     400, "'temperature' must be a number"),
    ("ends with the assistant", {"model": "vlm_smoke", "messages": [{"role": "assistant", "content": "hi"}]},
     400, "must end with a user turn"),
    ("too many pixels", {"model": "vlm_smoke", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": HUGE}}]}]}, 413, "7000x7000, more than 40,000,000 pixels"),
    ("temperature NaN", {"model": "vlm_smoke", "messages": [{"role": "user", "content": "hi"}],
                         "temperature": float("nan")}, 400, "'temperature' must be a number"),
    ("max_completion_tokens 0", {"model": "vlm_smoke", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": None, "max_completion_tokens": 0}, 400,
     "'max_completion_tokens' must be an integer"),
]


@pytest.mark.parametrize("body, status, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors_and_the_server_carries_on(server, body, status, message):
    code, reply = _http(server["url"] + "/v1/chat/completions", json.dumps(body).encode())
    assert code == status
    assert message in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    assert _http(server["url"] + "/health")[0] == 200


def test_malformed_json_and_the_openai_clients_exception(server):
    code, reply = _http(server["url"] + "/v1/chat/completions", b"{not json")
    assert code == 400 and "not valid JSON" in reply["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(server).chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    assert _http(server["url"] + "/v1/nothing")[1]["error"]["code"] == "not_found"


def test_sigterm_answers_the_request_in_flight_then_exits_0(server):
    """``python -m vitmm.serve`` itself: a request sent just before SIGTERM is answered, then the
    server exits with status 0."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "vitmm.serve", "--workdir", str(server["root"] / "vlm_smoke"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(serve.__file__).rsplit("/vitmm/", 1)[0]})
    try:
        assert proc.stdout.readline().startswith("serving 'vlm_smoke'")
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if _http(url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        body = {"model": "vlm_smoke", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32,
                "temperature": 0}
        answer = {}
        thread = threading.Thread(target=lambda: answer.update(
            result=_http(url + "/v1/chat/completions", json.dumps(body).encode())))
        thread.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert answer["result"][0] == 200 and answer["result"][1]["usage"]["completion_tokens"] >= 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_concurrent_requests_are_decoded_together_and_answered_as_alone(server):
    """Six greedy requests at once (with and without images, different lengths and budgets) share
    decodes, and each gets exactly the answer it gets alone."""
    client = _client(server)
    requests = [dict(messages=_ask(scenes.generate("easy", 32, i)["image"], "Describe it." + "?" * i),
                     max_tokens=4 + i) for i in range(4)]
    requests += [dict(messages=[{"role": "user", "content": "Spell 'blue'" + "!" * i}], max_tokens=6) for i in range(2)]
    alone = [client.chat.completions.create(model="vlm_smoke", temperature=0, **r).choices[0].message.content
             for r in requests]
    batcher = server["engine"].batcher
    batcher.window, seen = 0.5, len(batcher.batch_sizes)
    try:
        answers = [None] * len(requests)

        def ask(i):
            answers[i] = client.chat.completions.create(model="vlm_smoke", temperature=0,
                                                        **requests[i]).choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        batcher.window = 0.005
    assert answers == alone
    assert max(batcher.batch_sizes[seen:]) > 1 and sum(batcher.batch_sizes[seen:]) == len(requests)


def test_the_load_test_runs_and_reports_both_ways(server, tmp_path):
    result = importlib.import_module("experiments.bench.serve").main([
        "--workdir", str(server["root"] / "vlm_smoke"), "--requests", "4", "--clients", "2", "--max_tokens", "2",
        "--warmup", "1", "--out", str(tmp_path)])
    assert result["same_answers"] and result["one_client"]["tokens"] == result["concurrent"]["tokens"]
    assert result["batch_sizes"]["decodes"] >= 1 and (tmp_path / "bench_serve.md").is_file()


@pytest.fixture(scope="session")
def lm_server(tmp_path_factory):
    """A converted GGUF LM folder served text-only, its weights scaled up so that greedy answers
    differ from prompt to prompt (the fixture's tiny random LM answers every prompt alike)."""
    import jax

    from vitmm.interop import __main__ as interop

    root = tmp_path_factory.mktemp("lm")
    fixture = pathlib.Path(__file__).parent / "fixtures/interop/gguf_llama/tiny.gguf"
    interop.main(["--from", "gguf", "--src", str(fixture), "--out", str(root / "tiny_lm")])
    engine = serve.Engine(root / "tiny_lm")
    engine.chat.params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "scale" in jax.tree_util.keystr(path) else x * 30, engine.chat.params)
    url, stop = serve.start_in_thread(engine)
    yield dict(url=url, engine=engine, folder=root / "tiny_lm")
    stop()


def test_an_lm_folder_is_served_text_only_as_its_generator_answers(lm_server):
    """Each answer is the generator's greedy continuation of the chat template's prompt (rendered and
    tokenized here as transformers' apply_chat_template does), whether asked alone or together."""
    from vitmm import decode

    client = _client(lm_server)
    chat = lm_server["engine"].chat
    assert [m.id for m in client.models.list().data] == ["tiny_lm"]
    questions = ["hello there", "what is 2+2? answer", "zebra quantum fox", "a"]
    expected = []
    for question in questions:
        prompt = chat.tokenizer.encode(chat.tokenizer.chat([{"role": "user", "content": question}],
                                                           add_generation_prompt=True))
        ids, mask = decode.left_pad([prompt], chat.tokenizer.pad_id)
        row = list(chat.generator.generate(chat.params, ids, mask, 6, chat.tokenizer.eos_id)[0])
        expected.append((chat.tokenizer.decode(row[: row.index(chat.tokenizer.eos_id)] if chat.tokenizer.eos_id in row
                                               else row), len(prompt)))
    assert len({text for text, _ in expected}) == len(questions)

    def ask(question):
        reply = client.chat.completions.create(model="tiny_lm", max_tokens=6, temperature=0,
                                               messages=[{"role": "user", "content": question}])
        return reply.choices[0].message.content, reply.usage.prompt_tokens

    assert [ask(q) for q in questions] == expected
    answers = [None] * len(questions)
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(questions[i])))
               for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == expected
    assert max(lm_server["engine"].batcher.batch_sizes) > 1
    status, body = _http(lm_server["url"] + "/v1/chat/completions", json.dumps({
        "model": "tiny_lm", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": PNG}}, {"type": "text", "text": "what is it?"}]}]}).encode())
    assert status == 400 and "language model" in body["error"]["message"]


def test_vitmm_chat_refuses_an_image_or_a_video_for_a_language_model_in_one_line(lm_server, capsys):
    from vitmm import chat

    for flag in ("--image", "--video"):
        assert chat.main(["--workdir", str(lm_server["folder"]), "--question", "?", flag, "clip.mp4"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"python -m vitmm.chat: {lm_server['folder']} is a language model; it takes no {flag}."]


def test_vitmm_chat_refuses_a_workdir_that_is_not_a_vlm_in_one_line(clip_smoke_run, capsys):
    from vitmm import chat

    assert chat.main(["--workdir", str(clip_smoke_run.workdir), "--question", "what is it?"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m vitmm.chat: ") and "not a VLM" in err[0]


def test_a_body_over_the_limit_is_refused_413_by_its_length_or_as_it_streams_in(server):
    """``--max_request_mb``: a body whose Content-Length is over the limit, and one sent chunked
    with no length, are each refused (413, OpenAI's error shape) naming the flag; under it, answered."""
    import http.client
    import urllib.parse

    url, stop = serve.start_in_thread(server["engine"], max_request_mb=0.002)  # 2,000 bytes
    try:
        name = server["engine"].model_name
        small = json.dumps(dict(model=name, messages=[{"role": "user", "content": "Spell 'red'"}], max_tokens=1))
        big = json.dumps(dict(model=name, messages=[{"role": "user", "content": "x" * 3000}], max_tokens=1))
        assert _http(url + "/v1/chat/completions", small.encode())[0] == 200
        code, reply = _http(url + "/v1/chat/completions", big.encode())
        assert code == 413 and "--max_request_mb" in reply["error"]["message"]
        netloc = urllib.parse.urlsplit(url).netloc
        connection = http.client.HTTPConnection(netloc, timeout=30)
        connection.request("POST", "/v1/chat/completions", body=iter([big[:1500].encode(), big[1500:].encode()]),
                           headers={"content-type": "application/json"}, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413
        assert "over the server's limit of 0.002 MB" in json.loads(response.read())["error"]["message"]
        connection.close()
        assert _http(url + "/health")[0] == 200
    finally:
        stop()
