"""Flat VLM sequences and packed rows (``data.sequences``, ``VLM.packed``): the loss and gradients
of a packed batch equal the unpacked batch's through the VLM's own padded path; several images in
one example equal their sequence spelled out by hand; the packed stream resumes exactly."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm import config_args, losses
from vitmm.data import preprocess, sequences
from vitmm.models import vlm
from vitmm.train import pp_template, tasks
from vitmm.train.parallel import Parallel

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _task(data_dir, prefix_lm=False, **overrides):
    c = config_args.load(ROOT / "configs/vlm_scenes.py", "smoke,connector=mlp,stage=2",
                         **{"input.data_dir": data_dir, "model.prefix_lm": prefix_lm, **overrides})
    task = tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))
    return c, task, task.init_params()


def _examples(c, num=5, seed=0):
    """pp'd QA examples of different lengths, one of them text-only, with random float images."""
    pp, rng = preprocess.parse(pp_template.pp_string(c)), np.random.default_rng(seed)
    out = []
    for i in range(num):
        q = "how many shapes are there in this picture?"[: 8 + 7 * i]
        ex = pp({"image": np.zeros((8, 8, 3), np.uint8), "questions": np.array([q]),
                 "answers": np.array(["yes" * (1 + i % 3)]), "question_kinds": np.array([0])}, rng)
        ex["image"] = rng.normal(size=ex["image"].shape).astype(np.float32)
        ex["has_image"] = np.bool_(i != 2)
        out.append({k: ex[k] for k in ("image", "ids", "answer_mask", "prompt_len", "image_pos", "has_image")})
    return out


def _packed(examples, num_visual, length, rows, pack=True):
    it = sequences.packed_batches(examples, lambda ex, rng: ex, num_visual=num_visual, length=length, max_images=4,
                                  rows=rows, pack=pack, bins=rows, num_epochs=1)
    return next(it)


def test_a_packed_batch_has_the_unpacked_loss_and_gradients(data_dir, prefix_lm=False):  # prefix-LM: the M-RoPE test
    """Five examples (one text-only) in two packed rows against the VLM's padded batch
    (``VLMTask.loss_fn`` on ``ids``/``image_pos``/``has_image``): loss ≤ 1e-6, gradients ≤ 1e-6;
    the packed rows' loss made a chunk of tokens at a time (``model.loss_chunk``) too."""
    c, task, params = _task(data_dir, prefix_lm)
    examples = _examples(c)
    padded = {k: jnp.asarray(np.stack([e[k] for e in examples])) for k in examples[0]}
    packed = _packed(examples, task.num_visual, length=2 * (task.num_visual + c.model.max_len), rows=2)
    assert packed["segment_ids"].max() >= 2 and len({(r, s) for r, row in enumerate(packed["segment_ids"])
                                                     for s in row if s}) == len(examples)
    assert sequences.padding_share(packed) < 0.5
    packed = {k: jnp.asarray(v) for k, v in packed.items()}

    @jax.jit  # one program a batch shape: eager, every operation of the backward pass is dispatched alone
    def loss_and_grads(batch):
        return jax.value_and_grad(task.loss_fn, has_aux=True)(params, batch, None)

    (loss, aux), grads = loss_and_grads(padded)
    (loss_p, aux_p), grads_p = loss_and_grads(packed)
    np.testing.assert_allclose(loss_p, loss, rtol=1e-6)
    np.testing.assert_allclose(aux_p["token_acc"], aux["token_acc"], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_p, grads)
    if not prefix_lm:
        chunked = _task(data_dir, prefix_lm, **{"model.loss_chunk": 37})[1]
        (loss_c, aux_c), grads_c = jax.jit(jax.value_and_grad(chunked.loss_fn, has_aux=True))(params, packed, None)
        np.testing.assert_allclose([loss_c, aux_c["token_acc"]], [loss, aux["token_acc"]], rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_c, grads)


