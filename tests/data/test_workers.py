"""Input worker processes (``input.workers``): the same batches as without them, exact resume, a
clear refusal to resume with another number, errors that reach the trainer, and no process or
shared memory left behind after ``close()`` or a SIGKILL of the trainer."""

import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from vitmm.data import examples, formats, pipeline, preprocess, skips

ROOT = pathlib.Path(__file__).resolve().parents[2]
PP = "decode|random_resized_crop(16)|value_range(-1, 1)|tokenize('caption', 32)|keep('image', 'caption_tokens')"


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    return formats.WdsSource(examples.write_wds(tmp_path_factory.mktemp("wds"), 40, per_shard=15, resolution=16))


def _take(it, n):
    return [np.concatenate([b["caption_tokens"][:, :8], (b["image"][:, :2, 0, 0] * 100).astype(np.int32)], 1).tolist()
            for b in (next(it) for _ in range(n))]


@pytest.mark.parametrize("skip_bad", [None, 0.5], ids=["tfds-style", "raw-data"])
def test_workers_give_the_same_batches_every_time_and_resume_exactly(shards, skip_bad):
    """Without skipping, the batches are those of the trainer's own threads; raw data (skipping)
    is batched inside each worker, so its batches are those of any run with as many workers."""
    pp = preprocess.parse(PP)
    if skip_bad is None:
        reference = _take(pipeline.train_iterator(shards, pp, 4, seed=1, num_threads=1), 9)
    else:
        first = pipeline.train_iterator(shards, pp, 4, seed=1, num_threads=1, skip_bad=skip_bad, workers=2)
        try:
            reference = _take(first, 9)
        finally:
            first.close()
    it = pipeline.train_iterator(shards, pp, 4, seed=1, num_threads=1, skip_bad=skip_bad, workers=2)
    try:
        assert _take(it, 2) == reference[:2]
        for worker in multiprocessing.active_children():  # a launcher's SIGTERM to the process group:
            os.kill(worker.pid, signal.SIGTERM)  # the workers leave stopping to the trainer
        assert _take(it, 5) == reference[2:7]  # past what the workers had prepared before the signal
        state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    finally:
        it.close()
    resumed = pipeline.train_iterator(shards, pp, 4, seed=1, num_threads=1, skip_bad=skip_bad, workers=2)
    try:
        resumed.set_state(state)
        assert _take(resumed, 2) == reference[7:]
    finally:
        resumed.close()
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match="saved with input.workers=2; this run has none. Resume with input.workers=2"):
        pipeline.train_iterator(shards, pp, 4, seed=1, num_threads=1, skip_bad=skip_bad).set_state(state)


def test_bad_examples_are_counted_over_all_workers(tmp_path):
    pattern = examples.write_wds(tmp_path, 12, per_shard=12, resolution=16)
    shard = tmp_path / "00000.tar"
    shard.write_bytes(shard.read_bytes()[: -10240 - 600])  # the last example cut off: 1 bad in 12
    source = formats.WdsSource(pattern)
    it = pipeline.train_iterator(source, preprocess.parse(PP), 4, seed=0, num_threads=1, skip_bad=0.5, workers=2)
    try:
        for _ in range(6):  # 24 good examples: two epochs of 11 good and more
            next(it)
        counts = skips.total_counts(it.get_state())
    finally:
        it.close()
    assert counts["skipped"] == {"shard_truncated": counts["read"] - 24} and counts["read"] >= 26
    assert counts["first"]["shard_truncated"][0] == "00000.tar/000000011"
    assert skips.metrics(it.get_state())["data/skipped"] == counts["read"] - 24


def test_an_error_in_a_worker_reaches_the_trainer(shards):
    def broken(example, rng):
        raise ZeroDivisionError("a bug in the preprocessing")

    it = pipeline.train_iterator(shards, broken, 4, seed=0, num_threads=1, workers=1)
    try:
        with pytest.raises(Exception, match="a bug in the preprocessing"):
            next(it)
    finally:
        it.close()
    with pytest.raises(ValueError, match=r"input.workers=-3: a number of worker processes"):
        pipeline.train_iterator(shards, broken, 4, workers=-3)


