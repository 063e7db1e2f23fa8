"""A VLM's start, checked and fitted before anything trains: the connector's token budget on the
tower's grid, a pretrained tower's positions and patch kernel fitted to the run, LoRA's scale and
the kernels its adapters stand in for (frozen); the tower and LM settings a run builds from its
init folders (``vlm_parts``) and what a tower loaded from ``init.vision`` changes (``say_tower``)."""

from __future__ import annotations

import re

import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm.train import determinism, sources


def lora_alpha(config) -> float:
    """``lora.alpha``, or twice the rank when unset (the adapters' scale is alpha / rank)."""
    alpha = config.lora.get("alpha")
    if alpha is None:
        return 2.0 * config.lora.rank
    if alpha <= 0 and config.lora.rank > 0:
        raise ValueError(f"lora.alpha={alpha} scales the adapters to nothing (their scale is alpha / rank): leave it "
                         f"unset (2 x rank = {2 * config.lora.rank}) or set a positive value.")
    return float(alpha)


def check_lora_bases_frozen(config, adapters: dict) -> None:
    """LoRA trains its adapters instead of the kernels they adapt: ``optim.freeze`` must hold them."""
    freeze = tuple(config.optim.get("freeze") or ())
    trained = [name.replace(".", "/") for name in sorted(adapters)
               if not any(re.fullmatch(p, name.replace(".", "/") + "/kernel") for p in freeze)]
    if trained:
        more = f" (and {len(trained) - 1} more layers)" if len(trained) > 1 else ""
        raise ValueError(f"lora.rank={config.lora.rank} adapts {trained[0]}{more}, but "
                         f"optim.freeze={freeze} leaves their kernels training beside the adapters: add "
                         "'language/.*' to optim.freeze (as configs/llava_finetune.py:lora=8 does), or set "
                         "lora.rank=0 to train the LM itself.")


def inflate_patch_kernel(tower: dict, model_tower: dict) -> dict:
    """A 3-channel tower's patch kernel for ``t``-frame temporal patches (``temporal_patch``): the
    kernel repeated over the frames and divided by ``t``, so that a still image (its frames equal)
    embeds as before (I3D's inflation)."""
    have, want = tower.get("embedding", {}).get("kernel"), model_tower.get("embedding", {}).get("kernel")
    if have is None or want is None or have.shape == want.shape or want.shape[2] % have.shape[2]:
        return tower
    t = want.shape[2] // have.shape[2]
    return {**tower, "embedding": {**tower["embedding"], "kernel": np.tile(np.asarray(have), (1, 1, t, 1)) / t}}


def fit_positions(tower: dict, model_tower: dict, vision: dict) -> dict:
    """A pretrained tower's learned position table resampled to the run's grid (the source's
    method, ``posemb_resample``) when the run's image size differs from the tower's."""
    from vitmm.models.vit_tools import resize_posemb

    have, want = tower.get("pos_embedding"), model_tower.get("pos_embedding")
    if have is None or want is None or have.shape == want.shape:
        return tower
    return resize_posemb(tower, tuple(want.shape[1:3]), vision.get("posemb_resample", "bicubic_aa"))


def check_budget(connector: dict, vision: dict, image_size) -> None:
    """The connector's token count on the tower's grid, checked before anything is allocated:
    a budget the family cannot produce, or more visual tokens than the patches they summarise."""
    from vitmm.models import connectors
    from vitmm.models.patch_embed import to_pair
    from vitmm.models.vit import ViT

    grid = tuple(ViT(**vision).grid(to_pair(image_size, "image_size")))
    tokens = connectors.num_visual_tokens(connector, grid)
    if tokens > grid[0] * grid[1]:
        raise connectors.BudgetError(
            f"connector {connector.get('name')!r} with budget {connector.get('budget')!r} gives {tokens} visual "
            f"tokens, more than the {grid[0]}x{grid[1]} = {grid[0] * grid[1]} patches it summarises; choose a "
            f"budget of at most {grid[0] * grid[1]}.")


def say_tower(config, folder, tower_config: dict, tower: dict, replaced: bool) -> None:
    """Says (process 0) that the tower saved in ``folder`` replaces ``model.vision``, and when the
    run's ``input.image_size`` differs from the one that tower was trained or converted for (its
    positions are fitted to the run's grid: ``fit_positions``), as an imported VLM's start reports it."""
    import jax

    lines = [f"model.vision is replaced by the tower saved in {folder}: {tower}"] if replaced else []
    own, made = _plain(config.input.get("image_size")), _plain((tower_config.get("input") or {}).get("image_size"))
    if own is not None and made is not None and _pair(own) != _pair(made):
        lines.append(f"input.image_size {own}: the tower saved in {folder} was made for input.image_size {made}; "
                     f"the run feeds it {own} (its positions fitted to that grid)")
    for line in lines if jax.process_index() == 0 else ():
        print(line, flush=True)


def _plain(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def _pair(value):
    return list(value) if isinstance(value, list) else [value, value]


# Settings that choose how to compute, not the weights: the run's own hold over a checkpoint's.
KERNEL_KEYS = ("attn_impl", "remat_policy")


def _with_run_kernels(saved: dict, run: dict | None) -> dict:
    return {**saved, **{k: run[k] for k in KERNEL_KEYS if run and run.get(k) is not None}}


def _set(settings: dict) -> dict:
    """``settings`` without kernel keys left at None (the model's default), which a config always holds
    and a checkpoint from before the keys existed does not: no difference to report."""
    return {k: v for k, v in settings.items() if not (k in KERNEL_KEYS and v is None)}


def vlm_parts(config, say: bool = False) -> tuple[dict, dict]:
    """``(tower settings, LM settings)`` of a VLM run: read from the checkpoints ``init.vision``
    and ``init.lm`` point at (what built them), otherwise ``model.vision`` / ``model.lm``. A
    config value that a checkpoint overrides is reported with ``say`` (once, as the run starts from
    those folders: not again on a resume, nor by every reader of the settings), never silently mixed in; the run's
    ``attn_impl`` (e.g. ``cudnn`` on a GPU) and ``remat_policy`` apply to a loaded tower or LM too."""
    vision = config.model.vision.to_dict() if config.model.get("vision") else None
    lm = config.model.lm.to_dict()
    found = {key: sources.existing_folder(config, key) for key in ("vision", "lm")}
    if found["vision"]:
        tower_config = ckpt_lib.load_config(found["vision"])
        saved = (tower_config.get("model") or {}).get("image")
        if saved is None:
            raise ValueError(f"{found['vision']} does not say how its image tower was built (no model.image in "
                             "its config); use a `python -m vitmm.train` workdir or a `python -m vitmm.interop` "
                             "folder.")
        saved = _with_run_kernels(saved, vision)
        if say:
            say_tower(config, found["vision"], tower_config, saved,
                                vision is not None and _set(vision) != _set(saved))
        vision = saved
    if vision is None:
        raise ValueError("The VLM has no tower: set --config.init.vision=DIR (or model.vision for a random tower).")
    if found["lm"]:
        saved = (ckpt_lib.load_config(found["lm"]).get("model") or {}).get("lm")
        if saved is None:
            raise ValueError(f"{found['lm']} holds no language model settings (model.lm); convert one with "
                             "`python -m vitmm.interop --from hf|gguf`.")
        lm = _with_run_kernels(saved, lm)
    return determinism.attention(vision, config, "the tower"), determinism.attention(lm, config, "the LM")
