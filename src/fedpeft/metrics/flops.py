"""FLOP counting with ``torch.utils.flop_counter`` that also sees CPU fused attention.

``FlopCounterMode`` knows the CUDA scaled-dot-product-attention kernels but not the CPU one
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), so on a CPU every
``sdpa`` model's attention matmuls counted as zero. Importing this module registers the same
formulas torch uses for the CUDA kernels (``sdpa_flop_count`` / ``sdpa_backward_flop_count``:
2 matmuls forward, 4 backward; causal masking is not discounted, as for CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten


def _registered(op: Any) -> bool:
    from torch.utils.flop_counter import flop_registry

    return op in flop_registry or getattr(op, "default", None) in flop_registry


if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu") and not _registered(
    _aten._scaled_dot_product_flash_attention_for_cpu
):

    @register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu)
    def _cpu_flash_attention_flop(query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size,
                                  *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)


if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward") and not _registered(
    _aten._scaled_dot_product_flash_attention_for_cpu_backward
):

    @register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _cpu_flash_attention_backward_flop(grad_out_shape: torch.Size, query_shape: torch.Size,
                                           key_shape: torch.Size, value_shape: torch.Size, *args: Any,
                                           out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def attention_block_flops(tokens: int, hidden: int, heads: int, head_dim: int, key_tokens: int | None = None,
                          backward: bool = False) -> int:
    """Analytic FLOPs (2 per multiply-add, ``FlopCounterMode``'s convention) of one multi-head
    attention block on one sequence: Q/K/V projections, scores ``Q K^T``, values ``A V`` and the
    output projection, for ``heads`` heads of width ``head_dim`` (pruned heads simply not counted).

    ``key_tokens`` is the key/value length (cross-attention; default ``tokens``). Biases, softmax,
    scaling and masks are not counted (neither are they by ``FlopCounterMode``). ``backward`` gives
    the backward pass with frozen projection weights (LoRA's case: only the input gradient of each
    projection, one product each) and the attention's four products (dQ, dK from dS; dA, dV from dY;
    fused kernels also recompute the scores, which ``FlopCounterMode`` counts as a fifth).
    This is the paper's Appendix A accounting (papers/003 Table 6) restricted to the attention block,
    at whatever sequence length the paper's T = 512 or a task's ``max_length`` calls for.
    """
    keys = tokens if key_tokens is None else key_tokens
    inner = heads * head_dim
    projections = 2 * hidden * inner * (tokens + 2 * keys + tokens)  # Q from queries, K and V from keys, output
    attention = 2 * 2 * heads * tokens * keys * head_dim  # Q K^T and A V
    return projections + (2 * attention if backward else attention)
