"""Sparse top-k codec: keep the largest-magnitude entries, send values + where they are.

Top-k masks (FLASC, Kuo et al. 2024, Sec. 3 and Alg. 1 lines 5 and 11):

* ``global`` scope ranks the entries of *all* payload tensors together, as if they were one
  flattened, concatenated vector (the paper's ``P``; its default, "global sparsity tended to
  perform better");
* ``per_tensor`` keeps the same fraction of every tensor (the paper's layer-wise alternative).

``k = max(1, floor(density * n))`` entries are kept (the released code uses ``int(n * density)``;
the floor of 1 only matters for tiny tensors in ``per_tensor`` scope). Ties in magnitude go to the
lower flat index (a stable sort), so a mask is a deterministic function of the values. Exact zeros
are never sent even when they rank inside the top k: they carry no information and decode to zero
anyway, so at ``density: 1`` the codec is lossless and sends only the nonzero entries of an
already-sparse payload (this is how the FLASC-family algorithms use it).

Wire format (safetensors, like the dense codec): tensor ``values`` holds the kept values in flat
order of the concatenation, cast to the wire dtype; the positions go as one of

* ``bitmask``: one bit per entry of the concatenation (``ceil(N / 8)`` bytes, numpy bit order);
* ``indices``: the flat positions, increasing, in the smallest unsigned integer type that holds
  ``N - 1`` (uint8/uint16/uint32, else int64);
* ``dense``: no positions, ``values`` is the whole concatenation (wins when almost all is kept).

The codec builds every candidate and sends the shortest message, so the recorded bytes are the
real length of the smallest of the three encodings. Names and shapes travel in the metadata.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors.torch import save as st_save

from fedpeft.config import ConfigError, DirectionCodecConfig
from fedpeft.federated.codec import Codec, CodecError, _load, check_dtype, read_metadata, register_codec
from fedpeft.federated.types import State

Scope = Literal["global", "per_tensor"]
LAYOUTS = ("dense", "bitmask", "indices")


def keep_count(numel: int, density: float) -> int:
    """Entries kept out of ``numel`` at ``density``: ``max(1, floor(density * numel))`` (0 if empty)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if numel == 0:
        return 0
    return min(numel, max(1, math.floor(density * numel + 1e-9)))


def topk_flat_mask(values: torch.Tensor, density: float) -> torch.Tensor:
    """Boolean mask of the ``keep_count`` largest ``|values|`` of a 1-D tensor (ties: lower index)."""
    flat = values.reshape(-1)
    k = keep_count(flat.numel(), density)
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    if k == flat.numel():
        mask[:] = True
    elif k > 0:
        order = torch.sort(flat.detach().abs().to(torch.float32), descending=True, stable=True).indices
        mask[order[:k]] = True
    return mask


def topk_masks(state: State, density: float, scope: Scope = "global") -> dict[str, torch.Tensor]:
    """Top-k magnitude masks for every tensor of ``state`` (keys in sorted order define the concatenation)."""
    keys = sorted(state)
    if scope == "per_tensor":
        return {k: topk_flat_mask(state[k], density).reshape(state[k].shape) for k in keys}
    if scope != "global":
        raise ValueError(f"unknown scope {scope!r}; allowed: global, per_tensor")
    if not keys:
        return {}
    flat = torch.cat([state[k].detach().reshape(-1).to(torch.float32) for k in keys])
    mask = topk_flat_mask(flat, density)
    out, start = {}, 0
    for k in keys:
        n = state[k].numel()
        out[k] = mask[start : start + n].reshape(state[k].shape)
        start += n
    return out


def apply_masks(state: State, masks: dict[str, torch.Tensor]) -> State:
    """``state * mask`` per key (keys without a mask pass unchanged)."""
    return {k: v * masks[k].to(v.dtype) if k in masks else v for k, v in state.items()}


def topk_sparsify(state: State, density: float, scope: Scope = "global") -> State:
    """Zero all but the top-``density`` fraction of entries by magnitude (Alg. 1 lines 5/8 and 11/12)."""
    if density >= 1:
        return dict(state)
    return apply_masks(state, topk_masks(state, density, scope))


def index_dtype(numel: int) -> torch.dtype:
    """Smallest unsigned integer type that can hold every position ``0 .. numel - 1``."""
    for dtype, limit in ((torch.uint8, 1 << 8), (torch.uint16, 1 << 16), (torch.uint32, 1 << 32)):
        if numel <= limit:
            return dtype
    return torch.int64


class _TopKOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: Scope = "global"