def test_several_images_in_one_example_equal_the_sequence_spelled_out(data_dir):
    """An example with images at three places (one right after BOS, two together later): the packed
    path's answer loss equals the LM on ``[text, image 1, text, image 2, image 3, text]`` built by
    concatenation, next to another example in the same row."""
    c, task, params = _task(data_dir)
    model, m = task.model, task.num_visual
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 200, 20).astype(np.int32)
    answer = np.zeros(20, np.float32)
    answer[14:18] = 1
    images = rng.normal(size=(3, c.input.image_size, c.input.image_size, 3)).astype(np.float32)
    multi = {"ids": ids, "answer_mask": answer, "image": images[0], "more_images": list(images[1:]),
             "image_positions": np.array([1, 9, 9], np.int32), "image_pos": np.int32(1)}
    seq = sequences.to_sequence(multi, m)
    assert len(seq["tokens"]) == 18 + 3 * m and seq["prefix"].sum() == 14 + 3 * m
    other = _examples(c, 1, seed=3)[0]
    batch = _packed([multi, other], m, length=len(seq["tokens"]) + m + c.model.max_len, rows=1)
    assert (batch["segment_ids"][0] > 0).sum() == len(seq["tokens"]) + m + other["answer_mask"].nonzero()[0][-1] + 1
    logits = model.apply({"params": params}, *(jnp.asarray(batch[k]) for k in
                                               ("images", "tokens", "visual", "segment_ids", "positions")),
                         method=vlm.VLM.packed)
    seg = batch["segment_ids"][0]
    at = np.flatnonzero(seg == next(k for k in set(seg) - {0} if (seg == k).sum() == len(seq["tokens"])))
    np.testing.assert_array_equal(batch["targets"][0][at], seq["targets"])
    np.testing.assert_array_equal(batch["weights"][0][at], seq["weights"])

    def by_hand(module):
        text = module.language.embed(jnp.asarray(ids[None]))
        vis = module.visual_tokens(jnp.asarray(images))
        parts = [text[:, :1], vis[0:1], text[:, 1:9], vis[1:2], vis[2:3], text[:, 9:18]]
        return module.language(embeds=jnp.concatenate(parts, axis=1))

    want = model.apply({"params": params}, method=by_hand)[0]
    np.testing.assert_allclose(np.asarray(logits[0])[at], want, rtol=1e-5, atol=1e-5)


def test_a_packed_stream_resumes_exactly_and_covers_every_example(data_dir):
    c, task, _ = _task(data_dir)
    examples = _examples(c, num=12)
    make = lambda: sequences.packed_batches(examples, lambda ex, rng: ex, num_visual=task.num_visual,  # noqa: E731
                                            length=3 * (task.num_visual + 12), max_images=2, rows=2, bins=2)
    it = make()
    for _ in range(3):
        next(it)
    state = it.get_state()
    ahead = [next(it) for _ in range(3)]
    again = make()
    again.set_state(state)
    for want in ahead:
        jax.tree.map(np.testing.assert_array_equal, next(again), want)
    one_epoch = sequences.packed_batches(examples, lambda ex, rng: ex, num_visual=task.num_visual, length=200,
                                         max_images=4, rows=1, pack=False, num_epochs=1)
    rows = list(one_epoch)
    assert len(rows) == len(examples) and all(r["segment_ids"].max() == 1 for r in rows)


def test_an_example_longer_than_a_row_is_refused_with_the_fix(data_dir):
    c, task, _ = _task(data_dir)
    it = sequences.packed_batches(_examples(c, 2), lambda ex, rng: ex, num_visual=task.num_visual, length=8,
                                  max_images=1, rows=1)
    with pytest.raises(ValueError, match="does not fit a row of input.sequences.length=8"):
        next(it)


