"""FedPepTAO: layer-selected deep prompts with device/server adaptive optimisation (Che et al., 2023)."""

from fedpeft.methods.fedpeptao.algorithm import FedPepTAO

__all__ = ["FedPepTAO"]
