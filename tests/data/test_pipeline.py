"""The grain pipeline: sources, sharding, shuffling, exact resume, padded evaluation, devices."""

import importlib

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from vitmm.data import device_feed, pipeline, preprocess

PP = "decode|value_range(-1, 1)|tokenize('caption', 24)|keep('image', 'caption_tokens', 'label')"


def _source(data_dir, small_name, split="train"):
    return pipeline.get_source(f"scenes/{small_name}", split, data_dir)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_train_batches_have_fixed_shapes(data_dir, small_name):
    it = pipeline.train_iterator(_source(data_dir, small_name), preprocess.parse(PP), 8, seed=0)
    batch = next(it)
    assert batch["image"].shape == (8, 32, 32, 3) and batch["image"].dtype == np.float32
    assert batch["caption_tokens"].shape == (8, 24) and batch["caption_tokens"].dtype == np.int32
    assert batch["label"].shape == (8,)


def test_shuffling_is_seeded_and_epochs_cover_everything(data_dir, small_name):
    src = _source(data_dir, small_name)
    pp = preprocess.parse("decode|tokenize('caption', 64)|keep('caption_tokens')")

    def epoch(seed):
        it = pipeline.train_iterator(src, pp, 16, seed=seed, num_epochs=1)
        return [tuple(row) for b in it for row in b["caption_tokens"]]

    a, b, c = epoch(0), epoch(0), epoch(1)
    assert a == b and a != c
    assert len(a) == 64 and sorted(a) == sorted(c)  # one epoch: every record once, any seed


def test_resume_sees_exactly_the_batches_it_would_have_seen(data_dir, small_name):
    src = _source(data_dir, small_name)
    pp = preprocess.parse("decode|flip_lr|random_resized_crop(16)|value_range|keep('image')")
    reference = _take(pipeline.train_iterator(src, pp, 8, seed=3), 12)  # crosses an epoch
    it = pipeline.train_iterator(src, pp, 8, seed=3)
    _take(it, 5)
    state = it.get_state()
    resumed = pipeline.train_iterator(src, pp, 8, seed=3)
    resumed.set_state(state)
    for expected, got in zip(reference[5:], _take(resumed, 7), strict=True):
        np.testing.assert_array_equal(expected["image"], got["image"])


def test_device_iterator_state_points_after_the_last_returned_batch(data_dir, small_name):
    src = _source(data_dir, small_name)
    pp = preprocess.parse(PP)
    reference = _take(pipeline.train_iterator(src, pp, 8, seed=1), 6)
    it = device_feed.DeviceIterator(pipeline.train_iterator(src, pp, 8, seed=1), size=3)
    first = _take(it, 2)
    assert isinstance(first[0]["image"], jax.Array)
    state = it.get_state()  # three more batches already sit in the prefetch queue
    again = device_feed.DeviceIterator(pipeline.train_iterator(src, pp, 8, seed=1), size=3)
    again.set_state(state)
    for expected, got in zip(reference[2:], _take(again, 4), strict=True):
        np.testing.assert_array_equal(expected["caption_tokens"], np.asarray(got["caption_tokens"]))


class _Host:
    """A host stream of batches {"x": [1]}, {"x": [2]}, ... (ending after ``end``), with its state."""

    def __init__(self, end=None):
        self.i, self.end = 0, end

    def __next__(self):
        if self.i == self.end:
            raise StopIteration
        self.i += 1
        return {"x": np.array([self.i])}

    def get_state(self):
        return self.i

    def set_state(self, state):
        self.i = state


def test_device_prefetch_0_puts_each_batch_on_the_devices_as_it_is_taken():
    """``input.device_prefetch=0`` (allowed by the trainer's validate) once ended an endless stream at
    its first batch with a bare StopIteration."""

    put = []
    it = device_feed.DeviceIterator(_Host(), size=0, put=lambda b: put.append(int(b["x"][0])) or b)
    assert [int(next(it)["x"][0]) for _ in range(3)] == [1, 2, 3] and put == [1, 2, 3]  # none fetched ahead
    assert it.get_state() == 3
    it.set_state(1)
    assert int(next(it)["x"][0]) == 2 and it.get_state() == 2
    finite = device_feed.DeviceIterator(_Host(end=2), size=0, put=lambda b: b)
    assert [int(b["x"][0]) for b in finite] == [1, 2]


def test_set_state_mid_stream_drops_the_batches_already_prefetched():
    """``set_state`` on an iterator that has batches waiting in its queue: the next batch is the one
    after the state, not a stale prefetched one (a host stream of 1, 2, 3, ...)."""

    it = device_feed.DeviceIterator(_Host(), size=3, put=lambda b: b)
    assert [int(next(it)["x"][0]) for _ in range(2)] == [1, 2]
    saved = it.get_state()
    assert saved == 2 and [int(next(it)["x"][0]) for _ in range(3)] == [3, 4, 5]
    it.set_state(saved)  # batches 6-8 sit in the queue
    assert [int(next(it)["x"][0]) for _ in range(3)] == [3, 4, 5] and it.get_state() == 5


