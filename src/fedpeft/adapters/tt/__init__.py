"""FedTT's tensor-train adapters, laid out like an HF PEFT tuner: ``config`` (the ``adapter:``
fields), ``shapes`` (which TT shape a matrix gets), ``layer`` (the TT linear layer), ``model``
(injection into a backbone). Importing this package registers adapter kind ``tt``."""

from fedpeft.adapters.tt.config import TTOptions
from fedpeft.adapters.tt.layer import TTLinear, tt_contract
from fedpeft.adapters.tt.model import TTAdapter, tt_layers
from fedpeft.adapters.tt.shapes import TABLE_SHAPES, factorize, tt_shape

__all__ = ["TABLE_SHAPES", "TTAdapter", "TTLinear", "TTOptions", "factorize", "tt_contract", "tt_layers", "tt_shape"]
