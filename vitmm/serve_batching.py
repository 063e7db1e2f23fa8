"""Concurrent requests of ``vitmm.serve`` decoded together, on one thread that does all device work."""

import queue
import threading
import time


class Batcher:
    """Concurrent requests decoded together: the first request waits ``window`` seconds for others
    (up to ``max_batch``), then one KV-cache decode serves them all, each request's tokens handed
    to it as they come. Greedy requests (temperature 0) share a batch, and their answers are those
    of one request at a time (tested); a sampled request decodes alone, so its seed alone decides
    its draw. One thread does all device work, so requests never interleave on the device."""

    def __init__(self, chat, max_batch: int = 8, window: float = 0.005):
        self.chat, self.max_batch, self.window = chat, max_batch, window
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        self._starting = threading.Lock()  # two first requests at once must not start two decoders
        self.batch_sizes: list[int] = []  # every decode's batch, for tests and the load test

    def submit(self, request: dict):
        """Yields the request's token ids (an EOS id last if the answer ends within ``max_tokens``). When the
        caller stops reading (a stop string, a client gone), or sets ``request["cancelled"]`` (a
        ``threading.Event``; one is made if absent), the decoder stops its row at the next step."""
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="vitmm-serve-decoder")
                self._thread.start()
        tokens: queue.Queue = queue.Queue()
        request = dict(request, cancelled=request.get("cancelled") or threading.Event())
        self._queue.put((request, tokens))
        try:
            while True:
                token = tokens.get()
                if isinstance(token, BaseException):
                    raise token
                if token is None:
                    return
                yield token
        finally:
            request["cancelled"].set()

    def _loop(self):
        while True:
            batch = [self._queue.get()]
            deadline = time.monotonic() + self.window
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            greedy = [item for item in batch if item[0]["temperature"] == 0]
            groups = ([greedy] if greedy else []) + [[item] for item in batch if item[0]["temperature"] != 0]
            for group in groups:
                try:
                    self._decode(group)
                except Exception as err:  # noqa: BLE001 - every waiting request gets the error
                    for _, tokens in group:
                        tokens.put(err)

    def _decode(self, group):
        """One decode for ``group``, its rows rounded up to a power of two (filled with copies of the
        first; the chat rounds the other shapes) so that a server compiles a handful of programs.
        Requests cancelled while they waited in the queue are dropped first."""
        for gone in [item for item in group if item[0]["cancelled"].is_set()]:  # left while it waited: no prefill
            gone[1].put(None)
            group.remove(gone)
        if not group:
            return
        rows = 1 << (len(group) - 1).bit_length()
        examples = [request["example"] for request, _ in group]
        examples += examples[:1] * (rows - len(examples))
        first, eos = group[0][0], self.chat.tokenizer.eos_ids
        budget = [request["max_tokens"] for request, _ in group]
        open_rows = set(range(len(group)))
        self.batch_sizes.append(len(group))
        for step, row_tokens in enumerate(self.chat.stream_batch(examples, max(budget), first["temperature"],
                                                                 first["top_p"], first["seed"])):
            for row in list(open_rows):
                token = int(row_tokens[row])
                group[row][1].put(token)
                if token in eos or step + 1 == budget[row] or group[row][0]["cancelled"].is_set():
                    group[row][1].put(None)
                    open_rows.discard(row)
            if not open_rows:  # every answer is complete (or no longer read): no step more
                break
        for row in open_rows:
            group[row][1].put(None)
