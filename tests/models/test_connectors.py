"""Connectors: the token count every family reports equals the shape it produces, for every
budget; unreachable budgets raise; merges, pooling and positions do what they claim."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm import tree
from vitmm.models import connectors as C
from vitmm.models.connectors import base

D_IN, D_OUT = 24, 32


def _cfg(name, budget, **settings):
    """A connector config; C-Abstractor with one residual block a stage (3 compile ~8 s a case): what
    it counts, reaches and sees is its pooling's and positions', and its default depth is built in
    ``test_every_patch_reaches_the_output`` on the non-square grid."""
    return {"name": name, "budget": budget, **({"depth": 1} if name == "c_abstractor" else {}), **settings}

CASES = [
    ("identity", None, (4, 6)), ("linear", None, (4, 6)), ("linear", 24, (4, 6)), ("mlp", "all", (4, 6)),
    ("qwen_resampler", 4, (4, 6)), ("qwen_resampler", 16, (8, 8)),
    ("perceiver", 5, (4, 6)), ("perceiver", 64, (8, 8)),
    ("idefics2_perceiver", 5, (4, 6)), ("idefics2_perceiver", 64, (8, 8)),
    ("qformer", 3, (4, 6)), ("qformer", 16, (8, 8)),
    ("patch_merger", 6, (4, 6)), ("patch_merger", 16, (8, 8)), ("patch_merger", 4, (8, 8)),
    ("pixel_shuffle", 6, (4, 6)), ("pixel_shuffle", 16, (8, 8)),
    ("pool", 6, (4, 6)), ("pool", 9, (5, 5)), ("pool", 16, (8, 8)),
    ("c_abstractor", 4, (4, 6)), ("c_abstractor", 9, (8, 8)),
    ("ldp", 4, (4, 6)), ("ldp", 16, (8, 8)),
]


@pytest.mark.parametrize("name, budget, grid", CASES)
def test_num_visual_tokens_equals_the_real_output_shape(name, budget, grid):
    cfg = _cfg(name, budget)
    x = jax.random.normal(jax.random.key(0), (2, grid[0] * grid[1], D_OUT if name == "identity" else D_IN))
    module = C.build(cfg, D_OUT)
    # Shapes only (the forward runs, finite, in test_every_patch_reaches_the_output; cost compiles it).
    out, variables = jax.eval_shape(lambda key, x: module.init_with_output(key, x, grid), jax.random.key(1), x)
    assert out.shape == (2, C.num_visual_tokens(cfg, grid), D_OUT)
    report = C.cost(cfg, x.shape[-1], D_OUT, grid)
    assert report["tokens"] == out.shape[1]
    assert report["params"] == tree.count(variables.get("params", {}))
    assert (report["flops"] > 0) == (name != "identity")


def test_cost_counts_the_lowered_forward_not_a_compiled_one(monkeypatch):
    """A GPU's cost analysis of a compiled program leaves out the matmuls it hands to cuBLAS (an
    H200 counted ~1/11 of SmolLM2's prefill): with every compiled count made 1, ``cost`` still
    gives the MLP connector's matmul FLOPs (2 per multiply-add) and nothing is compiled."""
    monkeypatch.setattr(jax.stages.Compiled, "cost_analysis", lambda self: pytest.fail("compiled"))
    cfg, grid = {"name": "mlp", "budget": "all", "hidden": 40}, (4, 6)
    flops = C.cost(cfg, D_IN, D_OUT, grid)["flops"]
    matmuls = 2 * grid[0] * grid[1] * (D_IN * 40 + 40 * D_OUT)
    assert matmuls <= flops <= 1.1 * matmuls  # (biases and the activation: the rest)


GRID_CASES = [c for c in CASES if c[0] not in ("identity", "linear", "mlp")] + [("mlp", "all", (4, 6))]


