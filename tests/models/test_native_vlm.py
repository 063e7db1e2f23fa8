"""Native resolution in the VLM: Qwen2-VL's multimodal RoPE, and LLaVA-NeXT's AnyRes tiles."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.models import lm as lm_lib
from vitmm.models import rope

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "native"


def test_mrope_positions_are_qwen2vls_get_rope_index():
    data = np.load(FIXTURES / "qwen2vl_rope_index.npz")
    merge = int(data["merge"])
    cases = sorted({k.split("_")[0] for k in data.files if k != "merge"})
    assert len(cases) == 6
    for case in cases:
        grids = data[f"{case}_grids"] // np.array([1, merge, merge])  # HF's grids count patches before merging
        positions, deltas = rope.mrope_positions(data[f"{case}_types"], grids, data[f"{case}_mask"])
        np.testing.assert_array_equal(positions, data[f"{case}_positions"], err_msg=case)
        np.testing.assert_array_equal(deltas, data[f"{case}_deltas"].ravel(), err_msg=case)


def test_mrope_positions_of_a_video_resume_after_its_frames():
    """A video of 3 temporal patches of 2×2 tokens after two text tokens: ``(2 + τ, 2 + i, 2 + j)``,
    then the text resumes at ``2 + max(t, h, w) = 5`` (Qwen2-VL's rule; ``max(h, w)`` would give 4),
    written out by hand; the delta is the largest position + 1 minus the length: 7 - 16."""
    types = np.array([[0, 0] + [1] * 12 + [0, 0]])
    positions, deltas = rope.mrope_positions(types, [(3, 2, 2)])
    tau, i, j = np.repeat([0, 1, 2], 4), np.tile([0, 0, 1, 1], 3), np.tile([0, 1], 6)
    want = np.stack([np.r_[0, 1, 2 + tau, 5, 6], np.r_[0, 1, 2 + i, 5, 6], np.r_[0, 1, 2 + j, 5, 6]])
    np.testing.assert_array_equal(positions[:, 0], want)
    assert deltas.tolist() == [7 - 16]


def test_mrope_positions_check_the_grids():
    with pytest.raises(ValueError, match=r"image run of 3 tokens where its grid \(1, 2, 2\) gives 4"):
        rope.mrope_positions(np.array([[0, 1, 1, 1, 0]]), [(1, 2, 2)])


def test_mrope_angles_turn_each_band_with_its_component_and_equal_rope_for_text():
    hd, section = 16, (2, 3, 3)
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 50, size=(3, 2, 5)))
    angles = rope.mrope_angles(positions, hd, section, 100.0)
    inv = rope.inverse_frequencies(hd, 100.0)
    component = np.repeat([0, 1, 2], section)
    for j in range(hd // 2):
        np.testing.assert_allclose(angles[..., j], positions[component[j]] * inv[j], rtol=1e-6)
    text = positions[0]
    np.testing.assert_array_equal(rope.mrope_angles(text, hd, section, 100.0), rope.rope_angles(text, hd, 100.0))
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)  # the LM's own scaled frequencies, for text as its RoPE
    np.testing.assert_array_equal(rope.mrope_angles(text, hd, section, 100.0, llama3),
                                  rope.rope_angles(text, hd, 100.0, llama3))
    assert not np.allclose(rope.rope_angles(text, hd, 100.0, llama3), rope.rope_angles(text, hd, 100.0))
    np.testing.assert_array_equal(rope.inverse_frequencies(hd, 100.0, {"type": "linear", "factor": 4.0}),
                                  rope.inverse_frequencies(hd, 100.0, {"rope_type": "linear", "factor": 4.0}))
    with pytest.raises(ValueError, match="summing to head_dim/2 = 8"):
        rope.mrope_angles(text, hd, (2, 2, 2))


def test_an_mrope_lm_on_text_is_the_plain_lm():
    cfg = dict(vocab_size=50, width=32, depth=2, num_heads=2)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 50, size=(2, 7)))
    params = lm_lib.LM(**cfg).init(jax.random.key(0), ids)
    plain = lm_lib.LM(**cfg).apply(params, ids)
    mrope = lm_lib.LM(**cfg, mrope_section=(2, 3, 3))
    np.testing.assert_array_equal(mrope.apply(params, ids), plain)
    three = jnp.broadcast_to(jnp.arange(7), (3, 2, 7))
    np.testing.assert_array_equal(mrope.apply(params, ids, positions=three), plain)
    shifted = three.at[1, :, 3].add(5)  # one token at another height (a uniform shift would be invisible)
    assert not np.allclose(mrope.apply(params, ids, positions=shifted), plain)


def _mrope_vlm():
    from vitmm.models.vlm import VLM

    return VLM(vision=dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=4, posemb="sincos2d",
                           class_token=False, pool="gap"),
               connector={"name": "patch_merger", "merge": 2},
               lm=dict(width=32, depth=2, num_heads=2, mrope_section=(2, 3, 3)), mrope=True)


def _types(text_len, m, image_pos):
    types = np.zeros((len(image_pos), text_len + m), np.int64)
    for b, p in enumerate(image_pos):
        types[b, p:p + m] = 1
    return types


def test_vlm_mrope_positions_follow_the_rule_at_native_resolution():
    from vitmm.models.vlm import VLM

    model = _mrope_vlm()
    images = jnp.zeros((2, 16, 24, 3))
    ids = jnp.ones((2, 5), jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), images, ids)  # one program: eager init costs seconds
    visual_tokens = lambda x: model.apply(variables, x, method=VLM.visual_tokens)  # noqa: E731
    positions = jax.jit(lambda grid, image_pos: model.apply(variables, 2, 5, grid, image_pos, method=VLM.positions),
                        static_argnums=0)
    for hw, rows_cols in [((16, 24), (2, 3)), ((24, 8), (3, 1)), ((40, 16), (5, 2))]:
        m = rows_cols[0] * rows_cols[1]
        assert model.apply(variables, hw, method=VLM.num_visual_tokens) == m
        tokens = jax.eval_shape(visual_tokens, jax.ShapeDtypeStruct((1, *hw, 3), jnp.float32))  # traced, not run
        assert tokens.shape[1] == m  # the count is the real shape, for every size
        for image_pos in ([1, 1], [2, 4]):
            got = positions((hw[0] // 4, hw[1] // 4), jnp.asarray(image_pos))
            want, _ = rope.mrope_positions(_types(5, m, image_pos), [(1, *rows_cols)] * 2)
            np.testing.assert_array_equal(got, want, err_msg=f"{hw} {image_pos}")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        jax.eval_shape(visual_tokens, jax.ShapeDtypeStruct((1, 12, 16, 3), jnp.float32))  # raised while tracing


def test_mrope_cached_decoding_equals_the_full_forward():
    """Prefill, then steps at sequence index + delta: each step's logits are the full forward's
    at the last position of the sequence so far (whose positions come from the rule), and greedy
    decoding returns its argmaxes."""
    from vitmm import decode
    from vitmm.models.vlm import VLM

    model = _mrope_vlm()
    images = jax.random.normal(jax.random.key(1), (2, 16, 24, 3))
    prompts = [[257, 70, 80], [257]]
    ids = jnp.asarray([[257, 70, 80], [257, 0, 0]], jnp.int32)
    lens = jnp.asarray([3, 1])
    variables = jax.jit(model.init)(jax.random.key(0), images, ids)  # one program each: eager costs seconds
    m = model.apply(variables, (16, 24), method=VLM.num_visual_tokens)
    cache = lm_lib.init_cache(model.lm, 2, 3 + m + 3)
    logits, cache = jax.jit(functools.partial(model.apply, method=VLM.prefill))(variables, images, ids, lens, cache)
    step = jax.jit(functools.partial(model.apply, method=VLM.step))
    seqs = [list(p) for p in prompts]
    forward = jax.jit(lambda image, ids: model.apply(variables, image, ids))  # right-padded: one compile
    for i in range(3):
        for b in range(2):
            padded = jnp.asarray([seqs[b] + [0] * (6 - len(seqs[b]))], jnp.int32)
            full = forward(images[b:b + 1], padded)[0, m + len(seqs[b]) - 1]
            np.testing.assert_allclose(logits[b], full, atol=2e-5, err_msg=f"step {i} row {b}")
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        for b in range(2):
            seqs[b].append(int(token[b]))
        logits, cache = step(variables, token, lens + m + i, cache)
    out = decode.greedy_decode(model, variables, images, np.asarray(ids), np.asarray(lens), max_new_tokens=3,
                               eos_id=-1)
    assert out.tolist() == [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]


def _anyres_fixture():
    import json

    return json.loads((FIXTURES / "anyres_counts.json").read_text())["configs"]


def test_anyres_counts_and_resolutions_are_llava_nexts():
    from vitmm.models import anyres

    for name, cfg in _anyres_fixture().items():
        tile_grid = (cfg["tile"] // cfg["patch"],) * 2
        assert len(cfg["cases"]) == 150
        for case in cfg["cases"]:
            hw = (case["height"], case["width"])
            assert list(anyres.best_resolution(hw, cfg["pinpoints"])) == case["best"], (name, case)
            got = anyres.num_tokens(hw, cfg["pinpoints"], cfg["tile"], tile_grid, extra=case["extra_tokens"])
            assert got == case["tokens"], (name, case)


def test_anyres_fitted_size_rounds_as_transformers_does():
    """``fitted_size`` equals transformers' ``get_patch_output_size`` (5.x, stored here) on sizes
    where ``h * tw / w`` and ``h * (tw / w)`` round apart: COCO's 375×500 and a 1:3 image."""
    from vitmm.models import anyres

    hf_sizes = {((375, 500), (672, 672)): (505, 672), ((500, 375), (672, 672)): (672, 505),
                ((200, 600), (336, 672)): (225, 672), ((480, 640), (672, 672)): (504, 672)}
    for (hw, target), want in hf_sizes.items():
        assert anyres.fitted_size(hw, target) == want, (hw, target)


def test_anyres_layout_is_the_order_llava_next_hands_the_lm_its_tokens():
    """``anyres.layout`` (what ``assemble``, ``gather`` and the ``anyres`` op lay out by) equals
    the order of LLaVA-NeXT's ``pack_image_features`` on labelled features, for 150 image sizes of
    the tiny setting and three of LLaVA-NeXT's own (2,000+ tokens each)."""
    import json

    from vitmm.models import anyres

    stored = json.loads((FIXTURES / "anyres_layouts.json").read_text())["configs"]
    for name, cfg in stored.items():
        grid = (cfg["tile"] // cfg["patch"],) * 2
        assert len(cfg["cases"]) == (150 if name == "tiny" else 3)
        for case in cfg["cases"]:
            got = anyres.layout((case["height"], case["width"]), cfg["pinpoints"], cfg["tile"], grid)
            np.testing.assert_array_equal(got, case["layout"], err_msg=f"{name} {case['height']}x{case['width']}")


def test_onevision_downsampling_of_an_image_with_no_rows_left_is_the_base_view():
    """A banner so wide that unpadding leaves no row of tiles' tokens: LLaVA-OneVision hands the LM
    the base view alone (its processor's counts, transformers 5.25, stored here), not a crash."""
    from vitmm.data import preprocess
    from vitmm.models import anyres

    next_pins, tiny_pins = _anyres_fixture()["llava_next"]["pinpoints"], _anyres_fixture()["tiny"]["pinpoints"]
    hf_counts = {((1, 2000), 336, 24): 576, ((7, 1000), 336, 24): 576, ((3, 1000), 336, 24): 576,
                 ((1, 47), 16, 4): 16, ((1, 9), 16, 4): 16, ((2, 333), 16, 4): 16}
    for (hw, tile, g), want in hf_counts.items():
        pins = next_pins if tile == 336 else tiny_pins
        assert anyres.num_tokens(hw, pins, tile, (g, g)) == want  # NeXT: no rows, so no newlines either
        for n in (1, 9):
            index, weights = anyres.downsampled(hw, pins, tile, (g, g), n)
            assert len(index) == len(weights) == want, (hw, n)
            np.testing.assert_array_equal(index[:, 0], np.arange(g * g))
    op = preprocess.parse(f"anyres({tiny_pins}, 16, (4, 4), max_patches=2)")
    out = op({"image": np.full((1, 47, 3), 200, np.uint8)}, np.random.default_rng(0))
    assert out["visual_mask"].sum() == 16


@pytest.mark.parametrize("pinpoints, tile, message", [
    ([], 16, r"anyres pinpoints \[\] are empty: give at least one \(height, width\), each a multiple of the 16px "
             r"tile, e\.g\. \[\(16, 32\), \(32, 16\), \(32, 32\)\]"),
    ([(32, 32), (20, 32)], 16, r"anyres pinpoint \(20, 32\) is not a whole number of 16px tiles a side \(at least "
                               r"one\): use multiples of 16 \(e\.g\. \(16, 32\)\)"),
    ([336, 672], 336, r"anyres pinpoint 336 is not a \(height, width\) pair: give a list of pairs, e\.g\. "
                      r"\[\(336, 672\), \(672, 336\), \(672, 672\)\]"),
    ([(0, 16)], 16, r"anyres pinpoint \(0, 16\) is not a whole number of 16px tiles a side \(at least one\): "
                    r"use multiples of 16 \(e\.g\. \(16, 16\)\)"),
    ([(16, 16)], 0, r"anyres tile=0 must be a positive whole number of pixels"),
])
def test_anyres_pinpoints_that_cannot_tile_are_refused_in_one_line(pinpoints, tile, message):
    """Every candidate is checked where the pinpoints are first read (the op, the model, the
    library), not only the one an image happens to choose: one line naming the value and the fix."""
    from vitmm.data import preprocess
    from vitmm.models import anyres
    from vitmm.models.vlm import VLM

    calls = [lambda: anyres.plan((30, 30), pinpoints, tile), lambda: anyres.max_views(pinpoints, tile),
             lambda: anyres.max_tokens(pinpoints, tile, (4, 4)),
             lambda: preprocess.parse(f"anyres({pinpoints}, {tile}, (4, 4))"),
             lambda: VLM(vision=dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=4, class_token=False,
                                     pool="gap"), connector={"name": "mlp"}, lm=dict(width=32, depth=1, num_heads=2),
                         anyres=dict(pinpoints=pinpoints, tile=tile)).init(
                 jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.ones((1, 3), jnp.int32))]
    for call in calls:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_anyres_of_an_image_without_pixels_is_refused_in_one_line():
    from vitmm.models import anyres

    with pytest.raises(ValueError, match=r"AnyRes of an image of 0x100 pixels: it needs at least one pixel a side"):
        anyres.plan((0, 100), [(16, 16)], 16)


def _anyres_vlm(cfg):
    from vitmm.models.vlm import VLM

    return VLM(vision=dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=cfg["patch"], class_token=False,
                           pool="gap"),
               connector={"name": "mlp"}, lm=dict(width=32, depth=1, num_heads=2),
               anyres=dict(pinpoints=cfg["pinpoints"], tile=cfg["tile"]))