def test_raw_conversations_too_long_for_a_row_are_skipped_and_dropped_exchanges_counted():
    """Raw data (``skip_bad``): a conversation whose text fits ``max_len`` but not a row with its
    image is one skipped example, not the run's end; exchanges ``truncate_turns`` drops are counted."""
    from vitmm.data import preprocess, skips

    pp = preprocess.parse("conversation_tokens(60, overflow='truncate_turns')")
    turns = [{"from": "human", "value": "<image>\nq1?"}, {"from": "gpt", "value": "a1"},
             {"from": "human", "value": "q2 is a rather long question?"}, {"from": "gpt", "value": "a2 long answer"},
             {"from": "human", "value": "q3 is another long question?"}, {"from": "gpt", "value": "a3 long answer"}]
    image = np.zeros((4, 4, 3), np.float32)
    raw = [{"conversations": turns, "num_images": 1, "image": image, "_id": str(i)} for i in range(4)]
    it = sequences.packed_batches(raw, pp, num_visual=2, length=64, max_images=2, rows=1, pack=False,
                                  skip_bad=1.0, num_epochs=1)
    assert sum(1 for _ in it) == 4 and skips.metrics(it.get_state())["data/truncated"] == 4
    long = [{"conversations": turns[:4], "num_images": 1, "image": image, "_id": "long"}]
    short = [{"conversations": turns[:2], "num_images": 1, "image": image, "_id": f"s{i}"} for i in range(3)]
    it = sequences.packed_batches(short + long, pp, num_visual=30, length=48, max_images=2, rows=1, pack=False,
                                  skip_bad=0.5, num_epochs=1)
    assert sum(1 for _ in it) == 3 and skips.metrics(it.get_state())["data/skipped/too_long_for_row"] == 1