@pytest.mark.parametrize("name, budget, grid", GRID_CASES)
def test_token_grid_is_where_each_token_looks(name, budget, grid):
    """Grid-shaped families say the (rows, cols) their tokens lie in, in raster order: token (r, c)
    draws on the image around its own cell: the centre of its gradient over the patches lies in the
    cell (±½ patch for pooling's overlapping cells, ±1 for LDP's convolutions)."""
    cfg = {"name": name, "budget": budget}
    token_grid = C.token_grid(cfg, grid)
    if name in ("qwen_resampler", "perceiver", "idefics2_perceiver", "qformer"):
        assert token_grid is None
        return
    assert token_grid[0] * token_grid[1] == C.num_visual_tokens(cfg, grid)
    if name == "c_abstractor":  # its squeeze-excite blocks and stacked 3x3 convs see the whole image: at
        return  # initialisation every token's gradient is spread near-evenly, so locality is not testable so
    x = jax.random.normal(jax.random.key(0), (1, grid[0] * grid[1], D_OUT if name == "identity" else D_IN))
    module = C.build(cfg, D_OUT)

    @jax.jit  # one program: eager dispatch of init and the Jacobian costs seconds
    def jacobian(x):
        variables = module.init(jax.random.key(1), x, grid)
        return jax.jacobian(lambda x: module.apply(variables, x, grid)[0].sum(-1))(x)[:, 0]  # [M, N, C]

    jac = jacobian(x)
    strength = np.abs(np.asarray(jac)).sum(-1).reshape(-1, *grid)
    slack = {"ldp": 1, "pool": 0.5}.get(name, 0)
    centres = np.stack(np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij"), -1) + 0.5
    for i, heat in enumerate(strength):
        r, c = divmod(i, token_grid[1])
        pr, pc = (heat[..., None] * centres).sum((0, 1)) / heat.sum()
        rows = (r * grid[0] / token_grid[0] - slack, (r + 1) * grid[0] / token_grid[0] + slack)
        cols = (c * grid[1] / token_grid[1] - slack, (c + 1) * grid[1] / token_grid[1] + slack)
        assert rows[0] <= pr <= rows[1] and cols[0] <= pc <= cols[1], (name, i, (pr, pc))


@pytest.mark.parametrize("name, budget, grid, message", [
    ("linear", 16, (8, 8), "keeps every patch token"),
    ("patch_merger", 20, (8, 8), r"gives \[64, 16, 4, 1\] tokens; 20"),
    ("pixel_shuffle", 6, (5, 5), "not among them"),
    ("pool", 15, (8, 8), "reaches"),
    ("qwen_resampler", 10, (8, 8), "not a perfect square"),
    ("c_abstractor", None, (8, 8), "explicit budget"),
    ("ldp", 12, (8, 8), "perfect square"),
    ("perceiver", 0, (8, 8), "positive integer"),
    ("idefics2_perceiver", "all", (8, 8), "positive integer"),
])
def test_budgets_a_family_cannot_produce_raise(name, budget, grid, message):
    with pytest.raises(C.BudgetError, match=message):
        C.num_visual_tokens({"name": name, "budget": budget}, grid)
    with pytest.raises(C.BudgetError):
        C.build({"name": name, "budget": budget}, D_OUT).init(
            jax.random.key(0), jnp.zeros((1, grid[0] * grid[1], D_IN)), grid)


def test_unknown_connector_and_wrong_token_count():
    with pytest.raises(ValueError, match="Unknown connector 'mlp2x'"):
        C.build({"name": "mlp2x"}, 8)
    with pytest.raises(ValueError, match="drop CLS"):
        C.build({"name": "linear"}, 8).init(jax.random.key(0), jnp.zeros((1, 17, 4)), (4, 4))
    with pytest.raises(ValueError, match=r"Connector 'pool' has no setting 'mod'; it takes \['budget', 'hidden', "):
        C.num_visual_tokens({"name": "pool", "budget": 16, "mod": "llava_average"}, (8, 8))
    assert C.num_visual_tokens({"name": "perceiver", "budget": np.int64(16)}, (8, 8)) == 16
    with pytest.raises(ValueError, match="width divisible by 4.*got 10"):
        C.build({"name": "qwen_resampler", "budget": 4, "width": 10}, 8).init(jax.random.key(0),
                                                                              jnp.zeros((1, 16, 4)), (4, 4))
    abstractor = C.build(_cfg("c_abstractor", 4), 8)  # its position table is tied to the grid it was built for
    params = abstractor.init(jax.random.key(0), jnp.zeros((1, 16, 4)), (4, 4))
    with pytest.raises(ValueError, match=r"built for 16 input tokens, not the 36 of grid \(6, 6\)"):
        abstractor.apply(params, jnp.zeros((1, 36, 4)), (6, 6))


def test_pool_token_counts_ceil_except_llava_average():
    for mode in ("area", "bilinear", "llava_bilinear"):
        assert C.num_visual_tokens({"name": "pool", "budget": 9, "mode": mode}, (5, 5)) == 9  # ceil(5/2)²
    assert C.num_visual_tokens({"name": "pool", "budget": 4, "mode": "llava_average"}, (5, 5)) == 4  # floor(5/2)²
    with pytest.raises(C.BudgetError):
        C.num_visual_tokens({"name": "pool", "budget": 9, "mode": "llava_average"}, (5, 5))
    with pytest.raises(ValueError, match="'average'.*area"):
        C.num_visual_tokens({"name": "pool", "budget": 4, "mode": "average"}, (8, 8))


# Every family with every budget it reaches on an 8x8 grid (and a non-square one).
COVERAGE = [(name, budget, (8, 8)) for name, budgets in {
    "identity": [None], "linear": [None], "mlp": [None], "qwen_resampler": [1, 4, 16, 64],
    "perceiver": [1, 4, 16], "idefics2_perceiver": [1, 4, 16], "qformer": [1, 4, 16], "patch_merger": [64, 16, 4, 1],
    "pixel_shuffle": [64, 16, 4, 1], "pool": [64, 16, 9, 4, 1], "c_abstractor": [1, 4, 9, 16, 64],
    "ldp": [1, 4, 9, 16, 64]}.items() for budget in budgets] + [
    ("pool", 6, (5, 7)), ("pool", 2, (5, 7)), ("ldp", 4, (5, 7)), ("c_abstractor", 9, (5, 7))]


def _generic_weights(shapes):
    """Weights in general position, drawn with numpy at the shapes ``init`` gives: what a patch can
    reach is the architecture's, not the initialiser's, and compiling each family's ``init`` (its
    RNG) would double these tests' cost. Kernels scale as 1/sqrt(fan-in); norm scales near 1."""
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        shape = leaf.shape
        if len(shape) >= 2:
            std = 1.0 / np.sqrt(np.prod(shape[:-1]) if "kernel" in name else shape[-1])
            return (rng.normal(size=shape) * std).astype(leaf.dtype)
        return ((1.0 if "scale" in name else 0.0) + 0.1 * rng.normal(size=shape)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _patch_gradients(cfg, grid, d_in=D_IN):
    """``|d (r · output) / d patch|`` per patch for a random readout ``r``, at generic weights
    (one compiled program: eager dispatch of the wider families costs seconds)."""
    module = C.build(cfg, D_OUT)
    x = jax.random.normal(jax.random.key(0), (1, grid[0] * grid[1], d_in))
    variables = _generic_weights(jax.eval_shape(lambda key, x: module.init(key, x, grid), jax.random.key(1), x))

    @jax.jit
    def per_patch(variables, x):
        r = jax.random.normal(jax.random.key(2), (1, C.num_visual_tokens(cfg, grid), D_OUT))
        g = jax.grad(lambda x: (module.apply(variables, x, grid) * r).sum())(x)
        return jnp.abs(g[0]).sum(-1)

    return np.asarray(per_patch(variables, x))


@pytest.mark.parametrize("name, budget, grid", COVERAGE)
def test_every_patch_reaches_the_output(name, budget, grid):
    """Coverage: the output depends on every patch token, for every family and budget."""
    assert name in C.REGISTRY
    cfg = _cfg(name, budget) if (name, budget, grid) != ("c_abstractor", 9, (5, 7)) else {"name": name, "budget": 9}
    per_patch = _patch_gradients(cfg, grid, D_OUT if name == "identity" else D_IN)
    assert np.isfinite(per_patch).all() and (per_patch > 0).all(), \
        f"{name} at {budget} tokens ignores {int((per_patch == 0).sum())} patches"


def test_coverage_list_names_every_family():
    assert {name for name, _, _ in COVERAGE} == set(C.REGISTRY)


@pytest.mark.parametrize("mode, budget, grid, unread", [
    ("llava_bilinear", 4, (8, 8), 48), ("llava_bilinear", 16, (8, 8), 0), ("llava_average", 4, (5, 5), 9),
    ("llava_average", 4, (8, 8), 0)])
def test_llava_exact_pooling_reads_what_it_reads(mode, budget, grid, unread):
    """LLaVA-OneVision's own calls, kept as named modes, do not read every patch: bilinear
    without anti-aliasing at stride 4 samples 16 of 64; avg_pool2d drops a ragged row/column."""
    per_patch = _patch_gradients({"name": "pool", "budget": budget, "mode": mode}, grid)
    assert int((per_patch == 0).sum()) == unread


def test_space_to_depth_concatenates_2x2_neighbours_in_raster_order():
    grid = (4, 6)
    x = jnp.arange(24, dtype=jnp.float32).reshape(1, 24, 1)  # token id = row * 6 + col
    merged = np.asarray(base.space_to_depth(x, grid, 2))[0, :, :]
    assert merged.shape == (6, 4)
    np.testing.assert_array_equal(merged[0], [0, 1, 6, 7])  # top-left block
    np.testing.assert_array_equal(merged[1], [2, 3, 8, 9])  # the block to its right
    np.testing.assert_array_equal(merged[3], [12, 13, 18, 19])  # first block of the next row


def test_adaptive_average_pool_matches_the_pytorch_formula():
    grid, out = (5, 7), (3, 3)
    x = np.random.default_rng(0).normal(size=(1, 35, 2)).astype(np.float32)
    got = np.asarray(base.adaptive_avg_pool(jnp.asarray(x), grid, out)).reshape(3, 3, 2)
    img = x.reshape(5, 7, 2)
    for i in range(3):
        for j in range(3):
            r0, r1 = (i * 5) // 3, -(-((i + 1) * 5) // 3)
            c0, c1 = (j * 7) // 3, -(-((j + 1) * 7) // 3)
            np.testing.assert_allclose(got[i, j], img[r0:r1, c0:c1].mean((0, 1)), rtol=1e-5)


@pytest.mark.parametrize("name, position_aware", [("perceiver", False), ("idefics2_perceiver", False),
                                                  ("qformer", False),
                                                  ("qwen_resampler", True), ("c_abstractor", True)])
def test_which_resamplers_see_where_patches_are(name, position_aware):
    """Perceiver and Q-Former attend to an unordered set (no spatial positions); Qwen-VL's
    resampler adds 2D sin-cos to keys and Honeybee a learned table, so permuting patches matters."""
    grid = (4, 4)
    cfg = _cfg(name, 4)
    x = jax.random.normal(jax.random.key(0), (1, 16, D_IN))
    module = C.build(cfg, D_OUT)
    perm = jax.random.permutation(jax.random.key(2), 16)

    variables = _generic_weights(jax.eval_shape(lambda key, x: module.init(key, x, grid), jax.random.key(1), x))

    @jax.jit
    def both(variables, x):
        return module.apply(variables, x, grid), module.apply(variables, x[:, perm], grid)

    a, b = both(variables, x)
    assert np.allclose(a, b, atol=1e-5) != position_aware


def test_qwen_resampler_key_positions_follow_the_grid():
    cfg = {"name": "qwen_resampler", "budget": 16}
    module = C.build(cfg, D_OUT)
    small = jnp.ones((1, 16, D_IN))
    variables = module.init(jax.random.key(0), small, (4, 4))
    # The same parameters serve any grid: key positions are resized from the query grid.
    assert module.apply(variables, jnp.ones((1, 48, D_IN)), (6, 8)).shape == (1, 16, D_OUT)
    assert variables["params"]["query"].shape == (16, D_OUT)
    assert "bias" not in variables["params"]["kv_proj"]


@pytest.mark.parametrize("k, grid", [(3, (4, 6)), (3, (1, 5)), (2, (4, 4))])
def test_depthwise_conv_equals_flax_grouped_conv(k, grid):
    """C-Abstractor's and LDP's depthwise conv (shifted multiply-adds, fast on XLA:CPU) computes
    flax's grouped ``nn.Conv`` with the same parameters, even kernels' SAME padding included, and
    the same gradients."""
    import flax.linen as nn

    x = jax.random.normal(jax.random.key(0), (2, *grid, 8))
    ours = base.DepthwiseConv(8, kernel_size=k)
    flax_conv = nn.Conv(8, (k, k), padding="SAME", feature_group_count=8)
    params = ours.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, flax_conv.init(jax.random.key(1), x))
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)  # bias too
    # (each jitted: one program instead of op-by-op dispatch of the forward and both backward passes)
    np.testing.assert_allclose(jax.jit(ours.apply)(params, x), jax.jit(flax_conv.apply)(params, x), atol=1e-5, rtol=0)
    # The gradient is written out (``depthwise_conv``): the parameters' and the input's, and the
    # gradient of a function of the gradient.
    grad = lambda f: jax.jit(jax.grad(lambda p, x: (f.apply(p, x) ** 2).sum(), argnums=(0, 1)))(params, x)  # noqa: E731
    for a, b in zip(jax.tree.leaves(grad(ours)), jax.tree.leaves(grad(flax_conv)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
    second = lambda f: jax.jit(jax.grad(lambda x: (jax.grad(lambda p: (f.apply(p, x) ** 2).sum())(params)  # noqa: E731
                                                    ["params"]["kernel"] ** 2).sum()))(x)
    np.testing.assert_allclose(second(ours), second(flax_conv), atol=1e-3, rtol=1e-4)  # reverse over reverse


@pytest.mark.parametrize("family,requested,tokens,note", [
    ("pool", 16, 16, ""),
    ("pool", "all", 64, ""),
    ("qwen_resampler", "all", 64, ""),
    ("perceiver", 5, 5, ""),
    ("patch_merger", 9, 16, "nearest to 9"),    # 2x2 merges reach 64, 16, 4, 1 on 8x8
    ("pixel_shuffle", 3, 4, "nearest to 3"),
    ("c_abstractor", 8, 9, "nearest to 8"),     # perfect squares only
    ("linear", 16, None, "unreachable (reaches [64])"),
    ("patch_merger", 200, None, "unreachable (reaches [1, 4, 16, 64])"),
])
def test_budgets_resolve_to_reachable_counts_or_are_marked(family, requested, tokens, note):
    setting, got, got_note = C.resolve(family, requested, (8, 8), max_ratio=2.0)
    assert (got, got_note) == (tokens, note)
    if tokens is not None:  # the setting really produces that many tokens
        assert C.num_visual_tokens({"name": family, "budget": setting}, (8, 8)) == tokens


def test_reachable_counts_on_a_non_square_grid():
    assert sorted(C.reachable("patch_merger", (6, 4))) == [6, 24]  # k = 1, 2 divide both sides
    assert sorted(C.reachable("linear", (6, 4))) == [24]
    assert sorted(C.reachable({"name": "pool", "mode": "llava_average"}, (5, 5))) == [1, 4, 25]  # settings count


@pytest.mark.parametrize("name,budget", [("mlp", "all"), ("pool", 16), ("ldp", 16), ("pixel_shuffle", 16),
                                         ("patch_merger", 16)])
def test_hidden_width_sets_the_mlp_and_defaults_to_the_published_one(name, budget):
    in_dim, out_dim, grid = 12, 10, (8, 8)
    base = C.num_params({"name": name, "budget": budget}, in_dim, out_dim, grid)
    wider = C.num_params({"name": name, "budget": budget, "hidden": 40}, in_dim, out_dim, grid)
    k2 = 1 if name in ("mlp", "pool", "ldp") else 4  # merged families read k² = 4 concatenated tokens
    default_hidden = in_dim * k2 if name == "patch_merger" else out_dim
    # Two Dense layers a -> h -> out: only the hidden width's terms change.
    per_hidden = in_dim * k2 + 1 + out_dim
    assert wider - base == (40 - default_hidden) * per_hidden


def test_size_to_picks_the_nearest_count_and_keeps_the_tokens():
    in_dim, out_dim, grid = 128, 64, (8, 8)
    for name, budget in [("pool", 16), ("qformer", 16), ("perceiver", 16), ("c_abstractor", 4)]:
        cfg, count = C.size_to({"name": name, "budget": budget}, 50_000, in_dim, out_dim, grid)
        assert count == C.num_params(cfg, in_dim, out_dim, grid)
        assert C.num_visual_tokens(cfg, grid) == C.num_visual_tokens({"name": name, "budget": budget}, grid)
        knob = C.SIZE_KNOBS[name]
        step = 1 if knob == "depth" else 8
        for other in (cfg[knob] - step, cfg[knob] + step):  # no neighbour is nearer
            if other > 0:
                try:
                    n = C.num_params({**cfg, knob: other}, in_dim, out_dim, grid)
                except ValueError:
                    continue
                assert abs(np.log(n / 50_000)) >= abs(np.log(count / 50_000))
    with pytest.raises(ValueError, match="'linear' has no size knob"):
        C.size_to({"name": "linear", "budget": "all"}, 50_000, in_dim, out_dim, grid)


def test_perceiver_heads_of_their_own_width_count_as_openflamingos():
    """``num_heads`` fixes the attention at heads × head_dim whatever the width (OpenFlamingo: 8 × 64).
    OpenFlamingo's ``PerceiverResampler(dim=1024, depth=6)``: 63,019,008 parameters (per layer two
    LayerNorms before attention, to_q 1024→512, to_kv 1024→1024, to_out 512→1024, the FFN's LayerNorm
    and 1024→4096→1024, all bias-free; 64 latents; a final LayerNorm); vitmm adds its Dense in_proj."""
    openflamingo = 6 * (4 * 1024 + 1024 * 512 + 1024 * 1024 + 512 * 1024 + 2 * 1024 + 2 * 4 * 1024 * 1024) \
        + 64 * 1024 + 2 * 1024
    assert openflamingo == 63_019_008
    cfg = {"name": "perceiver", "budget": 64, "depth": 6, "num_heads": 8}
    assert C.num_params(cfg, 1024, 1024, (16, 16)) == openflamingo + 1024 * 1024 + 1024
    # the default (heads as wide as the output) is unchanged
    default = C.num_params({"name": "perceiver", "budget": 64}, 32, 128, (4, 4))
    assert default == C.num_params({"name": "perceiver", "budget": 64, "num_heads": 2}, 32, 128, (4, 4))


def test_c_abstractor_without_resblocks_pools_and_reads_out():
    """``depth=0`` (Honeybee's pooling and readout only) at a tower width other than ``hidden``."""
    out = C.build({"name": "c_abstractor", "budget": 4, "depth": 0}, 24)
    x = jnp.ones((1, 16, 12))
    y = out.apply(out.init(jax.random.key(0), x, (4, 4)), x, (4, 4))
    assert y.shape == (1, 4, 24)