def test_processes_read_disjoint_records(data_dir, small_name):
    src = _source(data_dir, small_name)
    pp = preprocess.parse("decode|keep('image')")
    seen = []
    assert len({src[i]["image"].tobytes() for i in range(len(src))}) == len(src)
    for index in range(2):
        it = pipeline.train_iterator(src, pp, 16, seed=0, process_index=index, process_count=2,
                                     num_epochs=1)
        rows = [r.tobytes() for b in it for r in b["image"]]
        assert len(rows) == 32  # per-process batch 8, 32 records each
        seen.append(set(rows))
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 64
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        pipeline.train_iterator(src, pp, 16, process_index=0, process_count=3)


@pytest.mark.parametrize("process_count, batch", [(1, 4), (3, 4), (3, 3)])
def test_eval_batches_see_every_record_once_with_padding_masked(data_dir, small_name, process_count, batch):
    """Batches of 3 over 3 processes: shards of 4, 3 and 3 records, 2 batches each (the shortest
    padded with a whole masked batch), since collectives need every process at every batch."""
    src = _source(data_dir, small_name, "test")  # 10 records
    pp = preprocess.parse("decode|keep('image')")
    indices, batches_per_process = [], set()
    for index in range(process_count):
        batches = list(pipeline.eval_batches(src, pp, batch, process_index=index,
                                             process_count=process_count))
        batches_per_process.add(len(batches))
        for b in batches:
            assert b["image"].shape == (batch, 32, 32, 3)
            np.testing.assert_array_equal(b["_mask"], b["_index"] >= 0)
            indices += [int(i) for i in b["_index"] if i >= 0]
    assert sorted(indices) == list(range(10))
    assert len(batches_per_process) == 1  # every process runs the same number of batches


def test_to_device_keeps_strings_on_host():
    batch = {"x": np.ones((2, 3), np.float32), "text": ["a", "b"]}
    out = device_feed.to_device(batch)
    assert isinstance(out["x"], jax.Array) and out["text"] == ["a", "b"]


@pytest.mark.parametrize("name, key", [("cifar10", "label"), ("imagenet2012", "label")])
def test_real_datasets_through_mock_data(tmp_path, name, key):
    with tfds.testing.mock_data(num_examples=12):
        src = pipeline.get_source(name, "train", str(tmp_path))
        pp = preprocess.parse(f"decode|resize(16)|value_range|keep('image', '{key}')")
        batch = next(pipeline.train_iterator(src, pp, 4, seed=0))
    assert batch["image"].shape == (4, 16, 16, 3) and batch[key].shape == (4,)


def test_read_only_fallback_for_builders_that_need_tensorflow(data_dir, small_name, monkeypatch):
    def needs_tf(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'tensorflow'")

    monkeypatch.setattr(tfds, "data_source", needs_tf)
    src = pipeline._prepared_source(f"scenes/{small_name}", "validation", data_dir)
    assert len(src) == 16


def test_unknown_unprepared_and_bad_split_errors(tmp_path, data_dir, small_name):
    with pytest.raises(ValueError, match="Unknown dataset 'cifar100000'.*scenes/easy_64"):
        pipeline.get_source("cifar100000", "train", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"'cifar10' is not prepared in .*tfds build cifar10"):
        pipeline.get_source("cifar10", "train", str(tmp_path))
    with pytest.raises(ValueError, match=r"no split 'valid'.*'validation'"):
        pipeline.get_source(f"scenes/{small_name}", "valid", data_dir)


def test_corrupt_record_names_split_and_index():
    class Broken:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise OSError("image file is truncated")
            return {"x": np.float32(i)}

    src = pipeline.SafeSource(Broken(), "scenes/easy_64", "validation")
    assert src[4]["x"] == 4
    with pytest.raises(ValueError, match=r"record 5 of split 'validation' of dataset 'scenes/easy_64'"):
        src[5]
    pp = preprocess.parse("keep('x')")
    with pytest.raises(ValueError, match="record 5"):
        list(pipeline.eval_batches(src, pp, 4))


def test_key_source_decodes_only_what_is_asked_and_equals_full_decode(data_dir, small_name):
    full = _source(data_dir, small_name, "validation")
    some = pipeline.get_source(f"scenes/{small_name}", "validation", data_dir, keys=("image", "caption"))
    for i in (0, 7, 15):
        a, b = full[i], some[i]
        assert sorted(b) == ["caption", "image"]
        np.testing.assert_array_equal(a["image"], b["image"])
        assert a["caption"] == b["caption"]
    with pytest.raises(ValueError, match=r"no feature\(s\) \['captions'\].*'caption'"):
        pipeline.get_source(f"scenes/{small_name}", "validation", data_dir, keys=("captions",))
    with tfds.testing.mock_data(num_examples=4):
        mocked = pipeline.get_source("cifar10", "train", data_dir, keys=("image",))
        assert sorted(mocked[0]) == ["image"]


def test_input_benchmark_runs(tmp_path, data_dir, small_name):
    module = importlib.import_module("experiments.bench.input")
    result = module.main(["--data", f"scenes/{small_name}", "--data_dir", data_dir, "--batch", "8",
                          "--batches", "2", "--steps", "1", "--repeats", "1", "--out", str(tmp_path)])
    assert result["input_examples_per_s"] > 0 and result["step_examples_per_s"] > 0
    assert "headroom" in (tmp_path / "bench_input.md").read_text()
