"""The Hessian eigen-gap test of FedPepTAO's Algorithm 1 (lines 3-10).

The Hessian of a client's loss with respect to its prompt parameters (K of them, ~10^5) is only
touched through Hessian-vector products (Pearlmutter's double backward, :func:`hessian_vector_product`).
When K is small (``strategy.exact_max_dimension``) it is built from K products and its eigenvalues
are exact (``eigvalsh``, :func:`prompt_spectrum`), so Alg. 1 runs on the true spectrum. Otherwise
its spectrum is estimated by Lanczos with full re-orthogonalisation: m iterations give a
tridiagonal T_m whose eigenvalues (Ritz values) and squared first eigenvector components form the
stochastic Lanczos quadrature (SLQ) density, as in PyHessian, which the paper and the released code
use. With m = K the Ritz values are the exact eigenvalues (the tests check this against
``torch.linalg.eigvalsh`` of a dense Hessian on a tiny model). ``scipy.sparse.linalg.eigsh`` with
a ``LinearOperator`` gives the extreme eigenvalues (:func:`extreme_eigenvalues`), used to cross-check.

Ratio rules (both return r in [0, 1], the fraction of prompt parameters to keep exchanging):

* ``eigengap`` (Alg. 1): eigenvalues sorted ascending, k = the first index with
  lambda_{k+1} - lambda_k > 4 L, r = (K - k) / K. Lanczos resolves only the extremes of a spectrum
  of ~10^5 eigenvalues, so the K eigenvalues are read off the SLQ density
  (:func:`spectrum_from_density`: each Ritz value's K * weight eigenvalues spread evenly over its
  cell) and Alg. 1 runs on that list; gaps between two Ritz values of the bulk are not eigen-gaps.
  The Lanczos steps double (``lanczos_iterations`` up to ``lanczos_max_iterations``) until the ratio
  moves by at most ``ratio_tolerance`` between k and 2k steps, so the ratio does not depend on a
  too-short run; each doubling extends the same run (:class:`LanczosRun`), so it costs the final
  number of steps in products, not twice that. L is the
  constant of the "base function" B(Delta) = H(w^t) Delta - grad F(w^t + Delta) of line 7 (the paper
  writes H(w^t) - grad F, a matrix minus a vector: we read H(w^t) as the linear map it defines).
  We estimate it by the secant between 0 and the client's own Delta_i = w - w^t (line 3):
  L = ||H(w^t) Delta - (grad F(w^t + Delta) - grad F(w^t))|| / ||Delta||, two gradients and one
  Hessian-vector product. When no gap is that large the spectrum has no such split and r = 1.
* ``density`` (released code, ``get_ratio.py``): r(t) = 1 - (SLQ density mass below t), the density
  smoothed by Gaussians of variance 1e-5 * max(1, spectrum width); t rises from 0 in steps of 0.1
  until three successive changes of r are below 0.005; if r falls under half its first value the
  scan restarts with half the step. We integrate the Gaussians exactly (normal CDF) instead of on a
  10,000-point grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator, eigsh

Matvec = Callable[[torch.Tensor], torch.Tensor]


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def hessian_vector_product(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Matvec]:
    """The flat gradient of ``loss`` and v -> H v (H = d^2 loss / d params^2), by double backward.

    The gradient graph is built once; every product is one more backward pass through it. A 2-D
    input (m, K) gives the m products H v_j as rows, in one vectorised backward (``is_grads_batched``).
    """
    grads = torch.autograd.grad(loss, list(params), create_graph=True)
    gradient = flat(grads)

    def matvec(vector: torch.Tensor) -> torch.Tensor:  # H v where v lives (Lanczos keeps its basis on the CPU)
        batched = vector.dim() == 2
        product = torch.autograd.grad(gradient, list(params), grad_outputs=vector.to(gradient.device, gradient.dtype),
                                      retain_graph=True, is_grads_batched=batched)
        if batched:
            return torch.cat([p.reshape(vector.shape[0], -1) for p in product], dim=1).detach().to(vector.device)
        return flat(product).detach().to(vector.device)

    return gradient.detach(), matvec


class LanczosRun:
    """Lanczos from one random start, extendable: :meth:`extend` adds steps to the same Krylov basis, so
    the Ritz values after k and after 2k steps cost 2k products in all, not 3k.

    Full re-orthogonalisation (twice, in float64) keeps the basis orthogonal, so no ghost copies of
    converged eigenvalues appear. Stops for good on an invariant subspace (beta ~ 0).
    """

    def __init__(self, matvec: Matvec, dim: int, generator: torch.Generator) -> None:
        start = torch.randn(dim, generator=generator, dtype=torch.float64)
        self.matvec = matvec
        self.basis = [start / start.norm()]
        self.alphas: list[float] = []
        self.betas: list[float] = []  # betas[j] couples basis j and j + 1
        self.invariant = False

    @property
    def steps(self) -> int:
        return len(self.alphas)

    def extend(self, steps: int) -> None:
        """Run until ``steps`` steps in all (or an invariant subspace)."""
        while self.steps < steps and not self.invariant:
            j = self.steps
            w = self.matvec(self.basis[j].to(torch.float32)).to(torch.float64)
            alpha = float(w @ self.basis[j])
            self.alphas.append(alpha)
            stacked = torch.stack(self.basis)
            for _ in range(2):
                w = w - stacked.T @ (stacked @ w)
            beta = float(w.norm())
            if beta < 1e-10 * max(1.0, abs(alpha)) or len(self.basis) == w.numel():
                self.invariant = True
                break
            self.betas.append(beta)
            self.basis.append(w / beta)

    def ritz(self) -> tuple[np.ndarray, np.ndarray]:
        """Ritz values and SLQ weights (squared first components) of the steps run so far."""
        betas = self.betas[: self.steps - 1]
        tridiagonal = np.diag(self.alphas) + np.diag(betas, 1) + np.diag(betas, -1)
        values, vectors = np.linalg.eigh(tridiagonal)
        return values, vectors[0] ** 2


def lanczos(matvec: Matvec, dim: int, iterations: int, generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Ritz values and SLQ weights (squared first components) of ``min(iterations, dim)`` Lanczos steps."""
    run = LanczosRun(matvec, dim, generator)
    run.extend(min(iterations, dim))
    return run.ritz()


