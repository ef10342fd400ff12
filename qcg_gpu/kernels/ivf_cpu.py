"""The approximate kNN graph's inner loop (``indexing/ivf.py``, METHOD.md index step 4): rows against
the members of the inverted lists they probe, each row's k best kept exactly, in one call.

Lists go in turn; within a list, the rows that probe it run in parallel (a row probes a list once, so
no two threads write one row). For each member, a float32 dot product (any summation order: the
bound holds for all) decides whether it can enter the row's k best: below the k-th exact score less
the row's float32 error bound (``slack``), it cannot. The others are scored by ``exact_dot``, the
arithmetic of every kNN path, and inserted by (score desc, id asc). Every member of a probed list is
looked at, so the k best are exact whatever order the lists and blocks come in.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np

from .pair_dots import exact_dot

Lists = namedtuple("Lists", ["order", "starts"])
Lists.__doc__ = "The base's members of list l: ``order[starts[l]:starts[l + 1]]`` (row numbers in the base)."

Probes = namedtuple("Probes", ["lists", "rows", "starts"])
Probes.__doc__ = "Probed list g is ``lists[g]``; the rows that probe it are ``rows[starts[g]:starts[g + 1]]``."

Best = namedtuple("Best", ["ids", "scores", "slack"])
Best.__doc__ = """Each row's k best so far (node ids and float64 scores, best first; id PAD and -inf where
missing), updated in place, and its float32 error bound."""


@numba.njit(fastmath=True, cache=True)
def _approximate_dot(x, y):
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        total += x[j] * y[j]
    return total


@numba.njit(cache=True)
def _insert(ids, scores, node: int, score: float) -> None:
    """Put (node, score) into a row's ranked k best, if it belongs there."""
    k = len(ids)
    if score < scores[k - 1] or (score == scores[k - 1] and node > ids[k - 1]):
        return
    i = k - 1
    while i > 0 and (scores[i - 1] < score or (scores[i - 1] == score and ids[i - 1] > node)):
        ids[i], scores[i] = ids[i - 1], scores[i - 1]
        i -= 1
    ids[i], scores[i] = node, score


@numba.njit(parallel=True, cache=True)
def probe_lists(rows, row_ids, base, base_ids, lists, probes, best):
    for g in range(len(probes.lists)):
        lo, hi = lists.starts[probes.lists[g]], lists.starts[probes.lists[g] + 1]
        first = probes.starts[g]
        for w in numba.prange(probes.starts[g + 1] - first):
            r = probes.rows[first + w]
            ids, scores = best.ids[r], best.scores[r]
            for p in range(lo, hi):
                m = lists.order[p]
                node = base_ids[m]
                if node == row_ids[r]:
                    continue
                if _approximate_dot(rows[r], base[m]) < scores[len(scores) - 1] - best.slack[r]:
                    continue
                _insert(ids, scores, node, exact_dot(rows[r], base[m]))