def test_anyres_vlm_hands_the_lm_exactly_the_counted_tokens():
    """For stored sizes, the VLM's real output shape (traced) is LLaVA-NeXT's count and
    num_visual_tokens; one forward shows the layout: base view, then rows each ending in the newline."""
    from vitmm.models import anyres
    from vitmm.models.vlm import VLM

    cfg = _anyres_fixture()["tiny"]
    model = _anyres_vlm(cfg)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 20, 40, 3)), jnp.ones((1, 3), jnp.int32))
    for case in cfg["cases"][::12]:  # 13 sizes (the counts of all 150 are checked above)
        hw = (case["height"], case["width"])
        case = {**case, "tokens": case["tokens"] - case["extra_tokens"]}  # no CLS token here
        shape = jax.eval_shape(lambda x: model.apply(variables, x, method=VLM.visual_tokens),
                               jax.ShapeDtypeStruct((2, *hw, 3), jnp.float32)).shape
        assert shape == (2, case["tokens"], 32), case
        assert model.apply(variables, hw, method=VLM.num_visual_tokens) == case["tokens"]
    image = jax.random.uniform(jax.random.key(2), (1, 20, 44, 3))
    tokens = model.apply(variables, image, method=VLM.visual_tokens)[0]
    layout = anyres.plan((20, 44), cfg["pinpoints"], cfg["tile"])
    assert layout["best"] == (16, 48) and layout["tiles"] == (1, 3)
    rows, cols = anyres.unpadded((20, 44), (4, 12))
    width = cols.stop - cols.start + 1
    newline = variables["params"]["image_newline"]
    body = np.asarray(tokens[16:]).reshape(rows.stop - rows.start, width, 32)
    np.testing.assert_array_equal(body[:, -1], np.broadcast_to(newline, body[:, -1].shape))
    assert not np.any(np.all(np.isclose(body[:, :-1], newline), -1))
    # the base view is the whole image squashed to one tile, through the same tower and connector
    base = model.apply(variables, jax.image.resize(image, (1, 16, 16, 3), "bicubic", antialias=True),
                       method=lambda m, x: m.project(*m.features(x)[::2]))
    np.testing.assert_allclose(tokens[:16], base[0], atol=1e-5)


