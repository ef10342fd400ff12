"""Is a difference between two methods more than noise? Paired statistics over the questions both scored.

On LiHuaWorld's dev split one question is 0.5 points of R@5 overall and 4.5 on its 22 multi-hop
questions, so a mean alone cannot tell a gain from luck. For each method against a baseline, per
metric and question type, over the questions both have a value for:

- ``delta``: the mean of the per-question differences (method - baseline), in the metric's units;
- ``ci_low``, ``ci_high``: its 95% paired bootstrap interval (questions resampled with replacement,
  percentile interval);
- ``p_value``: a two-sided paired randomization test (each difference's sign flipped at random; exact
  enumeration when there are few questions), the chance of a mean difference at least this large if
  the two methods were interchangeable;
- ``p_adjusted``: Holm's step-down adjustment over every comparison of the run (many settings tried on
  a small split find noise: the adjustment keeps the chance of any false finding at 5%);
- ``wins``, ``losses``, ``ties``: questions where the method scored higher, lower, the same.

Every draw comes from one seeded generator, so a rerun prints the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RESAMPLES = 10_000  # bootstrap resamples and random sign flips
EXACT_UP_TO = 16  # questions up to which the randomization test enumerates all 2^n sign patterns
LEVEL = 0.95
ALPHA = 0.05  # significance after adjustment (summary.md marks it)
SEED = 0


def paired_bootstrap_ci(diffs: np.ndarray, rng: np.random.Generator, resamples: int = RESAMPLES) -> tuple[float, float]:
    """The 95% percentile interval of the mean of ``diffs`` over resamples of the questions."""
    n = len(diffs)
    means = np.empty(resamples)
    block = max(1, (1 << 22) // max(n, 1))  # resamples drawn a block at a time: never resamples x n at once
    for start in range(0, resamples, block):
        rows = min(block, resamples - start)
        means[start : start + rows] = diffs[rng.integers(0, n, (rows, n))].mean(axis=1)
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def mean_ci(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """The 95% bootstrap interval of the mean of one method's per-question values (a sweep point's)."""
    return paired_bootstrap_ci(values, rng) if len(values) else (math.nan, math.nan)


def sign_flip_p(diffs: np.ndarray, rng: np.random.Generator, resamples: int = RESAMPLES) -> float:
    """Two-sided p of the paired randomization test: the share of sign patterns whose mean difference is
    at least as far from zero as the observed one (all 2^n patterns for n <= EXACT_UP_TO, else
    ``resamples`` random ones, counting the observed one too)."""
    n = len(diffs)
    observed = abs(diffs.mean())
    tolerance = 1e-12 * max(1.0, float(np.abs(diffs).max()))  # equal means must count as equal
    if n <= EXACT_UP_TO:
        patterns = ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1) * 2 - 1
        return float(np.mean(np.abs(patterns @ diffs / n) >= observed - tolerance))
    hits = 0
    block = max(1, (1 << 22) // n)
    for start in range(0, resamples, block):
        rows = min(block, resamples - start)
        signs = rng.integers(0, 2, (rows, n)) * 2 - 1
        hits += int(np.sum(np.abs(signs @ diffs / n) >= observed - tolerance))
    return (hits + 1) / (resamples + 1)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (NaN stays NaN and does not count)."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (len(indexed) - rank) * p))
        adjusted[i] = running
    return adjusted


def compare(pairs: np.ndarray, rng: np.random.Generator) -> dict:
    """The statistics of one comparison from its (questions, 2) array of (method, baseline) values."""
    diffs = pairs[:, 0] - pairs[:, 1]
    if len(diffs) == 0:
        nan = math.nan
        return {
            "questions": 0,
            "delta": nan,
            "ci_low": nan,
            "ci_high": nan,
            "p_value": nan,
            "wins": 0,
            "losses": 0,
            "ties": 0,
        }
    low, high = paired_bootstrap_ci(diffs, rng)
    return {
        "questions": len(diffs),
        "delta": float(diffs.mean()),
        "ci_low": low,
        "ci_high": high,
        "p_value": sign_flip_p(diffs, rng),
        "wins": int(np.sum(diffs > 0)),
        "losses": int(np.sum(diffs < 0)),
        "ties": int(np.sum(diffs == 0)),
    }


def comparisons(records: list[dict], baseline: str, metrics: list[str], types: list[str]) -> list[dict]:
    """One row per (method other than ``baseline``, metric, scope): scope is the metric overall (``R@5``)
    or one question type (``R@5_multi``), as in summary.csv. ``records`` are qcg eval's per-question
    records; values pair by question id, and a question without a value on either side is left out."""
    rng = np.random.default_rng(SEED)
    values: dict[str, dict[str, dict]] = {}
    for r in records:
        values.setdefault(r["method"], {})[r["qid"]] = r
    base = values.get(baseline, {})
    rows = []
    for method, mine in values.items():
        if method == baseline:
            continue
        for metric in metrics:
            for qtype in [None, *types]:
                pairs = [
                    (mine[q][metric], base[q][metric])
                    for q in mine
                    if q in base
                    and (qtype is None or mine[q]["type"] == qtype)
                    and is_number(mine[q].get(metric))
                    and is_number(base[q].get(metric))
                ]
                if qtype is not None and not pairs:
                    continue  # a metric that does not apply to this type (Null questions have no evidence)
                name = metric if qtype is None else f"{metric}_{qtype}"
                stats = compare(np.array(pairs, dtype=np.float64).reshape(-1, 2), rng)
                rows.append({"method": method, "baseline": baseline, "metric": name, **stats})
    for row, adjusted in zip(rows, holm([row["p_value"] for row in rows])):
        row["p_adjusted"] = adjusted
    return rows


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)
