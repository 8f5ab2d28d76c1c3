"""pass@k from n samples per problem: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
Models Trained on Code", eq. 1 and its numerically stable product form in Fig. 3):

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ],   c = correct samples of the problem's n

Test: `.venv/bin/python -m pytest tests/test_evaluate.py -q`
"""

from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them correct) is
    correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(correct_per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems, each with its own list of n sample outcomes."""
    if not correct_per_problem:
        raise ValueError("pass@k of no problems")
    return sum(pass_at_k(len(s), sum(map(bool, s)), k) for s in correct_per_problem) / len(correct_per_problem)