def test_a_sigkilled_trainer_leaves_no_worker_and_no_shared_memory(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, time
        from vitmm.data import examples, formats, pipeline, preprocess, skips
        if __name__ == "__main__":
            source = formats.WdsSource(examples.write_wds({str(tmp_path)!r}, 24, resolution=16))
            it = pipeline.train_iterator(source, preprocess.parse({PP!r}), 4, num_threads=1, skip_bad=0.5, workers=2)
            next(it)
            print("WORKERS", *[p.pid for p in multiprocessing.active_children()], flush=True)
            time.sleep(120)
        """))
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        workers = [int(p) for p in line.split()[1:]]
        assert line.startswith("WORKERS") and len(workers) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(_running(pid) for pid in workers):
        time.sleep(0.2)
    assert not [pid for pid in workers if _running(pid)]
    while time.time() < deadline and set(os.listdir("/dev/shm")) - shm_before:
        time.sleep(0.2)
    leaked = [name for name in set(os.listdir("/dev/shm")) - shm_before if os.path.exists(f"/dev/shm/{name}")]
    assert not leaked


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process: an exited one whose new parent (the container's first
    process) has not reaped it yet is a zombie, listed in /proc but gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_auto_workers_count_the_cores_this_process_may_use(monkeypatch):
    """Workers × reader threads stay within the cores beyond the trainer's two; none when no core is spare."""
    from vitmm.data import workers

    for cores, threads, expected in ((2, 1, 0), (3, 1, 1), (6, 1, 4), (6, 2, 2), (7, 2, 2), (64, 1, 16), (64, 2, 16)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        monkeypatch.setattr(os, "cpu_count", lambda: 256)  # the machine's, not this process's
        assert workers.auto_workers(threads) == expected, (cores, threads)
        assert workers.resolve(-1, threads) == expected


def test_a_resume_on_a_host_where_minus_one_resolves_differently_names_the_saved_number():
    from vitmm.data import workers

    with pytest.raises(ValueError, match=r"this run has 4 \(input.workers=-1 on this host's cores\). Resume with "
                                         r"input.workers=6\.$"):
        workers.WorkerIterator(iter(()), 4, auto=True).set_state({"workers": 6, "grain": {}})
    with pytest.raises(ValueError, match=r"this run has none \(input.workers=-1 on this host's cores\). Resume with "
                                         r"input.workers=6\.$"):
        workers.NoWorkers(iter(()), auto=True).set_state({"workers": 6, "grain": {}})


def test_a_bad_example_crosses_from_a_worker_process_as_it_was_raised():
    import pickle

    err = pickle.loads(pickle.dumps(skips.BadExample("too_long", "300 tokens")))
    assert (type(err), err.reason, err.detail, str(err)) == (skips.BadExample, "too_long", "300 tokens",
                                                             "too_long: 300 tokens")


def _sequence_example(i):
    n = 5 + (i * 7) % 11
    return {"image": np.full((4, 4, 3), i, np.uint8), "ids": np.arange(n, dtype=np.int32) + 100 * i,
            "answer_mask": (np.arange(n) >= n - 2).astype(np.int32), "prompt_len": np.int32(n - 2),
            "image_pos": np.int32(1), "has_image": np.bool_(True)}


def test_workers_minus_one_is_resolved_alike_for_sequences_and_the_plain_stream(shards, monkeypatch):
    """``input.workers=-1`` means ``auto_workers()`` on every input path: ``input.sequences`` once
    handed -1 to grain ("num_threads must be non-negative") after the model was built."""
    from vitmm.data import sequences
    from vitmm.data import workers as workers_lib

    monkeypatch.setattr(workers_lib, "auto_workers", lambda *args, **kwargs: 0)  # no spare core: no processes
    source = [_sequence_example(i) for i in range(12)]

    def packed(workers):
        it = sequences.packed_batches(source, lambda ex, rng: dict(ex), num_visual=3, length=40, max_images=3, rows=2,
                                      bins=3, seed=1, workers=workers)
        return [next(it)["tokens"].tolist() for _ in range(2)]

    assert packed(-1) == packed(0)
    with pytest.raises(ValueError, match=r"input.workers=-3: a number of worker processes"):
        packed(-3)
    pp = preprocess.parse(PP)
    assert _take(pipeline.train_iterator(shards, pp, 4, seed=1, num_threads=1, workers=-1), 2) == \
        _take(pipeline.train_iterator(shards, pp, 4, seed=1, num_threads=1, workers=0), 2)


def test_close_frees_the_workers_semaphores_and_the_exit_prints_no_traceback(tmp_path):
    """``close()`` lets go of grain's iterator: its semaphores (``/dev/shm/sem.mp-*``, 25 a worker) go
    at once, not at exit, and grain's ``__del__`` does not run in the interpreter's teardown, where it
    printed ``Exception ignored … AttributeError`` tracebacks at the end of every run with workers
    (closed or not)."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import gc, multiprocessing.synchronize
        from vitmm.data import examples, formats, pipeline, preprocess

        def semaphores():
            gc.collect()
            return sum(isinstance(o, multiprocessing.synchronize.SemLock) for o in gc.get_objects())

        if __name__ == "__main__":
            source = formats.WdsSource(examples.write_wds({str(tmp_path)!r}, 24, resolution=16))
            counts = []
            for _ in range(2):  # (the first also makes grain's few semaphores for good)
                it = pipeline.train_iterator(source, preprocess.parse({PP!r}), 4, num_threads=1, workers=1)
                next(it)
                counts.append(semaphores())
                it.close()
                counts.append(semaphores())
            print("SEMAPHORES", *counts, flush=True)
            it = pipeline.train_iterator(source, preprocess.parse({PP!r}), 4, num_threads=1, workers=1)
            next(it)  # and an exit without close(): closed on the way out, as quietly
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    _, before, open_, closed = (int(n) for n in done.stdout.split("SEMAPHORES")[1].split())
    assert open_ > before + 20 and closed == before  # (~25 a worker)
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_close_unlinks_the_shared_memory_of_batches_held_in_reference_cycles(tmp_path):
    """The trainer's batches end in reference cycles, whose arrays unlink their segments only when
    the cycle collector runs: ``close()`` unlinks them, where every CLI run with workers once ended
    on the resource tracker's "There appear to be 6 leaked shared_memory objects" warning."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import gc, os
        from vitmm.data import examples, formats, pipeline, preprocess
        if __name__ == "__main__":
            source = formats.WdsSource(examples.write_wds({str(tmp_path)!r}, 24, resolution=16))
            before = set(os.listdir("/dev/shm"))
            it = pipeline.train_iterator(source, preprocess.parse({PP!r}), 4, num_threads=1, workers=2)
            gc.disable()  # (as between the trainer's rare collections)
            held = {{"batches": [next(it) for _ in range(3)]}}
            held["self"] = held  # a cycle, as the trainer's
            del held
            it.close()
            print("LEFT", len([n for n in set(os.listdir("/dev/shm")) - before if not n.startswith("sem.")]))
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("LEFT")[1].split() == ["0"] and "leaked shared_memory" not in done.stderr, done.stderr


def test_a_worker_killed_by_the_kernel_is_named_with_the_settings_to_lower(shards):
    """A worker that dies (exit code -9: the out-of-memory killer's SIGKILL) ends the run in one line
    that names ``input.workers`` and what to lower, not grain's bare exit code."""
    it = pipeline.train_iterator(shards, preprocess.parse(PP), 4, seed=0, num_threads=1, workers=2)
    try:
        next(it)
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"An input worker process died \(exit code -9: killed, most often by "
                                               r"the kernel's out-of-memory killer\).*input.workers"):
            for _ in range(40):
                next(it)
    finally:
        it.close()


def test_counts_past_2_to_the_31_add_up_across_processes(monkeypatch):
    """Each process's counts gathered as JAX arrays (int32 without x64) and summed: a long run's
    examples read past 2**31 on one host still add up exactly."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    local = {"data/read": 3_000_000_007.0, "data/skipped": 5.0, "data/truncated": 0.0, "data/skipped/bad_record": 5.0}
    monkeypatch.setattr(skips, "metrics", lambda state: local)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: jnp.stack([jnp.asarray(x)] * 2))
    total = skips.metrics_of_all_processes(None)
    assert total == {"data/read": 6_000_000_014, "data/skipped": 10, "data/truncated": 0, "data/skipped/bad_record": 10}


def test_the_exit_frees_shared_memory_once_however_many_iterators_were_made():
    """Each iterator registers its own close with atexit; the shared-memory sweep after them is
    registered once per process (a process that trains many runs does not pile up exit hooks)."""
    import atexit

    from vitmm.data import workers

    first = workers.WorkerIterator(iter(()), 1)
    before = atexit._ncallbacks()
    second = workers.WorkerIterator(iter(()), 1)
    assert atexit._ncallbacks() - before == 1 and workers._FREE_AT_EXIT
    del first, second
