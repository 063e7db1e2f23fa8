"""Serve a trained VLM (or a converted LM, text only) with the OpenAI Chat Completions API
(FastAPI on uvicorn).

    python -m vitmm.serve --workdir workdirs/llava_s2 [--host 127.0.0.1] [--port 8000] \\
        [--model_name NAME] [--allow_local_files ROOT] [--max_request_mb 50]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    reply = client.chat.completions.create(model="llava_s2", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,..."}},
        {"type": "text", "text": "Describe the image."}]}])

Endpoints: ``POST /v1/chat/completions`` (``messages`` with string content or ``text`` and
``image_url`` parts, several for a run on flat sequences, or one ``video_url`` part (vLLM's) for a
run that took videos; ``max_tokens``/``max_completion_tokens`` (default 256), ``temperature``, ``top_p``,
``seed``, ``stop``, ``stream``; ``n`` 1 only, ``logprobs`` ignored (null); ``usage`` in every response,
streamed as server-sent events with a last usage chunk when ``stream_options.include_usage``),
``GET /v1/models`` (the model id: the workdir's name unless ``--model_name``) and
``GET /health``. The run's own preprocessing, prompt format and chat template, merged LoRA and the
KV-cache decoder answer (``vitmm.chat.Chat``); a ``python -m vitmm.interop`` LM folder is served
text-only with its chat template (``vitmm.lm_chat.LMChat``). Images come as base64 ``data:`` URLs; local paths
only under ``--allow_local_files``; remote URLs are refused (nothing is fetched). A bad request gets
OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status and
the server carries on; SIGTERM lets in-flight requests finish, then exits 0. Concurrent greedy
requests are decoded together (``vitmm.serve_batching.Batcher``), each answered as it would be alone.
"""

import argparse
import json
import pathlib
import signal
import sys
import threading
import time
import uuid

from vitmm.serve_engine import Engine, RequestError

MAX_REQUEST_MB = 50.0  # a request body's limit: ~35 MB of images once base64 has grown them by a third


# ----------------------------------------------------------------------------------------------
#                                             The app
# ----------------------------------------------------------------------------------------------
def make_app(engine: Engine, max_request_mb: float = MAX_REQUEST_MB):
    """The FastAPI app over ``engine``; a request body over ``max_request_mb`` MB is refused (413)
    before more of it is held in memory."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="vitmm", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    async def refused(request, err: RequestError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        code = "not_found" if err.status_code == 404 else None
        return JSONResponse(RequestError(str(err.detail), err.status_code, code=code).body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def failed(request, err: Exception):
        body = RequestError(f"The server failed on this request: {type(err).__name__}: {err}", 500,
                            kind="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": engine.created,
                                            "owned_by": "vitmm"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        from starlette.concurrency import run_in_threadpool

        try:
            body = json.loads(await _body(request, max_request_mb))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"The request body is not valid JSON ({err}).") from None
        parsed = await run_in_threadpool(engine.parse, body)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}
        if parsed["stream"]:
            return StreamingResponse(_events(engine, parsed, head, request), media_type="text/event-stream")
        pieces = await _whole(engine, parsed, request)
        if pieces is None:  # the client has gone away: no one reads a reply
            return Response(status_code=499)
        text = "".join(piece for piece, _ in pieces)
        finish, usage = pieces[-1][1]
        return {**head, "object": "chat.completion", "usage": usage, "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": None}]}

    return app


async def _body(request, max_mb: float) -> bytes:
    """The request's body, read piece by piece and refused (413) once it is over ``max_mb`` MB, or
    at once when its Content-Length says so."""
    limit = int(max_mb * 1e6)
    refusal = (f"The request body is over the server's limit of {max_mb:g} MB: send smaller images (e.g. JPEG "
               "at the model's input size), or start the server with a larger --max_request_mb.")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise RequestError(refusal, 413)
    pieces, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise RequestError(refusal, 413)
        pieces.append(piece)
    return b"".join(pieces)


async def _whole(engine: Engine, parsed: dict, request) -> list | None:
    """A non-streamed request's completion pieces, or None once its client has gone away. A task
    watches for the disconnect while the decoder works (a row may decode many tokens that show no
    text) and cancels the request, which stops its row at the decoder's next step, as a stream's
    does when its client leaves."""
    import asyncio

    from starlette.concurrency import run_in_threadpool

    cancelled = threading.Event()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, cancelled))
    completion = engine.completion({**parsed, "cancelled": cancelled})
    try:
        pieces = await run_in_threadpool(list, completion)  # one thread hop, not one per piece
        return None if watcher.done() else pieces  # (the engine sets `cancelled` itself when a row ends)
    finally:
        watcher.cancel()
        completion.close()


async def _cancel_on_disconnect(request, cancelled: threading.Event):
    """Sets ``cancelled`` when the client disconnects (the body is read, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancelled.set()


async def _events(engine: Engine, parsed: dict, head: dict, request):
    """Server-sent events: a role chunk, content deltas, a finish chunk, a usage chunk (asked for with
    ``stream_options: {"include_usage": true}``, as OpenAI sends it), [DONE]. A client that goes away
    cancels the request, as ``_whole``'s does (its row stops at the decoder's next step, not at
    ``max_tokens``); a failure once the stream has begun is an error event in OpenAI's error shape
    (the openai client raises it), not a cut connection."""
    import asyncio
    import traceback

    from starlette.concurrency import iterate_in_threadpool

    def chunk(delta=None, finish=None, usage=None):
        body = {**head, "object": "chat.completion.chunk",
                "choices": [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish,
                                              "logprobs": None}]}
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    cancelled = threading.Event()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, cancelled))
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for piece, end in iterate_in_threadpool(engine.completion({**parsed, "cancelled": cancelled})):
            if end is None:
                yield chunk({"content": piece})
            else:
                yield chunk(finish=end[0])
                if parsed["include_usage"]:
                    yield chunk(usage=end[1])
    except Exception as err:  # noqa: BLE001 - the 200 and some chunks are sent: the error goes in the stream
        traceback.print_exc()
        body = RequestError(f"The server failed on this request: {type(err).__name__}: {err}", 500,
                            kind="server_error").body()
        yield f"data: {json.dumps(body)}\n\n"
    finally:
        watcher.cancel()
        cancelled.set()
    yield "data: [DONE]\n\n"


