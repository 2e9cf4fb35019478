"""The ``adapter:`` fields of FedTT's tensorized adapters (``kind: tt``).

Besides the bottleneck fields (``bottleneck_size`` 64, ``non_linearity`` relu, ``scaling`` 1,
``input_target_modules``) and the common ``target_modules``/``dropout``:

- ``tt_rank``: every internal TT rank r_1 .. r_{J-1} (r_0 = r_J = 1). 5 in FedTT (Table 11, Sec. 5.7).
- ``tt_shapes``: explicit mode lists, keyed ``"INxOUT"`` (e.g. ``{"384x64": [6, 8, 8, 8, 8]}``);
  the product of a list must be IN * OUT. They override the table and the factorization rule
  of :mod:`fedpeft.adapters.tt.shapes`.
- ``tt_max_mode``: the largest mode the factorization rule may use (16: the largest in Table 10).
- ``tt_classifier``: replace the hidden x hidden dense layer of the classification head
  (``pooler.dense`` for BERT and DeBERTa, ``classifier.dense`` for RoBERTa and MPNet,
  ``classification_head.dense`` for BART) by a trainable TT layer (FedTT Fig. 1c). ``auto``
  (default): only where the checkpoint did not provide that layer, i.e. where it would otherwise be
  a new dense hidden x hidden layer trained and sent in full (RoBERTa/DeBERTa/MPNet-style
  dense + out_proj heads and DeBERTa's pooler: 768 x 768 = 590k parameters, ten times FedTT's
  adapters); not where it is pretrained (BERT's pooler: MiniLM keeps it, frozen) nor on tiny random
  models (no checkpoint). ``true`` forces it (an error where the head has no such layer), ``false``
  keeps the dense layer. The TT layer starts from LoRETTA's random init either way.
- ``tt_up_init_scale``: multiplies the last core of every Up TT layer at init and, when not 1,
  zeroes the Up bias. 1 (default) is LoRETTA's init as the paper uses it: both projections are
  Xavier-like, so at round 0 every adapter adds about 30% of |h| to the residual stream; on
  all-MiniLM-L6-v2 that moves the final hidden state by 56% and the logits by 118% (a dense Houlsby
  adapter, N(0, 0.02): 10% and 17%), and the first rounds train the head on damaged features.
  A small value (1e-3) starts the adapter near identity, as LoRA's B = 0 does (centralised SST-2,
  AdamW 5e-3, batch 16: accuracy 0.675 vs 0.555 after 45 steps, 0.78 vs 0.725 after 135). Not 0:
  with an exactly zero core the other Up cores and Down get no gradient until it moves.
- ``tt_contraction``: how a TT layer is applied (:mod:`fedpeft.adapters.tt.layer`): ``rebuild``
  (default: W from the cores, then x @ W, LoRETTA's forward), ``direct`` (the activations through
  the cores one by one, W never built; needs mode lists whose leading modes multiply to IN, as
  every table and factorized shape does), ``auto`` (per layer and call, the cheaper of the two by
  :func:`~fedpeft.adapters.tt.layer.contraction_flops` for the number of tokens). All three compute
  the same function up to rounding (|diff| ~3e-6 on outputs of order 1 in fp32). ``rebuild`` stays
  the default: it keeps results bit-identical to earlier runs, and it is the faster one on CPU. By
  FLOPs ``direct`` wins already at adapter size (a 768 x 64 layer over 2,048 tokens: 29 MFLOP vs
  202 MFLOP, so ``auto`` picks it), yet its forward + backward took 31 ms vs 9 ms on one CPU thread
  (the permutes of the N x IN activations are memory-bound); 4096 x 64: 162 ms vs 52 ms.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedpeft.adapters.bottleneck import BottleneckOptions


class TTOptions(BottleneckOptions):
    tt_rank: int = Field(5, gt=0)
    tt_shapes: dict[str, list[int]] | None = None
    tt_max_mode: int = Field(16, ge=2)
    tt_classifier: bool | Literal["auto"] = "auto"
    tt_up_init_scale: float = Field(1.0, gt=0)
    tt_contraction: Literal["rebuild", "direct", "auto"] = "rebuild"

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