def slq_density(matvec: Matvec, dim: int, iterations: int, probes: int, generator: torch.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
    """Spectral density as (nodes, weights summing to 1), averaged over ``probes`` random starts."""
    runs = [LanczosRun(matvec, dim, generator) for _ in range(probes)]
    for run in runs:
        run.extend(min(iterations, dim))
    return _density(runs)


def _density(runs: Sequence[LanczosRun]) -> tuple[np.ndarray, np.ndarray]:
    ritz = [run.ritz() for run in runs]
    return np.concatenate([v for v, _ in ritz]), np.concatenate([m / len(runs) for _, m in ritz])


def extreme_eigenvalues(matvec: Matvec, dim: int, k: int, which: str = "LA") -> np.ndarray:
    """k extreme eigenvalues through scipy's ARPACK ``eigsh`` on a ``LinearOperator`` (sorted ascending)."""
    operator = LinearOperator((dim, dim), dtype=np.float64,
                              matvec=lambda v: matvec(torch.from_numpy(np.asarray(v, dtype=np.float64).ravel()))
                              .to(torch.float64).numpy())
    return np.sort(eigsh(operator, k=k, which=which, return_eigenvectors=False))


def secant_lipschitz(hessian_times_delta: torch.Tensor, gradient_at_current: torch.Tensor,
                     gradient_at_shifted: torch.Tensor, delta: torch.Tensor) -> float:
    """L of B(D) = H(w^t) D - grad F(w^t + D) between D = 0 and D = delta (Alg. 1 lines 7-8)."""
    norm = float(delta.norm())
    if norm == 0.0:
        return 0.0
    change = hessian_times_delta - (gradient_at_shifted - gradient_at_current)
    return float(change.norm()) / norm


def dense_hessian(matvec: Matvec, dim: int, chunk: int = 128) -> torch.Tensor:
    """The K x K Hessian from K Hessian-vector products, ``chunk`` unit vectors per batched call
    (``matvec`` takes (m, K) rows, see :func:`hessian_vector_product`), symmetrised in float64."""
    rows = [matvec(torch.eye(dim)[start : start + chunk]).to(torch.float64) for start in range(0, dim, chunk)]
    hessian = torch.cat(rows, dim=0)
    return 0.5 * (hessian + hessian.T)


def spectrum_from_density(nodes: np.ndarray, weights: np.ndarray, dimension: int) -> np.ndarray:
    """K eigenvalues read off an SLQ density: the sorted nodes cut the line into contiguous cells
    (boundaries halfway between neighbours, the end cells as wide outwards as inwards), and node j's
    K * w_j eigenvalues are spread evenly over its cell, eigenvalue k at the (k - 1/2) / K quantile.

    The spacing inside a cell is 1 / (K * density), so a gap appears only where the density is low;
    cells that left holes between them (half the distance to the *nearest* neighbour) invented gaps
    between Ritz values of a gapless bulk when few Lanczos steps were run."""
    order = np.argsort(nodes, kind="stable")
    theta, mass = nodes[order], weights[order] / weights.sum()
    if theta.size == 1:
        return np.full(dimension, theta[0])
    middle = 0.5 * (theta[1:] + theta[:-1])
    lower = np.concatenate([[2 * theta[0] - middle[0]], middle])
    upper = np.concatenate([middle, [2 * theta[-1] - middle[-1]]])
    quantiles = (np.arange(dimension) + 0.5) / dimension
    cumulative = np.cumsum(mass)
    cell = np.minimum(np.searchsorted(cumulative, quantiles, side="left"), theta.size - 1)
    within = (quantiles - (cumulative[cell] - mass[cell])) / np.maximum(mass[cell], 1e-300)
    return lower[cell] + (upper[cell] - lower[cell]) * np.clip(within, 0.0, 1.0)


def gap_ratio(eigenvalues: np.ndarray, lipschitz: float) -> float:
    """Alg. 1 lines 6, 9, 10 on K eigenvalues: (K - k) / K for the first k (ascending order) with
    lambda_{k+1} - lambda_k > 4 L; 1 when no gap is that wide."""
    ordered = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    wide = np.nonzero(np.diff(ordered) > 4.0 * lipschitz)[0]
    if wide.size == 0:
        return 1.0
    k = int(wide[0]) + 1
    return (ordered.size - k) / ordered.size


def eigengap_ratio(nodes: np.ndarray, weights: np.ndarray, lipschitz: float, dimension: int) -> float:
    """:func:`gap_ratio` on the ``dimension`` eigenvalues an SLQ density stands for
    (:func:`spectrum_from_density`)."""
    return gap_ratio(spectrum_from_density(nodes, weights, dimension), lipschitz)


@dataclass
class Spectrum:
    """The prompt Hessian's spectrum as the ratio rule sees it: exact eigenvalues (equal weights) or an
    SLQ density, and how it was obtained (``steps``: Lanczos steps of the last run, K for the exact path)."""

    nodes: np.ndarray
    weights: np.ndarray
    exact: bool
    steps: int
    converged: bool


def prompt_spectrum(matvec: Matvec, dim: int, ratio_of: Callable[[Spectrum], float], exact_max_dimension: int,
                    iterations: int, max_iterations: int, probes: int, tolerance: float, seed: int) -> Spectrum:
    """The spectrum for Alg. 1's ratio: dense ``eigvalsh`` of the Hessian when ``dim <= exact_max_dimension``
    (K products), else SLQ with ``iterations`` Lanczos steps, doubled (the same runs extended) until the ratio
    ``ratio_of`` gives moves by at most ``tolerance`` or ``max_iterations`` (or K) is reached; ``converged``
    says which ended it."""
    if dim <= exact_max_dimension:
        eigenvalues = torch.linalg.eigvalsh(dense_hessian(matvec, dim)).numpy()
        return Spectrum(eigenvalues, np.full(dim, 1.0 / dim), True, dim, True)
    generator = torch.Generator().manual_seed(seed)
    runs = [LanczosRun(matvec, dim, generator) for _ in range(probes)]
    steps = min(iterations, dim)
    previous: float | None = None
    while True:
        for run in runs:  # the same Krylov bases, extended: k then 2k steps cost 2k products
            run.extend(steps)
        nodes, weights = _density(runs)
        done = steps >= min(max_iterations, dim) or all(run.invariant for run in runs)
        spectrum = Spectrum(nodes, weights, False, steps, steps >= dim or all(run.invariant for run in runs))
        ratio = ratio_of(spectrum)
        if spectrum.converged or (previous is not None and abs(ratio - previous) <= tolerance):
            spectrum.converged = True
            return spectrum
        if done:
            return spectrum
        previous, steps = ratio, min(2 * steps, max_iterations, dim)


def density_ratio(nodes: np.ndarray, weights: np.ndarray, start: float = 0.0, step: float = 0.1,
                  tolerance: float = 0.005, sigma_squared: float = 1e-5, max_passes: int = 30) -> float:
    """The released code's rule: 1 - density mass below a threshold raised until the ratio is stable."""
    weights = weights / weights.sum()
    width = float(nodes.max() - nodes.min()) + 0.02
    scale = math.sqrt(sigma_squared * max(1.0, width))

    def ratio(threshold: float) -> float:
        z = (threshold - nodes) / (scale * math.sqrt(2.0))
        below = float((weights * 0.5 * (1.0 + np.vectorize(math.erf)(z))).sum())
        return 1.0 - below

    ratios = [ratio(start)]
    for _ in range(max_passes):
        threshold, ratios = start, [ratio(start)]
        while True:
            threshold += step
            ratios.append(ratio(threshold))
            if ratios[-1] < ratios[0] / 2:
                break
            recent = np.abs(np.diff(ratios[-4:]))
            if len(ratios) >= 4 and bool((recent < tolerance).all()):
                return ratios[-1]
        step /= 2
    return ratios[-1]


@dataclass
class RatioProbe:
    """What one client reports from the Hessian test (Alg. 1 lines 3-10); ``steps`` are Lanczos steps
    (K on the exact path) and ``converged`` whether the ratio was stable (always on the exact path)."""

    ratio: float
    lipschitz: float
    lambda_min: float
    lambda_max: float
    dimension: int
    exact: bool
    steps: int
    converged: bool

    def as_tensor(self) -> torch.Tensor:
        """The probe as it travels in the upload (:data:`RATIO_PROBE_FIELDS` order)."""
        return torch.tensor([self.ratio, self.lipschitz, self.lambda_min, self.lambda_max, float(self.exact),
                             float(self.steps), float(self.converged)], dtype=torch.float32)


RATIO_PROBE_FIELDS = ("ratio", "lipschitz", "lambda_min", "lambda_max", "exact", "steps", "converged")
