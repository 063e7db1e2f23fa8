"""The options a ``ViT`` takes, each checked in one line before anything is built: the choices
(``POSEMBS``, ``POSEMB_LAYOUTS``, ``POOLS``, ``STEMS``) and the combinations that mean nothing."""

from __future__ import annotations

from vitmm.models import common
from vitmm.models import posemb as pe
from vitmm.models.patch_embed import SIZE_POLICIES, to_pair

POSEMBS = ("learn", "sincos2d", "rope2d", "none")
POSEMB_LAYOUTS = ("patches", "with_cls")
POOLS = ("tok", "gap", "map", "none")
STEMS = ("patch", "conv")


def check(vit, arch) -> None:
    """``ValueError`` naming the first option of ``vit`` (with its ``arch``: width, heads) that is
    unknown or does not go with the others."""
    common.check_choice("posemb", vit.posemb, POSEMBS)
    common.check_choice("posemb_layout", vit.posemb_layout, POSEMB_LAYOUTS)
    common.check_choice("pool", vit.pool, POOLS)
    common.check_choice("stem", vit.stem, STEMS)
    common.check_choice("posemb_resample", vit.posemb_resample, pe.RESAMPLE_METHODS)
    common.check_choice("size_policy", vit.size_policy, SIZE_POLICIES)
    if vit.pool == "tok" and not vit.class_token:
        raise ValueError("pool='tok' reads the CLS token; set class_token=True or pick gap/map.")
    if vit.fc_norm and not vit.final_norm:
        raise ValueError("fc_norm is the final norm moved to the pooled vector; final_norm=False has none.")
    if vit.fc_norm and vit.pool == "none":
        raise ValueError("fc_norm normalises the pooled vector; pool='none' has none. Drop fc_norm.")
    if vit.posemb_layout == "with_cls" and not vit.class_token:
        raise ValueError("posemb_layout='with_cls' needs class_token=True.")
    if vit.posemb_layout == "with_cls" and vit.posemb != "learn":
        raise ValueError(f"posemb_layout='with_cls' gives the CLS a learned position; posemb={vit.posemb!r} has none: "
                         "use posemb='learn' or posemb_layout='patches'.")
    if not 0 < vit.patch_keep <= 1:
        raise ValueError(f"patch_keep is the share of patches kept in training, in (0, 1]; got {vit.patch_keep}.")
    if vit.stem == "conv" and (vit.stride is not None or to_pair(vit.padding) != (0, 0)
                                or vit.embed_impl != "conv"):
        raise ValueError(f"stem='conv' (strided 3x3 convs to the patch size) takes no stride={vit.stride}, "
                         f"padding={vit.padding} or embed_impl={vit.embed_impl!r}: drop them, or use "
                         "stem='patch'.")
    if vit.stem_channels is not None and vit.stem != "conv":
        raise ValueError(f"stem_channels={vit.stem_channels} are the conv stem's; set stem='conv' or drop them.")
    common.check_choice("embed_impl", vit.embed_impl, ("conv", "unfold"))
    if vit.num_registers < 0:
        raise ValueError(f"num_registers must be >= 0, got {vit.num_registers}.")
    if arch.width % arch.num_heads:
        raise ValueError(f"width {arch.width} is not divisible by num_heads {arch.num_heads}.")