def test_to_sequence_places_targets_weights_and_prefix():
    ex = {"ids": np.array([1, 10, 11, 12, 13, 2, 0, 0], np.int32),
          "answer_mask": np.array([0, 0, 0, 1, 1, 1, 0, 0], np.float32),
          "image": np.zeros((4, 4, 3), np.uint8), "image_pos": np.int32(1)}
    seq = sequences.to_sequence(ex, num_visual=2)
    np.testing.assert_array_equal(seq["tokens"], [1, 0, 0, 10, 11, 12, 13, 2])
    np.testing.assert_array_equal(seq["visual"], [-1, 0, 1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(seq["targets"], [0, 0, 10, 11, 12, 13, 2, 0])  # t predicts t + 1
    np.testing.assert_array_equal(seq["weights"], [0, 0, 0, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(seq["prefix"], [1, 1, 1, 1, 1, 0, 0, 0])
    assert seq["images"].shape == (1, 4, 4, 3)
    text_only = sequences.to_sequence({**ex, "has_image": np.bool_(False)}, num_visual=2)
    np.testing.assert_array_equal(text_only["tokens"], [1, 10, 11, 12, 13, 2])
    assert text_only["images"].shape == (0, 4, 4, 3)


@pytest.mark.parametrize("mrope", [False, True])
def test_decoding_a_prompt_with_several_images_follows_the_full_forward(data_dir, mrope):
    """Greedy tokens from the KV cache after ``prefill_sequences`` (two prompts of 2 and 0 images,
    left-aligned, one padded) are the argmax of ``VLM.packed`` run on prompt + answer so far (with
    M-RoPE: decoding continues at each row's own ``rope_delta``)."""
    from vitmm import decode

    if mrope:
        c = config_args.load(ROOT / "configs/vlm_scenes.py", "smoke,connector=pool,budget=4,stage=2,mrope=True",
                             **{"input.data_dir": data_dir})
        task = tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))
        params = task.init_params()
    else:
        c, task, params = _task(data_dir)
    model, m, grid = task.model, task.num_visual, task.mrope_grid
    rng = np.random.default_rng(2)
    size = c.input.image_size
    images = rng.normal(size=(2, size, size, 3)).astype(np.float32)
    prompts = [{"ids": rng.integers(3, 200, 12).astype(np.int32), "prompt_len": 12, "image": images[0],
                "more_images": [images[1]], "image_positions": np.array([1, 6], np.int32)},
               {"ids": rng.integers(3, 200, 7).astype(np.int32), "prompt_len": 7, "image": images[0],
                "has_image": np.bool_(False)}]
    rows = [sequences.one_row(sequences.prompt_sequence(p, m, grid), 12 + 2 * m, 2) for p in prompts]
    lengths = np.array([12 + 2 * m, 7])
    stack = lambda k: np.stack([r[k] for r in rows])  # noqa: E731
    steps = list(decode.GreedyDecoder(model).stream_sequences(
        {"params": params}, stack("images"), stack("tokens"), stack("visual"), lengths, 4, eos_id=-1,
        positions=np.moveaxis(stack("mrope"), -1, 0) if mrope else None))
    answers = np.stack(steps, axis=1)
    for row, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        tokens = np.concatenate([r["tokens"][:n], answers[row, :-1]])
        visual = np.concatenate([r["visual"][:n], -np.ones(3, np.int32)])
        positions = sequences.mrope_positions(visual, grid)[:, None] if mrope else jnp.arange(len(tokens))[None]
        logits = model.apply({"params": params}, jnp.asarray(r["images"][None]), jnp.asarray(tokens[None]),
                             jnp.asarray(visual[None]), jnp.ones((1, len(tokens)), jnp.int32),
                             jnp.asarray(positions), method=vlm.VLM.packed)
        np.testing.assert_array_equal(np.asarray(logits[0, n - 1:]).argmax(-1), answers[row])


def test_mrope_positions_of_a_sequence_follow_qwen2vls_rule():
    """Images: the same positions as ``rope.mrope_positions`` (checked against transformers'
    ``get_rope_index``); a video of 3 temporal patches: ``(p + τ, p + i, p + j)``, the text after
    it at ``p + max(t, rows, cols)``."""
    from vitmm.models import rope

    ex = {"ids": np.arange(1, 13, dtype=np.int32), "answer_mask": np.r_[np.zeros(9), np.ones(3)].astype(np.float32),
          "image": np.zeros((4, 4, 3)), "more_images": [np.zeros((4, 4, 3))],
          "image_positions": np.array([1, 5], np.int32)}
    seq = sequences.to_sequence(ex, 6, mrope_grid=(2, 3))
    types = (seq["visual"] >= 0).astype(np.int64)[None]
    want, _ = rope.mrope_positions(types, [(1, 2, 3), (1, 2, 3)])
    np.testing.assert_array_equal(seq["mrope"].T, want[:, 0])
    video = {**ex, "more_images": [np.zeros((4, 4, 3))] * 2, "image_positions": np.array([1, 1, 1], np.int32),
             "video_frames": np.int32(3)}
    got = sequences.to_sequence(video, 4, mrope_grid=(2, 2))["mrope"].T
    tau, i, j = np.repeat(np.arange(3), 4), np.tile([0, 0, 1, 1], 3), np.tile([0, 1, 0, 1], 3)
    np.testing.assert_array_equal(got[:, 0], [0, 0, 0])  # BOS
    np.testing.assert_array_equal(got[:, 1:13], 1 + np.stack([tau, i, j]))
    np.testing.assert_array_equal(got[:, 13], [4, 4, 4])  # p + max(3, 2, 2)


def test_a_wrapped_video_is_one_group_with_qwen2vls_positions_and_split_frames_are_refused():
    """Qwen2-VL's ``image_text`` wraps a video once (its one ``<|vision_start|>…<|vision_end|>``), so
    its temporal patches' tokens follow each other and get ``(p + τ, p + i, p + j)``; frames with
    text between them are a clear error, not wrong positions or a broadcast error."""
    from vitmm.data import ops_text

    frame = np.zeros((4, 4, 3))
    ex = {"conversations": [{"from": "human", "value": "<image><image>\nq"}, {"from": "gpt", "value": "a"}],
          "num_images": np.int32(2), "video_frames": np.int32(2), "image": frame, "more_images": [frame]}
    ex = ops_text.conversation_tokens(64, image_text="[|<image>|]")(ex, None)
    text = bytes(int(i) - 1 for i in ex["ids"][1:ex["prompt_len"]] if 0 < i < 257).decode()
    assert text.startswith("[||]\nq")  # one wrap: the two frames' visual tokens go between [| and |]
    seq = sequences.to_sequence(ex, 4, mrope_grid=(2, 2))
    first = int(np.flatnonzero(seq["visual"] >= 0)[0])
    assert np.all(seq["visual"][first:first + 8] >= 0)
    tau, i, j = np.repeat(np.arange(2), 4), np.tile([0, 0, 1, 1], 2), np.tile([0, 1, 0, 1], 2)
    np.testing.assert_array_equal(seq["mrope"].T[:, first:first + 8], first + np.stack([tau, i, j]))
    np.testing.assert_array_equal(seq["mrope"].T[:, first + 8], [first + 2] * 3)  # p + max(2, 2, 2): the "|]"
    split = np.array([-1, 0, 1, 2, 3, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1])  # each frame wrapped on its own
    with pytest.raises(ValueError, match=r"video_frames=2 .*text sits between them: an image_text"):
        sequences.mrope_positions(split, (2, 2), video_frames=2)


@pytest.mark.parametrize("prefix_lm", [False, True])
def test_packed_mrope_rows_have_the_unpacked_loss_and_gradients(data_dir, prefix_lm):
    """M-RoPE (``model.mrope``) through packed rows: positions restart at each example, and the
    loss and gradients equal the padded batch's (``VLM.positions``) to 1e-6."""
    c = config_args.load(ROOT / "configs/vlm_scenes.py", "smoke,connector=pool,budget=4,stage=2,mrope=True",
                         **{"input.data_dir": data_dir, "model.prefix_lm": prefix_lm})
    task = tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))
    params = task.init_params()
    examples = [{k: v for k, v in ex.items() if k != "has_image"} for ex in _examples(c)]
    padded = {k: jnp.asarray(np.stack([e[k] for e in examples])) for k in examples[0]}
    it = sequences.packed_batches(examples, lambda ex, rng: ex, num_visual=task.num_visual,
                                  length=2 * (task.num_visual + c.model.max_len), max_images=4, rows=2, bins=2,
                                  num_epochs=1, mrope_grid=task.mrope_grid)
    packed = {k: jnp.asarray(v) for k, v in next(it).items()}
    assert int(packed["segment_ids"].max()) >= 2

    @jax.jit  # one program a batch shape: eager, every operation of the backward pass is dispatched alone
    def loss_and_grads(batch):
        return jax.value_and_grad(task.loss_fn, has_aux=True)(params, batch, None)

    (loss, _), grads = loss_and_grads(padded)
    (loss_p, _), grads_p = loss_and_grads(packed)
    np.testing.assert_allclose(loss_p, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_p, grads)


