"""The tensor-train (TT) linear layer of FedTT (Sec. 3.2, Eq. 1; Sec. 4.1).

The weight W (IN x OUT, ``y = x @ W + b``) is stored only as cores G_1..G_J,
G_j of shape (r_{j-1}, k_j, r_j) with r_0 = r_J = 1 and prod(k_j) = IN * OUT:
W = reshape(G_1 x_{3,1} G_2 x_{3,1} ... x_{3,1} G_J, IN x OUT) (row-major over the modes).

Forward: the cores are contracted into the small IN x OUT matrix, which is then applied, as
LoRETTA's ``forward_tt_full_precision`` does. The paper contracts the cores with the activations
directly; for adapter-sized layers the rebuild is cheaper: it costs O(IN * OUT * r) once per
forward, independent of the batch, after which the layer is one dense matmul, whereas contracting
each token's activations through the chain costs a multiple of that per token. Either way only
the cores are stored, trained and sent.

Initialisation (LoRETTA, ``TensorTrain.build_factors_Gaussian``): G_j ~ N(0, 1) / sqrt(r_j) *
sigma^(1/J) with sigma = sqrt(1 / (IN + OUT)); every entry of the rebuilt W then has variance
sigma^2 (Xavier-like). The bias ~ U(-1/sqrt(OUT), 1/sqrt(OUT)) as in LoRETTA's
``TensorizedLinear_module``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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


class TTLinear(nn.Module):
    """``y = x @ W + b`` with W stored as TT cores (``cores.0`` .. ``cores.{J-1}``)."""

    def __init__(self, in_features: int, out_features: int, modes: Sequence[int], rank: int,
                 bias: bool = True) -> None:
        super().__init__()
        if math.prod(modes) != in_features * out_features:
            raise ValueError(f"modes {list(modes)} multiply to {math.prod(modes)}, not {in_features} * {out_features}")
        self.in_features = in_features
        self.out_features = out_features
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight_matrix().to(x.dtype)
        return out + self.bias.to(x.dtype) if self.bias is not None else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, modes={self.modes}, "
                f"rank={self.ranks[1]}")