def start_in_thread(engine: Engine, host: str = "127.0.0.1", max_request_mb: float = MAX_REQUEST_MB):
    """Serves ``engine`` on a free port from a background thread (tests, load tests):
    ``(base URL, stop())``."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    app = make_app(engine, max_request_mb)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"The server did not start on {host}:{port}.")

    def stop():
        server.should_exit = True
        thread.join(timeout=30)

    return f"http://{host}:{port}", stop


def main(argv=None) -> int:
    from vitmm import console, xla_flags

    xla_flags.use_vitmm_defaults()
    parser = argparse.ArgumentParser(prog="python -m vitmm.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True,
                        help="a `python -m vitmm.train` VLM workdir, or a `python -m vitmm.interop` LM folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model_name", default=None, help="the model id (default: the workdir's name)")
    parser.add_argument("--allow_local_files", default=None, help="image paths under this folder are allowed")
    parser.add_argument("--max_request_mb", type=float, default=MAX_REQUEST_MB,
                        help="a request body over this many MB is refused with 413 (default: %(default)g)")
    parser.add_argument("--verbose", action="store_true", help="the libraries' INFO lines and usual warnings too")
    args = parser.parse_args(argv)
    console.quiet(args.verbose)
    if not args.max_request_mb > 0:
        parser.error(f"--max_request_mb {args.max_request_mb:g}: give a positive size in MB.")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: a port is 0 to 65535.")
    if args.allow_local_files is not None and not (args.allow_local_files and
                                                   pathlib.Path(args.allow_local_files).expanduser().is_dir()):
        print(f"python -m vitmm.serve: --allow_local_files {args.allow_local_files!r} is not a folder; give an "
              "existing folder to serve local images from.", file=sys.stderr)  # not at the first request's 400
        return 2
    try:  # the address first: a port in use is said before the model is loaded, not after
        sock = _listening_socket(args.host, args.port)
    except OSError as err:
        print(f"python -m vitmm.serve: --host {args.host} --port {args.port}: cannot listen there "
              f"({err.strerror or err}); check --host, choose another --port, or stop what holds it.", file=sys.stderr)
        return 2
    try:
        engine = Engine(args.workdir, args.model_name, args.allow_local_files)
    except (ValueError, FileNotFoundError) as err:
        sock.close()
        print(f"python -m vitmm.serve: {err}", file=sys.stderr)
        return 2
    import uvicorn

    # uvicorn stops on SIGTERM/SIGINT once in-flight requests are answered, then raises the signal
    # again for the handler that was there before: with these, the server then exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"serving {engine.model_name!r} on http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    uvicorn.Server(uvicorn.Config(make_app(engine, args.max_request_mb), log_level="warning")).run(sockets=[sock])
    print("stopped", flush=True)
    return 0


def _listening_socket(host: str, port: int):
    """A socket bound to ``(host, port)`` for uvicorn (port 0: a free one)."""
    import socket

    info = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
        sock.listen(2048)  # held from here: no other server takes the port while the model loads
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
