"""pass@k: the chance that at least one of k samples, drawn from a problem's n, passes.

The unbiased estimator of Chen et al. (2021), the one bigcode-evaluation-harness (and through it
MergeBench's coding score: n=10 samples at temperature 0.2, pass@1) reports: with c of n samples
correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over problems. It is computed here in exact
integer arithmetic and rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import comb

from featcal.errors import InvalidParameterError


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem.

    Args:
        n: Samples generated for it (>= 1).
        c: How many of them passed (0 <= c <= n).
        k: Samples drawn (1 <= k <= n).

    Returns:
        ``1 - C(n-c, k) / C(n, k)``: 1.0 when fewer than k samples failed.

    Raises:
        InvalidParameterError: for counts outside those ranges.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidParameterError(name, value, "a whole number", owner="pass@k")
    if n < 1:
        raise InvalidParameterError("n", n, "at least 1", owner="pass@k")
    if not 0 <= c <= n:
        raise InvalidParameterError("c", c, f"between 0 and n={n}", owner="pass@k")
    if not 1 <= k <= n:
        raise InvalidParameterError("k", k, f"between 1 and the samples per problem, n={n}", owner="pass@k")
    return float(_exact(n, c, k))


def _exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k over problems: the mean of each problem's estimate.

    Args:
        counts: ``(n, c)`` of each problem: samples, and how many passed.
        k: Samples drawn.

    Returns:
        The mean of :func:`pass_at_k` over the problems.

    Raises:
        InvalidParameterError: for no problems, or counts :func:`pass_at_k` refuses.
    """
    if not counts:
        raise InvalidParameterError("counts", list(counts), "at least one problem's (n, c)", owner="pass@k")
    for n, c in counts:
        pass_at_k(n, c, k)  # validates
    total = sum((_exact(n, c, k) for n, c in counts), Fraction(0))
    return float(total / len(counts))