def test_host_made_anyres_views_of_images_at_their_own_sizes_batch_and_decode_as_each_alone():
    """The ``anyres`` op (views made on the host, padded to the most views, each image's layout
    left-padded) lets one batch hold images of different sizes: each example's visual tokens are
    its views' tokens in ``anyres.assemble``'s order, its text logits those of its unpadded
    sequence, and greedy decoding over the KV cache gives the tokens it gives alone."""
    from vitmm import decode
    from vitmm.data import preprocess
    from vitmm.models import anyres
    from vitmm.models.vlm import VLM, text_logits

    cfg = _anyres_fixture()["tiny"]  # 16-px tiles of 4-px patches: a 4x4 grid per view
    model = VLM(vision=dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=cfg["patch"], class_token=False,
                            pool="gap", posemb="sincos2d"),
                connector={"name": "mlp"}, lm=dict(vocab_size=40, width=32, depth=2, num_heads=2),
                anyres=dict(pinpoints=[tuple(p) for p in cfg["pinpoints"]], tile=cfg["tile"]))
    pp = preprocess.parse(f"anyres({cfg['pinpoints']}, {cfg['tile']}, (4, 4))|value_range(-1, 1)")
    rng = np.random.default_rng(0)
    sizes = ((20, 44), (37, 30), (9, 50))  # 1x3 tiles, 2x2, 1x3 with little left of the padding
    examples = [pp({"image": rng.integers(1, 256, (*hw, 3), dtype=np.uint8)}, rng) for hw in sizes]
    views, layout, mask = (np.stack([e[k] for e in examples]) for k in ("image", "anyres_layout", "visual_mask"))
    assert views.shape == (3, anyres.max_views(cfg["pinpoints"], 16), 16, 16, 3) and views.dtype == np.float32
    assert layout.shape == mask.shape == (3, anyres.max_tokens(cfg["pinpoints"], 16, (4, 4)))
    counts = [anyres.num_tokens(hw, cfg["pinpoints"], 16, (4, 4)) for hw in sizes]
    assert mask.sum(1).tolist() == counts and len(set(counts)) == 3 and not mask[:, :1].all()
    ids = jnp.asarray(rng.integers(1, 40, size=(3, 6)), jnp.int32)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 16, 32, 3)), ids[:1])
    apply = jax.jit(model.apply, static_argnames="method")  # one program a shape: eager costs ~1 s a call
    view_tokens = jax.jit(lambda v, x: model.apply(v, x, method=lambda m, x: m._view_tokens(x)))
    tokens = apply(variables, jnp.asarray(views), layout=layout, method=VLM.visual_tokens)
    logits = text_logits(apply(variables, jnp.asarray(views), ids, visual_mask=mask, layout=layout),
                         layout.shape[1], None)
    for b, (hw, n) in enumerate(zip(sizes, counts, strict=True)):
        v = 1 + int(np.prod(anyres.plan(hw, cfg["pinpoints"], 16)["tiles"]))
        assert (views[b, v:] == -1).all() and (views[b, :v] > -1).any()  # black views after the image's own
        per_view = view_tokens(variables, jnp.asarray(views[b:b + 1, :v]))
        want = anyres.assemble(per_view, hw, cfg["pinpoints"], 16, variables["params"]["image_newline"])
        np.testing.assert_allclose(tokens[b, -n:], want[0], atol=1e-5)
        alone = apply(variables, jnp.asarray(views[b:b + 1, :v]), ids[b:b + 1], layout=layout[b:b + 1, -n:])
        np.testing.assert_allclose(logits[b], text_logits(alone, n, None)[0], atol=1e-5, rtol=1e-5)
    prompt_len = np.array([3, 5, 4])
    batch = decode.GreedyDecoder(model)(variables, jnp.asarray(views), np.asarray(ids), prompt_len, 4, eos_id=2,
                                        visual_mask=mask, layout=layout)
    for b, n in enumerate(counts):
        v = 1 + int(np.prod(anyres.plan(sizes[b], cfg["pinpoints"], 16)["tiles"]))
        alone = decode.greedy_decode(model, variables, jnp.asarray(views[b:b + 1, :v]), np.asarray(ids[b:b + 1]),
                                     prompt_len[b:b + 1], 4, eos_id=2, layout=layout[b:b + 1, -n:])
        np.testing.assert_array_equal(batch[b], alone[0])
    with pytest.raises(ValueError, match="views .* with their layout"):
        model.apply(variables, jnp.asarray(views), method=VLM.visual_tokens)


