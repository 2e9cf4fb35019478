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
