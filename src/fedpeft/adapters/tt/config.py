"""The ``adapter:`` fields of FedTT's tensorized adapters (``kind: tt``).

Besides the bottleneck fields (``bottleneck_size`` 64, ``non_linearity`` relu, ``scaling`` 1,
``input_target_modules``) and the common ``target_modules``/``dropout``:

- ``tt_rank``: every internal TT rank r_1 .. r_{J-1} (r_0 = r_J = 1). 5 in FedTT (Table 11, Sec. 5.7).
- ``tt_shapes``: explicit mode lists, keyed ``"INxOUT"`` (e.g. ``{"384x64": [6, 8, 8, 8, 8]}``);
  the product of a list must be IN * OUT. They override the table and the factorization rule
  of :mod:`fedpeft.adapters.tt.shapes`.
- ``tt_max_mode``: the largest mode the factorization rule may use (16: the largest in Table 10).
- ``tt_classifier``: replace the hidden x hidden dense layer of the classification head
  (``pooler.dense`` for BERT, ``classifier.dense`` for RoBERTa, ``classification_head.dense``
  for BART) by a trainable TT layer (FedTT Fig. 1c). Off by default: that layer is pretrained in
  BERT-style checkpoints (MiniLM), and the TT layer replacing it starts from LoRETTA's random init.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from fedpeft.adapters.bottleneck import BottleneckOptions


class TTOptions(BottleneckOptions):
    tt_rank: int = Field(5, gt=0)
    tt_shapes: dict[str, list[int]] | None = None
    tt_max_mode: int = Field(16, ge=2)
    tt_classifier: bool = False

    @field_validator("tt_shapes")
    @classmethod
    def _well_formed(cls, shapes: dict[str, list[int]] | None) -> dict[str, list[int]] | None:
        for key, modes in (shapes or {}).items():
            parts = key.lower().split("x")
            if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"key {key!r} must read IN x OUT, e.g. '384x64'")
            rows, cols = (int(p) for p in parts)
            if not modes or any(m < 1 for m in modes):
                raise ValueError(f"{key}: modes must be positive integers, got {modes}")
            product = 1
            for m in modes:
                product *= m
            if product != rows * cols:
                raise ValueError(f"{key}: the modes {modes} multiply to {product}, not {rows} * {cols} = {rows * cols}")
        return shapes
