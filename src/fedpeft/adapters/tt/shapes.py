"""Which tensor shape (mode list k_1..k_J) a TT layer of a given matrix size uses.

A weight W of shape IN x OUT (``y = x @ W``) is reshaped, row-major, into a tensor of order J
whose modes multiply to IN * OUT (FedTT Sec. 3.2, Eq. 1). Three sources, in order:

1. the user's ``adapter.tt_shapes`` (keyed ``"INxOUT"``);
2. :data:`TABLE_SHAPES`: FedTT's Table 10 and LoRETTA's table (SPEC, "released code");
3. :func:`factorize_matrix`: IN and OUT factorized separately into the fewest modes no larger
   than ``tt_max_mode``, as balanced as possible (smallest largest mode), ascending; the input
   modes come first, so the leading modes multiply to IN, as in Table 10. This reproduces the
   table's 768 -> [8, 8, 12] and 4096 -> [16, 16, 16], and gives MiniLM's 384 -> [6, 8, 8].

A size with a prime factor above ``tt_max_mode`` (e.g. 50257, or 34 = 2 * 17 with the default 16)
cannot be factorized sensibly: that raises a :class:`ConfigError` naming ``adapter.tt_shapes``.
"""

from __future__ import annotations

from fedpeft.config import ConfigError

TABLE_SHAPES: dict[tuple[int, int], tuple[int, ...]] = {
    (768, 64): (8, 8, 12, 8, 8),  # Table 10, tensorized adapter (down)
    (64, 768): (8, 8, 12, 8, 8),  # Table 10 (up)
    (4096, 64): (16, 16, 16, 4, 4, 4),  # Table 10 (down, LLaMA-2-7B)
    (64, 4096): (4, 4, 4, 16, 16, 16),  # Table 10 (up)
    (1024, 64): (4, 8, 8, 8, 8, 4),  # LoRETTA's table (RoBERTa-large)
    (64, 1024): (4, 8, 8, 8, 8, 4),
    (768, 768): (12, 8, 8, 8, 8, 12),  # Table 10, tensorized classifier
}
"""(IN, OUT) -> modes from the papers. Table 10 lists 64 x 4096 as [4, 4, 4, 16, 16, 16] while
LoRETTA's code reuses [16, 16, 16, 4, 4, 4] for both directions; we follow the paper."""


def prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors


def factorize(n: int, max_mode: int) -> list[int]:
    """``n`` as the fewest factors <= ``max_mode``; among those, the smallest largest factor; ascending.

    Raises ``ValueError`` when ``n`` has a prime factor above ``max_mode``.
    """
    if n < 1:
        raise ValueError(f"cannot factorize {n}")
    if n == 1:
        return [1]
    too_big = [p for p in prime_factors(n) if p > max_mode]
    if too_big:
        raise ValueError(f"{n} has the prime factor {too_big[0]} > {max_mode}")
    count = 1
    while max_mode**count < n:
        count += 1
    while True:
        best = _balanced(n, count, max_mode)
        if best is not None:
            return best
        count += 1


def _balanced(n: int, count: int, max_mode: int) -> list[int] | None:
    """The ascending factorization of ``n`` into exactly ``count`` factors in [2, max_mode] with the
    smallest largest factor (ties: the larger smallest factor), or None if there is none."""
    best: list[int] | None = None

    def search(rest: int, parts: list[int]) -> None:
        nonlocal best
        if len(parts) == count - 1:
            if rest >= (parts[-1] if parts else 2) and rest <= max_mode:
                candidate = [*parts, rest]
                if best is None or (candidate[-1], -candidate[0]) < (best[-1], -best[0]):
                    best = candidate
            return
        low = parts[-1] if parts else 2
        for d in range(low, max_mode + 1):
            if rest % d == 0 and rest // d >= d:
                search(rest // d, [*parts, d])

    search(n, [])
    return best


def factorize_matrix(in_features: int, out_features: int, max_mode: int) -> list[int]:
    """Input modes then output modes (their products are IN and OUT)."""
    return factorize(in_features, max_mode) + factorize(out_features, max_mode)


def tt_shape(in_features: int, out_features: int, max_mode: int = 16,
             overrides: dict[str, list[int]] | None = None) -> list[int]:
    """The mode list of an IN x OUT TT layer: user override, else the papers' table, else the rule."""
    for key, modes in (overrides or {}).items():
        rows, cols = (int(p) for p in key.lower().split("x"))
        if (rows, cols) == (in_features, out_features):
            return list(modes)
    if (in_features, out_features) in TABLE_SHAPES:
        return list(TABLE_SHAPES[(in_features, out_features)])
    try:
        return factorize_matrix(in_features, out_features, max_mode)
    except ValueError as err:
        raise ConfigError(
            "adapter.tt_shapes",
            f"cannot factorize a {in_features} x {out_features} TT layer ({err}); give its modes as "
            f"adapter.tt_shapes['{in_features}x{out_features}'], raise adapter.tt_max_mode, "
            "or pick a bottleneck_size with small prime factors",
        ) from err
