"""Op-time attribution of a compiled step (vitmm.train.profiling), checked on XLA:CPU."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

from vitmm.models import vit
from vitmm.train import profiling


def test_source_of_names_the_pass_and_the_layer_type():
    assert profiling.source_of("jit(step)/jvp(ViT)/encoder/block_03/mlp/fc1/dot_general") == (
        "forward", "encoder/block_*/mlp/fc1")
    assert profiling.source_of("jit(step)/transpose(jvp(ViT))/encoder/block_11/norm1/add_any") == (
        "backward", "encoder/block_*/norm1")
    # a custom JVP inside the model repeats the name stack; flax method scopes are dropped
    assert profiling.source_of(
        "jit(step)/transpose(jvp(ViT))/encoder/block_00/mlp/fc2/jvp(ViT)/encoder/block_00/mlp/fc2/dot_general"
    ) == ("backward", "encoder/block_*/mlp/fc2")
    assert profiling.source_of("jit(step)/jvp(ViT)/ViT._stem/embedding/conv_general_dilated") == (
        "forward", "embedding")
    assert profiling.source_of("jit(step)/jvp(ViT)/encoder/blocks/while/body/attn/qkv/dot_general") == (
        "forward", "encoder/blocks/attn/qkv")
    assert profiling.source_of("jit(step)/add") == ("other", "")  # the optimizer update


def test_kinds_from_gpu_style_instructions():
    hlo = "\n".join([
        "HloModule jit_step, is_scheduled=true",
        "",
        "%fused_gemm (p: bf16[8,8]) -> bf16[8,8] {",
        "  %p = bf16[8,8]{1,0} parameter(0)",
        "  ROOT %d = bf16[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "}",
        "",
        "%fused_add (p: f32[8]) -> f32[8] {",
        "  %p.1 = f32[8]{0} parameter(0)",
        "  ROOT %a = f32[8]{0} add(%p.1, %p.1)",
        "}",
        "",
        "ENTRY %main (x: bf16[8,8]) -> f32[8] {",
        "  %x = bf16[8,8]{1,0} parameter(0)",
        '  %custom-call.1 = (bf16[8,8], s8[64]) custom-call(%x, %x), custom_call_target="__cublas$gemm", '
        'metadata={op_name="jit(step)/jvp(ViT)/encoder/block_01/mlp/fc1/dot_general"}',
        '  %custom-call.5 = (bf16[8,8], s8[64]) custom-call(%x, %x), custom_call_target="__cublas$gemm", '
        'metadata={op_name="jit(step)/jvp(ViT)/encoder/block_01/attn/dot_product_attention/dot_general"}',
        '  %cudnn_gemm = bf16[8,8]{1,0} fusion(%x), kind=kCustom, calls=%fused_gemm, '
        'backend_config={"fusion_backend_config":{"kind":"__cudnn$fusion"}}',
        '  %custom-call.2 = (bf16[8,8], u8[0]) custom-call(%x, %x, %x), custom_call_target="__cudnn$fmhaSoftmax", '
        'metadata={op_name="jit(step)/transpose(jvp(ViT))/encoder/block_01/attn/dot_product_attention"}',
        '  %gemm_fusion = bf16[8,8]{1,0} fusion(%x), kind=kCustom, calls=%fused_gemm, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        "  %transpose.3 = bf16[8,8]{0,1} transpose(%x), dimensions={1,0}",
        "  %wrapped_reduce = f32[8]{0} fusion(%custom-call.1), kind=kLoop, calls=%fused_add",
        "  %all-reduce.4 = bf16[8,8]{1,0} all-reduce(%x), to_apply=%fused_add",
        "  ROOT %loop_fusion = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add, "
        'metadata={op_name="jit(step)/add"}',
        "}",
    ])
    ops = profiling.parse_hlo_ops(hlo)
    assert profiling.hlo_module_name(hlo) == "jit_step"
    assert ops["custom-call.1"] == profiling.HloOp("custom-call.1", "custom-call", "matmul", "forward",
                                                   "encoder/block_*/mlp/fc1")
    assert (ops["custom-call.2"].kind, ops["custom-call.2"].phase) == ("attention", "backward")
    assert ops["gemm_fusion"].kind == "matmul" and ops["cudnn_gemm"].kind == "matmul"  # fusions around a dot
    assert ops["custom-call.5"].kind == "matmul"  # XLA's attention: GEMMs, whatever the source's name
    assert ops["transpose.3"].kind == "copy" and ops["all-reduce.4"].kind == "collective"
    assert ops["loop_fusion"].kind == "fusion" and ops["loop_fusion"].phase == "other"
    # no metadata of its own or in its computation: it takes its operand's
    assert (ops["wrapped_reduce"].phase, ops["wrapped_reduce"].module) == ("forward", "encoder/block_*/mlp/fc1")
    assert profiling.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert profiling.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert profiling.kernel_kind("loop_add_fusion") == "unattributed"
    with pytest.raises(ValueError, match="HloModule"):
        profiling.hlo_module_name("ENTRY %main () -> f32[] {}")


@pytest.fixture(scope="session")
def tiny_step():
    model = vit.ViT(variant="Ti/16", depth=2, num_classes=10)
    images, labels = jnp.ones((4, 32, 32, 3)), jnp.zeros((4,), jnp.int32)
    tx = optax.adamw(1e-3)
    params = model.init(jax.random.key(0), images[:1])["params"]

    def step(state, images, labels):
        params, opt = state

        def loss_fn(p):
            logits = model.apply({"params": p}, images, train=True)[0]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    step = jax.jit(step, donate_argnums=0)
    state = [(params, tx.init(params))]
    hlo = step.lower(state[0], images, labels).compile().as_text()

    def run():
        state[0], loss = step(state[0], images, labels)
        jax.block_until_ready(loss)

    run()
    return run, hlo


def test_every_traced_event_of_a_training_step_is_attributed(tiny_step):
    run, hlo = tiny_step
    prof = profiling.profile_ops(run, hlo, steps=3)
    assert prof.unknown_ops == 0 and prof.busy_ms > 0 and prof.wall_ms > 0
    kinds = {key[0]: calls for key, _, calls in prof.by("kind")}
    # each dot of the entry computation runs once per step (per layer: 4 dense products forward,
    # their input, kernel and bias gradients, 2 attention products forward and 4 backward; and
    # the head's), and the trace sees every one
    entry_dots = len(re.findall(r"= \S+ dot\(", hlo[hlo.index("\nENTRY"):]))
    assert entry_dots > 30 and kinds["matmul"] == pytest.approx(entry_dots)
    assert kinds["conv"] == pytest.approx(2)  # the patch embedding and its kernel gradient
    modules = {key for key, _, _ in prof.by("phase", "module")}
    for layer in ("attn/qkv", "attn/out", "mlp/fc1", "mlp/fc2"):
        assert ("forward", f"encoder/block_*/{layer}") in modules
        assert ("backward", f"encoder/block_*/{layer}") in modules
    assert ("other", "") in modules  # the loss and the AdamW update
    table = prof.to_markdown("phase", "kind")
    assert table.startswith("| phase | kind | ms/step |") and "| forward | matmul |" in table


def test_profile_rejects_zero_steps(tiny_step):
    run, hlo = tiny_step
    with pytest.raises(ValueError, match="steps=0"):
        profiling.profile_ops(run, hlo, steps=0)
