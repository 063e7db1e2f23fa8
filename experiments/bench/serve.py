"""Load test of ``python -m vitmm.serve``: the same requests one at a time and from concurrent
clients, through the real ``openai`` client over HTTP on 127.0.0.1.

    python -m experiments.bench.serve --workdir workdirs/llava_s2 [--requests 64] [--clients 8] [--max_tokens 16]

Each request asks about a scenes image of its own size (longer side 48–192 px, aspect up to 2:1, as
PNG data URLs) at temperature 0. Reports requests/s, generated tokens/s and p50/p95 latency for one
client and for ``--clients`` concurrent ones, the decoder's batch sizes, and whether every answer
was the same both ways; writes ``results/bench_serve/bench_serve.{json,md}``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import pathlib
import platform
import statistics
import threading
import time

import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[2] / "results/bench_serve"


def _requests(n: int, seed: int = 0) -> list[dict]:
    from vitmm.data import examples, scenes

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        side = int(rng.integers(48, 193))
        short = int(side / rng.uniform(1.0, 2.0))
        hw = (side, short) if rng.random() < 0.5 else (short, side)
        image = scenes.generate("easy", hw, i, "validation")["image"]
        url = "data:image/png;base64," + base64.b64encode(examples.encode(image, "png")).decode()
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "Describe the image."}]}])
    return out


def _phase(client, model: str, messages: list, clients: int, max_tokens: int) -> dict:
    answers, latencies, tokens = [None] * len(messages), [0.0] * len(messages), [0] * len(messages)
    next_index, lock = [0], threading.Lock()

    def worker():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(messages):
                return
            start = time.perf_counter()
            reply = client.chat.completions.create(model=model, messages=messages[i], max_tokens=max_tokens,
                                                   temperature=0)
            latencies[i] = time.perf_counter() - start
            answers[i], tokens[i] = reply.choices[0].message.content, reply.usage.completion_tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ordered = sorted(latencies)
    return dict(clients=clients, wall_s=round(wall, 2), requests_per_s=round(len(messages) / wall, 3),
                tokens_per_s=round(sum(tokens) / wall, 2), p50_s=round(statistics.median(ordered), 3),
                p95_s=round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
                tokens=sum(tokens), answers=answers)


def main(argv=None) -> dict:
    import openai

    from vitmm import serve

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="requests before timing (compilation)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)

    engine = serve.Engine(args.workdir)
    url, stop = serve.start_in_thread(engine)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        messages = _requests(args.requests)
        _phase(client, engine.model_name, messages[: args.warmup], 1, args.max_tokens)
        # Warm the batched shapes too: one concurrent round of the clients' size.
        _phase(client, engine.model_name, messages[: args.clients], args.clients, args.max_tokens)
        engine.batcher.batch_sizes.clear()
        alone = _phase(client, engine.model_name, messages, 1, args.max_tokens)
        engine.batcher.batch_sizes.clear()
        together = _phase(client, engine.model_name, messages, args.clients, args.max_tokens)
        sizes = list(engine.batcher.batch_sizes)
    finally:
        stop()
    same = alone.pop("answers") == together.pop("answers")
    result = dict(date=str(datetime.date.today()), machine=f"{platform.machine()}, {os.cpu_count()} cores",
                  workdir=str(args.workdir), requests=args.requests, max_tokens=args.max_tokens, one_client=alone,
                  concurrent=together, speedup=round(together["requests_per_s"] / alone["requests_per_s"], 2),
                  batch_sizes=dict(mean=round(float(np.mean(sizes)), 2), max=max(sizes), decodes=len(sizes)),
                  same_answers=same)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve.json").write_text(json.dumps(result, indent=1))
    rows = [("1 client", alone), (f"{args.clients} clients", together)]
    lines = [f"{result['date']}, {result['machine']}; {args.requests} requests (images 48–192 px), "
             f"max_tokens {args.max_tokens}, temperature 0; `{args.workdir}`.", "",
             "| clients | requests/s | generated tokens/s | p50 latency (s) | p95 latency (s) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['requests_per_s']} | {r['tokens_per_s']} | {r['p50_s']} | {r['p95_s']} |"
              for name, r in rows]
    batches = result["batch_sizes"]
    lines += ["", f"Concurrent/one-at-a-time requests/s: {result['speedup']}×; decoder batches: mean "
              f"{batches['mean']}, max {batches['max']}; the same answers both ways: {same}."]
    (out / "bench_serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
