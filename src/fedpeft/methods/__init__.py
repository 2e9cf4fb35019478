"""Method-specific round logic, codecs and selectors. Importing this package registers them.

Each method lives in its own module and registers an :class:`~fedpeft.federated.algorithm.Algorithm`
subclass (and any codec or selector it brings); its recipe YAML names the algorithm.
"""

from fedpeft.methods import federa, fedpeptao, fedtt, flasc, headprune, hetlora, loss_gap, rolora

__all__ = ["federa", "fedpeptao", "fedtt", "flasc", "headprune", "hetlora", "loss_gap", "rolora"]