@pytest.mark.parametrize("connector", ["mlp", "patch_merger"])  # pixel_shuffle merges the same way
def test_images_at_their_own_sizes_packed_for_the_tower_equal_each_example_alone(data_dir, connector):
    """Images of four sizes (one example with two), their patches packed NaViT-style for the tower
    and their tokens into the LM rows: the loss and gradients equal the token-weighted sum over each
    example run alone through the VLM with its image at its own size (1e-6); a merging connector
    (``merge=2``) takes each image's patches in 2×2 windows, as on its square grid."""
    c = config_args.load(ROOT / "configs/vlm_scenes.py", "smoke,connector=mlp,stage=2", **{"input.data_dir": data_dir})
    merge = 1 if connector == "mlp" else 2
    with c.unlocked():
        c.model.connector = {"name": connector, **({} if merge == 1 else {"merge": 2})}
    task = tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))
    params = task.init_params()
    model, patch = task.model, 8
    rng = np.random.default_rng(4)
    sizes = [(16, 32), (32, 16), (16, 48), (32, 32)] if merge == 2 else [(16, 24), (32, 16), (8, 40), (24, 24)]
    examples = []
    for i, ex in enumerate(_examples(c, 4, seed=5)):
        ex = {**ex, "image": rng.normal(size=(*sizes[i], 3)).astype(np.float32), "has_image": np.bool_(True)}
        if i == 3:  # two images, the second one after the question's first 3 tokens
            ex["more_images"] = [rng.normal(size=(16, 16 if merge == 2 else 8, 3)).astype(np.float32)]
            ex["image_positions"] = np.array([1, 4], np.int32)
        examples.append(ex)
    tower = {"patch": patch, "class_token": False, "num_registers": 0, "merge": merge}
    it = sequences.packed_batches(examples, lambda ex, rng: ex, num_visual=0, length=160, max_images=4, rows=2, bins=2,
                                  num_epochs=1, tower=tower, tower_length=40)
    packed = {k: jnp.asarray(v) for k, v in next(it).items()}
    assert int(packed["segment_ids"].max()) >= 2 and int(packed["tower_segments"].max()) >= 2

    _assert_packed_equals_each_alone(  # each image alone at its own size through the square path
        task, params, packed, examples, lambda ex: sequences.to_sequence(ex, 0, tower=tower),
        lambda p, image: model.apply({"params": p}, jnp.asarray(image)[None], method=vlm.VLM.visual_tokens))


