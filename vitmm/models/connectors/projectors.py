"""LLaVA's projectors: ``identity``, ``linear`` and ``mlp`` (``mlp{depth}x_gelu``).

They keep every patch token (M = h·w); only the width changes. LLaVA-1.5 uses ``mlp`` with
depth 2 (Linear → GELU → Linear) on CLIP's penultimate layer.
"""

from __future__ import annotations

import flax.linen as nn

from vitmm.models import common, layers
from vitmm.models.connectors.base import MLP, check_tokens
from vitmm.models.connectors.budget import all_tokens


class Identity(nn.Module):
    out_dim: int
    budget: int | str | None = None

    @staticmethod
    def tokens(budget, grid, **settings):
        return all_tokens(budget, grid, "identity")

    @staticmethod
    def token_grid(budget, grid, **settings):
        all_tokens(budget, grid, "identity")
        return tuple(grid)

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        self.tokens(self.budget, grid)
        if x.shape[-1] != self.out_dim:
            raise ValueError(f"identity passes {x.shape[-1]} channels through but the LM expects "
                             f"{self.out_dim}; use linear or mlp.")
        return x


class Linear(nn.Module):
    out_dim: int
    budget: int | str | None = None

    @staticmethod
    def tokens(budget, grid, **settings):
        return all_tokens(budget, grid, "linear")

    @staticmethod
    def token_grid(budget, grid, **settings):
        all_tokens(budget, grid, "linear")
        return tuple(grid)

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        self.tokens(self.budget, grid)
        return layers.Dense(self.out_dim, kernel_init=common.trunc_normal(0.02), name="proj")(x)


class Mlp(nn.Module):
    out_dim: int
    budget: int | str | None = None
    depth: int = 2
    act: str = "gelu"
    hidden: int | None = None  # default: the LM width (LLaVA's)

    @staticmethod
    def tokens(budget, grid, **settings):
        return all_tokens(budget, grid, "mlp")

    @staticmethod
    def token_grid(budget, grid, **settings):
        all_tokens(budget, grid, "mlp")
        return tuple(grid)

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        self.tokens(self.budget, grid)
        return MLP(self.out_dim, self.depth, hidden=self.hidden, act=self.act, name="mlp")(x)
