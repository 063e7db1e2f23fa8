"""The model behind ``vitmm.serve``'s API: ``Engine`` checks an OpenAI Chat Completions request
(messages, images, sampling settings) and answers it with the run's ``vitmm.chat.Chat`` (or a
converted LM's ``LMChat``), greedy requests batched by ``vitmm.serve_batching.Batcher``;
``RequestError`` is a refusal in OpenAI's error shape."""

import base64
import binascii
import io
import math
import pathlib
import secrets
import time

import numpy as np

from vitmm import serve_batching
from vitmm.data.skips import BadExample

MAX_TOKENS = 4096  # the most tokens a request may ask for
MAX_IMAGE_BYTES = 20 * 2**20
MAX_VIDEO_BYTES = 64 * 2**20  # a video_url part
MAX_IMAGE_PIXELS = 40_000_000


class RequestError(Exception):
    """A request the server refuses: OpenAI's error body with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class Engine:
    """A VLM workdir (or an LM folder) behind the API: request checks, prompts, generation
    (concurrent greedy requests decoded together by ``serve_batching.Batcher``, sampled ones alone)."""

    def __init__(self, workdir, model_name: str | None = None, allow_local_files=None, max_batch: int = 8,
                 window_ms: float = 5.0):
        from vitmm import chat

        self.chat = chat.load(workdir)
        self.model_name = model_name or pathlib.Path(workdir).expanduser().resolve().name
        self.local_root = pathlib.Path(allow_local_files).expanduser().resolve() if allow_local_files else None
        self.created = int(time.time())
        self.batcher = serve_batching.Batcher(self.chat, max_batch, window_ms / 1000)

    # --- requests ----------------------------------------------------------------------------
    def parse(self, body) -> dict:
        """The checked request: ``images``, ``turns`` (LLaVA's), and the sampling settings."""
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object.")
        if body.get("model") != self.model_name:
            raise RequestError(f"The model {body.get('model')!r} does not exist; this server has {self.model_name!r}.",
                               404, "model", "model_not_found")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list.", param="messages")
        images, turns, videos = [], [], []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ("system", "user", "assistant", "developer"):
                raise RequestError(f"messages[{i}].role must be system, developer, user or assistant; got {role!r}.",
                                   param=f"messages[{i}].role")
            text = self._content(message.get("content"), i, images, videos)
            turns.append({"from": {"user": "human", "assistant": "gpt"}.get(role, "system"), "value": text})
        limit = self.chat.max_images
        if len(images) > limit:
            raise RequestError(f"{len(images)} images; this model takes at most {limit} per request"
                               f"{' (a language model)' if limit == 0 else ''}.", param="messages")
        length_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = 256 if body.get(length_key) is None else body[length_key]  # (null: the default, as OpenAI's)
        temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
        temperature = 1.0 if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        _check_number(length_key, max_tokens, 1, MAX_TOKENS, integer=True)
        _check_number("temperature", temperature, 0.0, 2.0)
        _check_number("top_p", top_p, 0.0, 1.0)  # 0: the most likely token only, as OpenAI takes it
        seed = body.get("seed")
        if seed is None:  # no seed: a draw of its own each request (OpenAI's way), not always the same one
            seed = secrets.randbelow(2**31)
        _check_number("seed", seed, 0, 2**31 - 1, integer=True)
        n = body.get("n", 1)
        if n is not None and (type(n) is not int or n != 1):  # an integer 1 (True and 1.0 compare equal to it)
            raise RequestError(f"'n' must be 1 (one choice a request); got {body['n']!r}.", param="n")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a string or a list of at most 4 non-empty strings.", param="stop")
        if len(videos) > 1:
            raise RequestError(f"{len(videos)} videos; one a request.", param="messages")
        if videos and limit == 0:
            raise RequestError("This is a language model: it takes no video.", param="messages")
        try:
            example = self.chat.prepare(images, turns, videos[0]) if videos else self.chat.prepare(images, turns)
        except (ValueError, BadExample) as err:  # BadExample: e.g. an image too narrow for the processor
            raise RequestError(str(err), param="messages") from None
        stream, include_usage = _stream_settings(body)
        return dict(example=example, max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                    seed=int(seed), stop=stop, stream=stream, include_usage=include_usage)

    def _content(self, content, i: int, images: list, videos: list) -> str:
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts.",
                               param=f"messages[{i}].content")
        text = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content has a text part whose 'text' is not a string: "
                                       f"{part.get('text')!r}"[:200], param=f"messages[{i}].content")
                text.append(part["text"])
            elif kind == "image_url":
                url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
                limit = self.chat.max_images
                if len(images) >= limit:  # before decoding any more of them
                    raise RequestError(f"More than {limit} images; this model takes at most {limit} per request"
                                       f"{' (a language model)' if limit == 0 else ''}.", param="messages")
                images.append(self._image(url, i))
                text.append("<image>" + self.chat.image_separator)  # the run's own: LLaVA's \n, or none
            elif kind == "video_url":  # vLLM's part for a video: a data URL or a local file
                url = (part.get("video_url") or {}).get("url") if isinstance(part.get("video_url"), dict) else None
                videos.append(self._bytes(url, f"messages[{i}].content", "video"))
                text.append("<video>\n")
            else:
                raise RequestError(f"messages[{i}].content has a part of type {kind!r}; use text, image_url or "
                               "video_url.",
                                   param=f"messages[{i}].content")
        return "".join(text)

    def _image(self, url, i: int) -> np.ndarray:
        from vitmm.data.images import decode_image

        param = f"messages[{i}].content"
        data = self._bytes(url, param, "image")
        try:  # its size from the header first: a huge image is refused before it is decoded
            from PIL import Image

            with Image.open(io.BytesIO(data)) as header:
                width, height = header.size
        except Exception:  # noqa: BLE001 - not an image PIL can read: decode_image names why below
            width = height = 0
        if width * height > MAX_IMAGE_PIXELS:
            raise RequestError(f"The image is {width}x{height}, more than {MAX_IMAGE_PIXELS:,} pixels.", 413, param)
        try:
            image = decode_image(data, alpha="keep")  # transparency kept for the run's pp decode
        except BadExample as bad:
            raise RequestError(f"The image cannot be decoded ({bad.detail or bad.reason}).", param=param) from None
        if image.shape[0] * image.shape[1] > MAX_IMAGE_PIXELS:
            raise RequestError(f"The image is {image.shape[1]}x{image.shape[0]}, more than {MAX_IMAGE_PIXELS:,} "
                               "pixels.", 413, param)
        return image

    def _bytes(self, url, param: str, kind: str) -> bytes:
        """The bytes of an ``image_url``/``video_url`` part: a base64 data URL or a local file."""
        if not isinstance(url, str) or not url:
            raise RequestError(f"An {kind}_url part needs a url.", param=param)
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if ";base64" not in header:
                raise RequestError(f"An {kind} data URL must be base64 (data:{kind}/...;base64,...).", param=param)
            try:
                data = base64.b64decode("".join(payload.split()), validate=True)  # (MIME-style line breaks)
            except (binascii.Error, ValueError):
                raise RequestError(f"The {kind} data URL is not valid base64.", param=param) from None
        elif url.startswith(("http://", "https://")):
            raise RequestError(f"Remote {kind} URLs are not fetched; send the {kind} as a base64 data URL.",
                               param=param)
        else:
            data = self._local_file(url.removeprefix("file://localhost").removeprefix("file://"), param, kind)
        limit = MAX_IMAGE_BYTES if kind == "image" else MAX_VIDEO_BYTES
        if len(data) > limit:
            raise RequestError(f"The {kind} is {len(data):,} bytes, more than {limit:,}.", 413, param)
        return data

    def _local_file(self, path: str, param: str, kind: str = "image") -> bytes:
        if self.local_root is None:
            raise RequestError(f"Local {kind} paths are refused; start the server with --allow_local_files ROOT, or "
                               f"send the {kind} as a base64 data URL.", param=param)
        resolved = (self.local_root / pathlib.Path(path).expanduser()).resolve()  # a relative path: under the root
        if not resolved.is_relative_to(self.local_root):
            raise RequestError(f"{path} is outside --allow_local_files {self.local_root}.", 403, param)
        try:
            return resolved.read_bytes()
        except OSError:
            raise RequestError(f"Cannot read {path}.", param=param) from None

    # --- generation --------------------------------------------------------------------------
    def completion(self, request: dict):
        """Yields ``(text delta, None)`` pieces, then ``("", (finish_reason, usage))``. A stop string
        ends the text before it; text that could still become one is held back until it cannot."""
        tokenizer, stops = self.chat.tokenizer, request["stop"]
        hold = max((len(s) for s in stops), default=1) - 1
        prompt = self.chat.num_prompt_tokens(request["example"])
        tokens, shown, finish, text, ended = [], "", "length", "", 0
        for token in self.batcher.submit(request):
            if token in tokenizer.eos_ids:  # any of them: an instruct LM's end of turn too
                finish, ended = "stop", 1  # generated, so counted in the usage (as vLLM does), never shown
                break
            tokens.append(token)
            text = tokenizer.decode(tokens)
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            # a character still being spelled out (byte-fallback tokenizers show each byte so far as U+FFFD)
            # is not shown, and the hold counts back from the text before it: the character before the
            # placeholder may be the first of a stop string whose next one is still being spelled out
            ready = len(text.rstrip("\ufffd")) - hold
            if ready > len(shown):
                yield text[len(shown):ready], None
                shown = text[:ready]
        if len(text) > len(shown):
            yield text[len(shown):], None
        generated = len(tokens) + ended
        usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
        yield "", (finish, usage)


def _stream_settings(body: dict) -> tuple[bool, bool]:
    """``(stream, include_usage)``: ``stream`` a boolean, ``stream_options`` an object (or null)."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false; got {stream!r}.", param="stream")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object such as {{\"include_usage\": true}}; got {options!r}.",
                           param="stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise RequestError(f"'stream_options.include_usage' must be true or false; got {include_usage!r}.",
                           param="stream_options.include_usage")
    return bool(stream), bool(include_usage)


def _check_number(name, value, low, high, integer=False, low_open=False):
    ok = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
    if isinstance(value, bool) or not ok or value > high or value < low or (low_open and value == low):
        raise RequestError(f"'{name}' must be {'an integer' if integer else 'a number'} in "
                           f"{'(' if low_open else '['}{low}, {high}]; got {value!r}.", param=name)
