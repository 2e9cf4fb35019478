"""The tensor-train (TT) linear layer of FedTT (Sec. 3.2, Eq. 1; Sec. 4.1).

The weight W (IN x OUT, ``y = x @ W + b``) is stored only as cores G_1..G_J,
G_j of shape (r_{j-1}, k_j, r_j) with r_0 = r_J = 1 and prod(k_j) = IN * OUT:
W = reshape(G_1 x_{3,1} G_2 x_{3,1} ... x_{3,1} G_J, IN x OUT) (row-major over the modes).

Forward (``adapter.tt_contraction``), the same function either way, up to float rounding:

- ``rebuild``: the cores are contracted into the small IN x OUT matrix, which is then applied, as
  LoRETTA's ``forward_tt_full_precision`` does. It costs the chain once per forward, independent
  of the number of tokens N, then one dense N x IN x OUT matmul.
- ``direct``: the activations are contracted with the cores one at a time (the paper's Sec. 3.2):
  the input modes of x are absorbed by G_1 .. G_s (prod k_1..k_s = IN), leaving an N x r_s
  bond, which G_{s+1} .. G_J expand into the output modes. The IN x OUT matrix is never built;
  each step costs N times a product of one mode and two ranks, so it is the cheaper order when
  IN x OUT is large against the ranks (LLaMA widths), and it needs the mode list to split at IN.
- ``auto``: per layer and per call, whichever of the two :func:`contraction_flops` says is cheaper
  for the input's number of tokens.

Either way only the cores are stored, trained and sent.

Initialisation (LoRETTA, ``TensorTrain.build_factors_Gaussian``): G_j ~ N(0, 1) / sqrt(r_j) *
sigma^(1/J) with sigma = sqrt(1 / (IN + OUT)); every entry of the rebuilt W then has variance
sigma^2 (Xavier-like). The bias ~ U(-1/sqrt(OUT), 1/sqrt(OUT)) as in LoRETTA's
``TensorizedLinear_module``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn


def tt_ranks(num_modes: int, rank: int) -> list[int]:
    """(r_0, ..., r_J) = (1, rank, ..., rank, 1)."""
    return [1] + [rank] * (num_modes - 1) + [1]


def tt_contract(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """G_1 x_{3,1} ... x_{3,1} G_J (Eq. 1) as a flat vector of prod(k_j) entries, row-major."""
    result = cores[0].reshape(cores[0].shape[1], cores[0].shape[2])  # r_0 = 1
    for core in cores[1:]:
        rank_in, modes, rank_out = core.shape
        result = (result @ core.reshape(rank_in, modes * rank_out)).reshape(-1, rank_out)
    return result.reshape(-1)  # r_J = 1


Contraction = Literal["rebuild", "direct", "auto"]


def input_mode_count(modes: Sequence[int], in_features: int) -> int | None:
    """The s with prod(k_1..k_s) = IN (the input modes lead the list), or None when no prefix of
    ``modes`` multiplies to IN (then only the rebuild can apply the layer)."""
    product = 1
    for count, mode in enumerate(modes, start=1):
        product *= mode
        if product == in_features:
            return count
    return None


def contraction_flops(modes: Sequence[int], ranks: Sequence[int], in_features: int, tokens: int
                      ) -> dict[str, int | None]:
    """Multiply-add FLOPs (2 per multiply-add) of one forward of N = ``tokens`` rows, bias left out,
    per contraction order: ``rebuild`` (the chain G_1 .. G_J once, then x @ W) and ``direct`` (the
    activations through the cores, see :func:`tt_contract_direct`; None when the modes do not split
    at IN)."""
    out_features = math.prod(modes) // in_features
    chain, prefix = 0, modes[0]
    for j in range(1, len(modes)):  # (prefix x r_{j}) @ (r_{j} x k_{j+1} r_{j+1})
        chain += 2 * prefix * ranks[j] * modes[j] * ranks[j + 1]
        prefix *= modes[j]
    rebuild = chain + 2 * tokens * in_features * out_features
    split = input_mode_count(modes, in_features)
    if split is None:
        return {"rebuild": rebuild, "direct": None}
    direct, remaining = 0, in_features
    for j in range(split):  # absorb mode k_{j+1}: N x remaining x r_j -> N x remaining / k x r_{j+1}
        direct += 2 * tokens * remaining * ranks[j] * ranks[j + 1]
        remaining //= modes[j]
    produced = 1
    for j in range(split, len(modes)):  # expand: N x produced x r_j -> N x produced k x r_{j+1}
        direct += 2 * tokens * produced * ranks[j] * modes[j] * ranks[j + 1]
        produced *= modes[j]
    return {"rebuild": rebuild, "direct": direct}


def tt_contract_direct(x: torch.Tensor, cores: Sequence[torch.Tensor], split: int) -> torch.Tensor:
    """``x @ W`` for W = the TT cores (Eq. 1), without building W: rows of ``x`` (N x IN) are contracted
    with G_1 .. G_split over the input modes, then expanded by the output cores (N x OUT)."""
    tokens = x.shape[0]
    state = x.reshape(tokens, -1, 1)  # N x (remaining input modes) x r_0
    for core in cores[:split]:
        rank_in, mode, rank_out = core.shape
        # N x (k x rest) x r_in -> (N rest) x (k r_in) @ (k r_in) x r_out
        state = state.reshape(tokens, mode, -1, rank_in).permute(0, 2, 1, 3).reshape(-1, mode * rank_in)
        state = (state @ core.permute(1, 0, 2).reshape(mode * rank_in, rank_out)).reshape(tokens, -1, rank_out)
    for core in cores[split:]:
        rank_in, mode, rank_out = core.shape
        # N x produced x r_in -> N x (produced k) x r_out, output modes row-major
        state = (state.reshape(-1, rank_in) @ core.reshape(rank_in, mode * rank_out)).reshape(tokens, -1, rank_out)
    return state.reshape(tokens, -1)  # r_J = 1


class TTLinear(nn.Module):
    """``y = x @ W + b`` with W stored as TT cores (``cores.0`` .. ``cores.{J-1}``), applied by
    ``contraction`` (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, modes: Sequence[int], rank: int,
                 bias: bool = True, contraction: Contraction = "rebuild") -> None:
        super().__init__()
        if math.prod(modes) != in_features * out_features:
            raise ValueError(f"modes {list(modes)} multiply to {math.prod(modes)}, not {in_features} * {out_features}")
        self.split = input_mode_count(modes, in_features)
        if contraction == "direct" and self.split is None:
            raise ValueError(f"direct contraction needs modes whose leading ones multiply to {in_features}; "
                             f"{list(modes)} do not")
        self.in_features = in_features
        self.out_features = out_features
        self.contraction = contraction
        self.modes = list(modes)
        self.ranks = tt_ranks(len(modes), rank)
        self.cores = nn.ParameterList(
            nn.Parameter(torch.empty(self.ranks[j], k, self.ranks[j + 1])) for j, k in enumerate(self.modes)
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    @property
    def num_cores(self) -> int:
        return len(self.modes)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        sigma = math.sqrt(1.0 / (self.in_features + self.out_features))
        for j, core in enumerate(self.cores):
            core.normal_().mul_(sigma ** (1.0 / self.num_cores) / math.sqrt(self.ranks[j + 1]))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.out_features)
            self.bias.uniform_(-bound, bound)

    @torch.no_grad()
    def scale_init(self, factor: float) -> None:
        """Scale W by ``factor`` (through the last core) and zero the bias: a near-identity start
        for an adapter's Up projection (``adapter.tt_up_init_scale``)."""
        self.cores[-1].mul_(factor)
        if self.bias is not None:
            self.bias.zero_()

    def weight_matrix(self) -> torch.Tensor:
        """The IN x OUT matrix the cores represent."""
        return tt_contract(list(self.cores)).reshape(self.in_features, self.out_features)

    def uses_direct(self, tokens: int) -> bool:
        """Whether a forward over ``tokens`` rows contracts the activations with the cores."""
        if self.contraction != "auto":
            return self.contraction == "direct"
        flops = contraction_flops(self.modes, self.ranks, self.in_features, tokens)
        return flops["direct"] is not None and flops["direct"] < flops["rebuild"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // self.in_features
        if self.uses_direct(tokens):
            cores = [core.to(x.dtype) for core in self.cores]
            flat = tt_contract_direct(x.reshape(tokens, self.in_features), cores, self.split)
            out = flat.reshape(*x.shape[:-1], self.out_features)
        else:
            out = x @ self.weight_matrix().to(x.dtype)
        return out + self.bias.to(x.dtype) if self.bias is not None else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, modes={self.modes}, "
                f"rank={self.ranks[1]}, contraction={self.contraction}")
