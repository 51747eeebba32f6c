"""Heavy-tailed draws (lognormal, Pareto) parametrised by their median, capped; seeded callers.

Used for environment step latency (`latency.py`) and Hanoi's per-episode horizon. Formulas
(float64, `random.Random`): lognormal X = median * exp(sigma * Z), Z ~ N(0, 1); Pareto
X = x_m * U^(-1/alpha), U ~ U(0, 1], with x_m = median / 2^(1/alpha) so that the median is
`median`; then X = min(X, cap). "constant" gives the median every time, "none" zero.
"""

from __future__ import annotations

import math
import random
import statistics

HEAVY_TAILED = ("lognormal", "pareto")
DISTRIBUTIONS = ("none", "constant", *HEAVY_TAILED)


def sample_heavy_tailed(
    rng: random.Random, distribution: str, median: float, shape: float, cap: float
) -> float:
    """One draw of `distribution` with the given median and shape (lognormal sigma or Pareto
    alpha), capped at `cap`; see the module docstring for the formulas."""
    if distribution == "none":
        return 0.0
    if distribution == "constant":
        x = median
    elif distribution == "lognormal":
        x = median * math.exp(shape * rng.gauss(0.0, 1.0))
    elif distribution == "pareto":
        x_m = median / 2.0 ** (1.0 / shape)
        x = x_m * (1.0 - rng.random()) ** (-1.0 / shape)  # 1 - U in (0, 1]
    else:
        raise ValueError(f"distribution={distribution!r}: use one of {DISTRIBUTIONS}")
    return min(x, cap)


def heavy_tailed_quantile(distribution: str, median: float, shape: float, q: float) -> float:
    """The q-quantile of the uncapped distribution (0 < q < 1), closed form: lognormal
    median * exp(sigma * Phi^-1(q)); Pareto x_m * (1 - q)^(-1/alpha)."""
    if distribution == "lognormal":
        return median * math.exp(shape * statistics.NormalDist().inv_cdf(q))
    if distribution == "pareto":
        return median / 2.0 ** (1.0 / shape) * (1.0 - q) ** (-1.0 / shape)
    raise ValueError(f"distribution={distribution!r}: use one of {HEAVY_TAILED}")