def test_anyres_images_at_their_own_sizes_in_packed_rows_equal_each_example_alone(data_dir):
    """AnyRes (tile 16: base view + 1×2, 2×1 or 2×2 tiles, a newline after each row of tokens) on
    images of four sizes, one example with two: the packed rows' views and layouts made on the host
    give the loss and gradients of each example alone through the VLM's AnyRes path for host-made
    views (its tokens gathered by ``anyres.gather`` on the device), 1e-6."""
    from vitmm.models import anyres as anyres_lib

    c = config_args.load(ROOT / "configs/vlm_scenes.py", "smoke,connector=mlp,stage=2,anyres=16",
                         **{"input.data_dir": data_dir})
    task = tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))
    params = task.init_params()
    model = task.model
    affine = (np.float32(2 / 255), np.float32(-1))  # value_range(-1, 1) on the views
    anyres = {**model.anyres, "tile_grid": (2, 2), "affine": affine}  # 16-px tiles of 8-px patches, a token each
    per_view = anyres["tile_grid"][0] * anyres["tile_grid"][1]
    rng = np.random.default_rng(6)
    sizes = [(20, 36), (40, 24), (16, 16), (33, 50)]
    examples = []
    for i, ex in enumerate(_examples(c, 4, seed=7)):
        ex = {**ex, "image": rng.integers(0, 256, (*sizes[i], 3), np.uint8), "has_image": np.bool_(True)}
        if i == 3:
            ex["more_images"] = [rng.integers(0, 256, (24, 12, 3), np.uint8)]
            ex["image_positions"] = np.array([1, 4], np.int32)
        examples.append(ex)
    it = sequences.packed_batches(examples, lambda ex, rng: ex, num_visual=per_view, length=200, max_images=12,
                                  rows=2, bins=2, num_epochs=1, anyres=anyres)
    packed = {k: jnp.asarray(v) for k, v in next(it).items()}
    assert int(packed["segment_ids"].max()) >= 2 and int((packed["visual"] == sequences.NEWLINE).sum()) > 0

    pins, grid = anyres["pinpoints"], anyres["tile_grid"]
    _assert_packed_equals_each_alone(  # the VLM's host-views path: views [1, V, t, t, C] and their layout [1, M]
        task, params, packed, examples, lambda ex: sequences.to_sequence(ex, per_view, anyres=anyres),
        lambda p, image: model.apply({"params": p}, jnp.asarray(preprocess.anyres_views(image, pins, 16) * affine[0]
                                                                + affine[1])[None],
                                     layout=jnp.asarray(anyres_lib.layout(image.shape[:2], pins, 16, grid))[None],
                                     method=vlm.VLM.visual_tokens))


def test_images_packed_for_the_tower_refuse_a_connector_that_needs_a_square_grid(data_dir):
    """A pooling connector cannot take a packed row of images at their own sizes: one line names it
    and what works."""
    c = config_args.load(ROOT / "configs/vlm_scenes.py", "smoke,connector=pool,budget=4,stage=2",
                         **{"input.data_dir": data_dir})
    task = tasks.from_config(c, Parallel(c.parallel), tasks.tokenizer_for(c))
    params = task.init_params()
    ex = {**_examples(c, 1)[0], "image": np.zeros((16, 24, 3), np.float32)}
    tower = {"patch": 8, "class_token": False, "num_registers": 0}
    batch = next(sequences.packed_batches([ex], lambda e, rng: e, num_visual=0, length=80, max_images=1, rows=1,
                                          tower=tower, tower_length=16))
    with pytest.raises(ValueError, match="take a token-wise connector .* this VLM has 'pool'"):
        task.loss_fn(params, {k: jnp.asarray(v) for k, v in batch.items()}, None)


