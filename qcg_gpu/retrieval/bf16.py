"""The error bound that makes a bf16 similarity GEMM a safe prefilter: every node whose bf16
similarity is within the bound of a seed's is rescored exactly, so the seeds are the float32
path's. Both backends use it (numpy_backend on AMX CPUs, torch_backend on GPUs)."""

from __future__ import annotations

import numpy as np

BF16_UNIT_ROUNDOFF = 2.0**-8


def bf16_rounding(nodes: np.ndarray, nodes_bf16) -> tuple[float, float]:
    """max |u| and max |u - bf16(u)| over the nodes (float64, in blocks): the node side of the bound."""
    norm = residual = 0.0
    for start in range(0, len(nodes), 65536):
        exact = np.asarray(nodes[start : start + 65536], np.float64)
        rounded = nodes_bf16[start : start + 65536].double().cpu().numpy()
        norm = max(norm, float(np.linalg.norm(exact, axis=1).max()))
        residual = max(residual, float(np.linalg.norm(exact - rounded, axis=1).max()))
    return norm, residual


def bf16_error_bound(queries, rounded, node_norm: float, node_residual: float):
    """Per query, a bound on |q.u - bf16_gemm(q, u)| over every node u, from the float64 queries
    and their bf16 rounding (tensors; the numpy path computes the same norms in a numba kernel)."""

    def norms(x):
        return (x * x).sum(1) ** 0.5

    return bound_from_norms(
        norms(queries), norms(rounded), norms(queries - rounded), queries.shape[1], node_norm, node_residual
    )


def bound_from_norms(q_norm, rounded_norm, residual_norm, dim: int, node_norm: float, node_residual: float):
    """The bound from the query norms |q|, |q~| and |q - q~| (arrays or tensors):
    |q.u - q~.u~| <= |q| |u - u~| + |q - q~| |u~|, plus the float32 accumulation of d products
    and the rounding of the output to bf16 (relative 2^-8), with 1e-6 to spare."""
    gemm = rounded_norm * (node_norm + node_residual)  # >= |q~.u~|
    bound = q_norm * node_residual + residual_norm * (node_norm + node_residual)
    return bound + gemm * (dim * 2.0**-24 + BF16_UNIT_ROUNDOFF * (1 + dim * 2.0**-24)) + 1e-6