@register_codec
class TopKCodec(Codec):
    """Global (or per-tensor) top-k by magnitude; values + bitmask or indices, whichever is smaller.

    ``codec.<dir>.density`` is the kept fraction, ``codec.<dir>.scope`` is ``global`` (default) or
    ``per_tensor``, ``codec.<dir>.dtype`` the wire dtype of the values. Decoding yields dense fp32
    tensors with zeros where nothing was sent.
    """

    kind = "topk"
    has_options = True
    reads_density = True

    def __init__(self, cfg: DirectionCodecConfig, direction: str = "up") -> None:
        super().__init__(cfg, direction)
        try:
            options = _TopKOptions.model_validate(cfg.model_extra or {})
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
            raise ConfigError(f"codec.{direction}.{field}", f"{message}; topk allows: scope (global, per_tensor)") \
                from None
        self.scope: Scope = options.scope
        self.density = cfg.density

    def encode(self, state: State) -> bytes:
        keys = sorted(state)
        shapes = [list(state[k].shape) for k in keys]
        flat = (torch.cat([state[k].detach().reshape(-1).to(torch.float32) for k in keys])
                if keys else torch.zeros(0))
        if self.density >= 1:
            keep = torch.ones(flat.numel(), dtype=torch.bool)
        else:
            masks = topk_masks(state, self.density, self.scope)
            keep = torch.cat([masks[k].reshape(-1) for k in keys]) if keys else torch.zeros(0, dtype=torch.bool)
        keep &= flat != 0
        return min((self._message(layout, keys, shapes, flat, keep) for layout in LAYOUTS), key=len)

    def _message(self, layout: str, keys: Sequence[str], shapes: Sequence[list[int]], flat: torch.Tensor,
                 keep: torch.Tensor) -> bytes:
        meta = {"codec": self.kind, "dtype": self.cfg.dtype, "layout": layout,
                "keys": json.dumps([[k, s] for k, s in zip(keys, shapes)])}
        if layout == "dense":
            tensors = {"values": (flat * keep).to(self.wire_dtype).contiguous()}
        elif layout == "bitmask":
            bits = np.packbits(keep.numpy())
            tensors = {"values": flat[keep].to(self.wire_dtype).contiguous(), "bitmask": torch.from_numpy(bits)}
        else:
            positions = torch.nonzero(keep).reshape(-1).to(index_dtype(flat.numel()))
            tensors = {"values": flat[keep].to(self.wire_dtype).contiguous(), "indices": positions.contiguous()}
        return st_save(tensors, metadata=meta)

    def decode(self, message: bytes) -> State:
        tensors = _load(message, self.kind)
        meta = read_metadata(message)
        try:
            entries = json.loads(meta["keys"])
            keys = [str(k) for k, _ in entries]
            shapes = [tuple(int(d) for d in s) for _, s in entries]
            layout = meta["layout"]
        except (KeyError, TypeError, ValueError) as err:
            raise CodecError(f"bad topk metadata: {err}") from err
        numel = sum(math.prod(s) for s in shapes)
        values = tensors.get("values")
        if values is None or values.dim() != 1:
            raise CodecError("topk message has no 1-D 'values' tensor")
        check_dtype("values", values, self.wire_dtype)
        values = values.to(torch.float32)
        flat = torch.zeros(numel, dtype=torch.float32)
        if layout == "dense":
            if values.numel() != numel:
                raise CodecError(f"dense layout holds {values.numel()} values for {numel} entries")
            flat = values.clone()
        elif layout == "bitmask":
            bits = tensors.get("bitmask")
            if bits is None or bits.dtype != torch.uint8 or bits.numel() != (numel + 7) // 8:
                raise CodecError("bitmask missing or of the wrong size")
            keep = torch.from_numpy(np.unpackbits(bits.numpy(), count=numel).astype(bool))
            if int(keep.sum()) != values.numel():
                raise CodecError(f"bitmask marks {int(keep.sum())} entries but {values.numel()} values were sent")
            flat[keep] = values
        elif layout == "indices":
            positions = tensors.get("indices")
            if positions is None or positions.dim() != 1 or positions.numel() != values.numel():
                raise CodecError("indices missing or not one per value")
            if positions.is_floating_point():
                raise CodecError(f"indices have dtype {positions.dtype}, not an integer type")
            positions = positions.to(torch.int64)
            if positions.numel() and (positions.min() < 0 or positions.max() >= numel
                                      or bool((positions[1:] <= positions[:-1]).any())):
                raise CodecError("indices out of range or not increasing")
            flat[positions] = values
        else:
            raise CodecError(f"unknown topk layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
        out, start = {}, 0
        for key, shape in zip(keys, shapes):
            n = math.prod(shape)
            out[key] = flat[start : start + n].reshape(shape)
            start += n
        return out


def message_layout(message: bytes) -> str:
    """Which layout a topk message used (``dense``, ``bitmask`` or ``indices``)."""
    return read_metadata(message).get("layout", "")