def test_a_padded_batch_gives_each_image_its_unpadded_text_logits():
    """Images with different token counts in one batch: visual tokens left-padded with garbage and
    masked (``visual_mask``) give each example the text logits of its own unpadded sequence, with
    the image after BOS or inside the prompt; without the mask they do not."""
    from vitmm.models.vlm import VLM, text_logits

    model = VLM(vision=dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=8, class_token=False, pool="gap",
                            posemb="sincos2d"),
                connector={"name": "mlp"}, lm=dict(vocab_size=40, width=32, depth=2, num_heads=2))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 40, size=(2, 7)), jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), ids[:1])
    images = [jnp.asarray(rng.uniform(-1, 1, size=(1, h, w, 3)), jnp.float32) for h, w in ((16, 24), (24, 32))]
    features = jax.jit(lambda x: model.apply(variables, x, method=VLM.features)[0])  # eager costs ~1 s a call
    feats = [features(x)[0] for x in images]
    m = max(len(f) for f in feats)  # 6 and 12 tokens
    garbage = [jnp.asarray(rng.normal(size=(m - len(f), f.shape[-1])), jnp.float32) for f in feats]
    padded = jnp.stack([jnp.concatenate([g, f]) for g, f in zip(garbage, feats, strict=True)])
    mask = jnp.asarray([[k >= m - len(f) for k in range(m)] for f in feats])

    @functools.partial(jax.jit, static_argnames="grid")  # one program a shape: eager costs ~1 s a call
    def forward(ids, tokens, grid, mask=None, image_pos=None):
        return model.apply(variables, None, ids, features=(tokens, None, grid), visual_mask=mask, image_pos=image_pos)

    for image_pos in (None, jnp.asarray([1, 3])):
        got = text_logits(forward(ids, padded, (1, m), mask, image_pos), m, image_pos)
        unmasked = text_logits(forward(ids, padded, (1, m), image_pos=image_pos), m, image_pos)
        for b, f in enumerate(feats):
            pos = None if image_pos is None else image_pos[b:b + 1]
            alone = forward(ids[b:b + 1], f[None], (1, len(f)), image_pos=pos)
            want = text_logits(alone, len(f), pos)[0]
            np.testing.assert_allclose(got[b], want, atol=1e-5, rtol=1e-5)
            if len(f) < m:
                assert not np.allclose(unmasked[b], want, atol=1e-3)
    mrope = VLM(vision=model.vision, connector={"name": "mlp"}, lm=dict(model.lm, mrope_section=(2, 3, 3)),
                mrope=True)
    with pytest.raises(ValueError, match="visual_mask works with 1D positions only"):
        mrope.init(jax.random.key(0), None, ids, features=(padded, None, (1, m)), visual_mask=mask)


def test_mrope_split_keeps_qwen2vls_proportions():
    assert rope.mrope_split(128) == (16, 24, 24)  # Qwen2-VL's own mrope_section
    for head_dim in (8, 32, 64, 96):
        section = rope.mrope_split(head_dim)
        assert sum(section) == head_dim // 2 and min(section) >= 1 and section[1] == section[2]
    with pytest.raises(ValueError, match="head_dim >= 6"):
        rope.mrope_split(4)