def _assert_packed_equals_each_alone(task, params, packed, examples, sequence, visual_tokens):
    """The packed batch's loss and gradients against the token-weighted sum over each example alone:
    its flat ``sequence(ex)``'s text embeddings with ``visual_tokens(params, image)`` of each image
    (``[1, n, D]``, in order) at its visual positions (newlines included), through the LM."""
    model = task.model

    def alone(params):
        total, count = 0.0, 0.0
        for ex in examples:
            seq = sequence(ex)
            text = model.apply({"params": params}, jnp.asarray(seq["tokens"])[None],
                               method=lambda m, t: m.language.embed(t))
            vis = jnp.concatenate([visual_tokens(params, image) for image in [ex["image"], *ex.get("more_images", [])]],
                                  axis=1)[0]
            shown = seq["visual"] != -1
            x = jnp.where(jnp.asarray(shown)[:, None], vis[np.maximum(np.cumsum(shown) - 1, 0)], text[0])
            logits = model.apply({"params": params}, x[None], method=lambda m, e: m.language(embeds=e))[0]
            total += jnp.sum(losses.token_nll(logits, jnp.asarray(seq["targets"])) * seq["weights"])
            count += seq["weights"].sum()
        return total / count

    want, want_grads = jax.jit(jax.value_and_grad(alone))(params)
    (got, _), got_grads = jax.jit(jax.value_and_grad(task.loss_fn, has_aux=True))(params, packed, None)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_grads, want_grads)


def _two_image_example():
    """A QA example (one ``<image>`` place, ``image_pos``) with a second image beside it."""
    ex = {"ids": np.array([1, 10, 11, 12, 13, 2], np.int32), "answer_mask": np.array([0, 0, 0, 1, 1, 1], np.float32),
          "image": np.zeros((4, 4, 3), np.float32), "more_images": [np.ones((4, 4, 3), np.float32)],
          "image_pos": np.int32(1), "prompt_len": np.int32(3), "_id": "rec-7"}
    return ex


def test_images_without_a_place_each_are_refused_naming_the_example_and_the_fix():
    """Two images but one place (``image_pos`` alone: a one-``<image>`` text op such as ``qa_tokens``,
    or a ``keep`` that dropped ``image_positions``): one error naming the example, not both images
    stacked silently where the one tag stood; a count of places other than the images' likewise."""
    ex = _two_image_example()
    for make in (sequences.to_sequence, sequences.prompt_sequence):
        with pytest.raises(ValueError, match=r"rec-7 has 2 images but its text places one \(image_pos\).*"
                                             r"image_positions.*conversation_tokens"):
            make(ex, 2)
    with pytest.raises(ValueError, match=r"rec-7 has 3 image places \(image_positions\) for 2 images"):
        sequences.to_sequence({**ex, "image_positions": np.array([1, 1, 3], np.int32)}, 2)
    seq = sequences.to_sequence({**ex, "image_positions": np.array([1, 3], np.int32)}, 2)  # one place each: fine
    np.testing.assert_array_equal(seq["visual"], [-1, 0, 1, -1, -1, 2, 3, -1, -1, -1])


def test_a_held_out_example_too_long_for_a_row_is_masked_and_counted_as_training_skips_it():
    """``val_loss`` on flat sequences (``SequenceLayout.row`` in ``pipeline.eval_batches``): an
    example whose visual and text tokens overflow the row is a ``too_long_for_row`` bad example,
    masked out and counted as ``packed_batches`` skips it in training, not an error that ends the run
    at its first evaluation."""
    from vitmm.data import pipeline, skips
    from vitmm.train.sequence_layout import SequenceLayout

    layout = SequenceLayout(per_image=4, length=12, max_images=2)
    short = {k: v for k, v in _two_image_example().items() if k != "more_images"}
    long = {**short, "more_images": [np.ones((4, 4, 3), np.float32)], "image_positions": np.array([1, 3], np.int32)}
    with pytest.raises(skips.BadExample, match="too_long_for_row: An example of 14 positions and 2 images"):
        layout.row(long)
    batches = list(pipeline.eval_batches([short, long, short], lambda ex, rng: layout.row(ex), 3,
                                         process_index=0, process_count=1, num_threads=1))
    assert len(batches) == 1 and batches[0]["_mask"].tolist() == [1, 0, 1]
