"""FeDeRA (Yan et al., ``001_...txt``): LoRA initialised from the SVD of the pretrained weight.

Registers the LoRA init ``svd`` (``adapter.init: svd``). For every LoRA-wrapped weight
W0 (out x in, the paper's d x k), with the exact SVD W0 = U diag(S) V^T (Eq. 6-7):

    B = U[:, :r] sqrt(S[:r])          (Eq. 9,  out x r)
    A = sqrt(S[:r]) V[:, :r]^T        (Eq. 8,  r x in)
    W0 <- W0 - scale * B A            (Eq. 10, scale = alpha / r of Eq. 5)

so the model's output is unchanged at round 0. The paper writes Eq. 10 as W0 - BA because its
default alpha = r makes scale = 1; we subtract ``scale * B A``, which keeps the output unchanged
for any alpha. Where alpha != r reasonable people differ on what A and B should hold:
``adapter.svd_absorb_scale: true`` divides the singular values by ``scale`` first (as HF PEFT's
PiSSA init does), so that ``scale * B A`` is exactly the top-r part of W0 and the frozen residual
is exactly the rest of the spectrum; the default (false) keeps Eq. 8-9 literally.

Methods that mask or slice LoRA entries in the model a client trains (FLASC's download mask,
SparseAdapter, Adapter-LTH, Federated Select, HetLoRA's rank slices, a ``topk`` download codec)
would cut W0's principal part out of it, so they refuse this init (:func:`refuse_svd_init`).
Head pruning keeps it: a pruned head is removed from the base weight and from B together (its rows
of both are sliced away), so every kept head computes exactly its W0 rows at the start.

The SVD is exact (``torch.linalg.svd``, computed in float64, no randomised low-rank solver) and
runs single-threaded: LAPACK's result depends (in the last bits) on the thread count, which
differs between machines. So every client and the server, each building the model from the same
pretrained weights with the same torch build, derive bit-identical A, B and residual without any
of it crossing the network. The SPEC notes no public
FeDeRA code exists; HF PEFT's PiSSA is the same subtraction (Eq. 10).
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from pydantic import BaseModel, ConfigDict, ValidationError

from fedpeft.adapters.lora import LORA_INIT_OPTIONS, LORA_INITS
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone
from fedpeft.seeding import single_thread


class SvdInitOptions(BaseModel):
    """The ``adapter.*`` fields the ``svd`` init reads beyond the common LoRA ones."""

    model_config = ConfigDict(extra="ignore")

    svd_absorb_scale: bool = False


def svd_lora_factors(weight: torch.Tensor, rank: int, scale: float, absorb_scale: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, B, residual)`` of Eq. 8-10 for ``weight`` (out x in), in ``weight``'s dtype.

    ``residual + scale * B @ A`` reproduces ``weight`` (up to rounding). The SVD runs in float64
    so the residual loses no precision to the decomposition itself.
    """
    if rank > min(weight.shape):
        raise ConfigError("adapter.r", f"rank {rank} exceeds min{tuple(weight.shape)} of a target weight")
    w64 = weight.detach().to(torch.float64)
    with single_thread():
        u, s, vh = torch.linalg.svd(w64, full_matrices=False)
        s_r = s[:rank] / scale if absorb_scale else s[:rank]
        root = torch.sqrt(s_r)
        a = root[:, None] * vh[:rank]  # Eq. 8: rows sqrt(sigma_i) v_i^T
        b = u[:, :rank] * root[None, :]  # Eq. 9: columns sqrt(sigma_i) u_i
        residual = w64 - scale * (b @ a)  # Eq. 10
    return a.to(weight.dtype), b.to(weight.dtype), residual.to(weight.dtype)


@torch.no_grad()
def apply_svd_init(backbone: Backbone, cfg: AdapterConfig) -> None:
    """Replace each LoRA layer's A, B and frozen base weight by Eq. 8-10."""
    try:
        options = SvdInitOptions.model_validate(cfg.model_dump())
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"adapter.{first['loc'][0]}", first["msg"]) from None
    layers = [m for m in backbone.model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise ConfigError("adapter.target_modules", "the svd init found no LoRA layers to initialise")
    for layer in layers:
        for name in layer.lora_A:
            base = layer.get_base_layer()
            fan_in_fan_out = getattr(layer, "fan_in_fan_out", False)
            weight = base.weight.T if fan_in_fan_out else base.weight  # as (out, in), like nn.Linear
            a, b, residual = svd_lora_factors(weight, layer.r[name], layer.scaling[name], options.svd_absorb_scale)
            layer.lora_A[name].weight.copy_(a)
            layer.lora_B[name].weight.copy_(b)
            base.weight.copy_(residual.T if fan_in_fan_out else residual)


LORA_INITS["svd"] = apply_svd_init
LORA_INIT_OPTIONS["svd"] = SvdInitOptions


def refuse_svd_init(cfg: AdapterConfig, masking: str) -> None:
    """Stop before training when the svd init meets ``masking``, something that zeroes LoRA entries
    in the model clients train: with the SVD init those entries hold part of W0 (Eq. 10)."""
    if cfg.init == "svd":
        raise ConfigError("adapter.init", f"svd puts W0's top-r part into LoRA A and B (the frozen residual is "
                          f"W0 - scale*B0*A0), so {masking} would cut pretrained weight out of the model; use "
                          "init kaiming or gaussian")
