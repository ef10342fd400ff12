"""The error bounds that make a low-precision similarity GEMM a safe prefilter: every node whose
approximate similarity is within the bound of a seed's is rescored exactly (float64), so the seeds
do not depend on the precision.

- float32 (the "off" setting): products summed in float32, rounded inputs none.
- bf16 (numpy backend on AMX CPUs, torch backend on GPUs): vectors rounded to bf16, products
  summed in float32, the output rounded to bf16.
- int8 (numpy backend on x86 CPUs without AMX): each query row scaled by its own
  factor to codes of at most 127, every node by one shared factor to at most 127 (63 where the
  GEMM saturates: ``int8_gemm.node_code_max``), rounded; the GEMM's integer sums are exact, and
  the approximate similarity is that sum times 1 / (the two factors), in float32.

Both bounds are |q.u - q~.u~| <= |q| |u - u~| + |q - q~| |u~| (q~, u~ the rounded vectors as
real numbers), plus the rounding of the GEMM's own arithmetic."""

from __future__ import annotations

import numpy as np

BF16_UNIT_ROUNDOFF = 2.0**-8
INT8_MAX = 127.0
# the int8 similarity is float32(sum) * float32(unit), unit rounded from float64: three roundings
INT8_OUTPUT_ROUNDOFF = 2.0**-21
# Rows per pass over the nodes: the nodes may be a memory map, and each pass makes float64 temporaries
# of a block (25 MB at 384-d; 65,536 rows made 0.4 GB, a shard owner's peak over its shards' bytes).
NODE_BLOCK = 8192


def node_blocks(nodes: np.ndarray, dtype=np.float64):
    """(first row, the rows as ``dtype``) of each block of NODE_BLOCK rows."""
    for start in range(0, len(nodes), NODE_BLOCK):
        yield start, np.asarray(nodes[start : start + NODE_BLOCK], dtype)


def max_row_norm(nodes: np.ndarray) -> float:
    """max |u| over the nodes (float64, in blocks: a memory map is never copied whole): the node side of
    the float32 bound."""
    return max((float(np.linalg.norm(block, axis=1).max()) for _, block in node_blocks(nodes)), default=0.0)


def bf16_rounding(nodes: np.ndarray, nodes_bf16) -> tuple[float, float]:
    """max |u| and max |u - bf16(u)| over the nodes (float64, in blocks): the node side of the bound."""
    norm = residual = 0.0
    for start, exact in node_blocks(nodes):
        rounded = nodes_bf16[start : start + len(exact)].double().cpu().numpy()
        norm = max(norm, float(np.linalg.norm(exact, axis=1).max()))
        residual = max(residual, float(np.linalg.norm(exact - rounded, axis=1).max()))
    return norm, residual


def bf16_error_bound(queries, rounded, node_norm: float, node_residual: float):
    """Per query, a bound on |q.u - bf16_gemm(q, u)| over every node u, from the float64 queries
    and their bf16 rounding (tensors; the numpy path computes the same norms in a numba kernel)."""

    def norms(x):
        return (x * x).sum(1) ** 0.5

    return bound_from_norms(
        norms(queries),
        norms(rounded),
        norms(queries - rounded),
        node_norm,
        node_residual,
        bf16_roundoff(queries.shape[1]),
    )


def float32_roundoff(dim: int) -> float:
    """Relative error of a float32 GEMM's output, |fl(q.u) - q.u| <= gamma_d |q| |u| for ``dim``
    products summed in float32 (any order, FMA or not): gamma_d = d u / (1 - d u), u = 2^-24."""
    unit = dim * 2.0**-24
    return unit / (1 - unit)


def bf16_roundoff(dim: int) -> float:
    """Relative error of a bf16 GEMM's output: the float32 accumulation of ``dim`` products, then
    the rounding of the output to bf16 (relative 2^-8)."""
    return dim * 2.0**-24 + BF16_UNIT_ROUNDOFF * (1 + dim * 2.0**-24)


def bound_from_norms(q_norm, rounded_norm, residual_norm, node_norm: float, node_residual: float, roundoff: float):
    """The bound from the query norms |q|, |q~| and |q - q~| (arrays or tensors) and the nodes'
    largest |u| and |u - u~|: |q.u - q~.u~| <= |q| |u - u~| + |q - q~| |u~|, plus ``roundoff``
    times the GEMM's largest output, with 1e-6 to spare."""
    gemm = rounded_norm * (node_norm + node_residual)  # >= |q~.u~|
    bound = q_norm * node_residual + residual_norm * (node_norm + node_residual)
    return bound + gemm * roundoff + 1e-6


def int8_node_scale(nodes: np.ndarray, code_max: int) -> float:
    """The factor shared by every node: ``code_max`` (127, or 63 where the CPU's int8 GEMM saturates:
    ``int8_gemm.node_code_max``) / the largest |component| (in blocks: a memory map)."""
    peak = max((float(np.abs(block).max()) for _, block in node_blocks(nodes, np.float32)), default=0.0)
    return code_max / peak if peak > 0 else 1.0


def int8_row_scales(rows: np.ndarray) -> np.ndarray:
    """Each query's own factor: 127 / its largest |component| (1 for an all-zero row)."""
    peak = np.abs(rows).max(axis=1).astype(np.float64)
    return np.divide(INT8_MAX, peak, out=np.ones_like(peak), where=peak > 0)
