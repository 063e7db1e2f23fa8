"""Images at their own sizes: the NaFlex patch budget and packed batches for ``models.packing``.

    naflex_size(480, 640, patch=16, max_num_patches=256)   # → (224, 288): a 14×18 grid, 252 patches

``naflex_size`` (SigLIP 2's NaFlex, Tschannen et al. 2025): an image is resized to the largest
size whose patch grid fits ``max_num_patches`` with its aspect ratio kept, so the token count is a
function of the image size alone. The rule, exactly: among scales ``s ≤ max_scale``, take the
largest for which ``ceil(s·H/p) · ceil(s·W/p) ≤ max_num_patches``; the new size is
``(p·ceil(s·H/p), p·ceil(s·W/p))``, at least one patch a side. The count only grows with ``s``
and only jumps where ``s·H/p`` or ``s·W/p`` crosses an integer, so the largest such scale is one
of those points (``s = k·p/H`` or ``k·p/W``), which this searches in exact integer arithmetic:
the same sizes as the transformers SigLIP 2 image processor's bisection (tested against its stored
output for 400 sizes and budgets).
"""

from __future__ import annotations

import math
from fractions import Fraction


def naflex_size(height: int, width: int, patch: int, max_num_patches: int,
                max_scale: float = 100.0) -> tuple[int, int]:
    """The ``(height, width)`` in pixels (multiples of ``patch``) that an image of ``height × width``
    takes under a budget of ``max_num_patches`` patches; see the module docstring for the rule.
    ``max_scale`` caps upscaling (100 in SigLIP 2's processor)."""
    if min(height, width, patch) < 1 or max_num_patches < 1:
        raise ValueError(f"naflex_size needs positive sizes and budget, got image {height}x{width}, "
                         f"patch {patch}, max_num_patches {max_num_patches}.")

    def grid(scale: Fraction) -> tuple[int, int]:
        return tuple(max(1, math.ceil(scale * side / patch)) for side in (height, width))

    cap = Fraction(max_scale)
    best = Fraction(0)
    # Candidate scales: where one side's grid reaches k (the count is constant just above each).
    for side in (height, width):
        # grids of k along this side need k ≤ max_num_patches; bisect k for the largest that fits
        lo, hi = 0, max_num_patches
        while lo < hi:
            k = (lo + hi + 1) // 2
            h, w = grid(min(Fraction(k * patch, side), cap))
            if h * w <= max_num_patches:
                lo = k
            else:
                hi = k - 1
        if lo:
            best = max(best, min(Fraction(lo * patch, side), cap))
    h, w = grid(best) if best else (1, 1)
    return h * patch, w * patch
