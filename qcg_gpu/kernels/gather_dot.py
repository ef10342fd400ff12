"""Similarities of selected nodes to their query (METHOD.md, retrieval step 3): the sampled
dense-dense product ``sims[b, j] = nodes[ids[b, j]] . queries[b]``, only for the (query, node)
pairs a query selected.

The torch expression ``einsum("bld,bd->bl", nodes[ids], queries)`` first writes the gathered
rows, a (B, L, d) tensor (B = 4096 queries x L = 140 selected nodes x d = 384 in float32 is
880 MB per tile on a GPU), then reads them back. :func:`gather_dot` on CUDA runs a Triton
kernel that reads each selected row once and keeps the products in registers.

* :func:`gather_dot`: torch tensors; Triton on CUDA (or in Triton's interpreter, which runs it
  on CPU tensors: ``TRITON_INTERPRET=1``, how the tests check it without a GPU), the numba
  twin on CPU tensors, einsum elsewhere.
* :func:`gather_dot_cpu`: the numba twin, for numpy arrays.

``ids`` may hold -1 (padding): its similarity is 0 in every path, and callers mask it.
"""

from __future__ import annotations

import functools
import os

import numba
import numpy as np

BLOCK_ROWS = 32  # selected nodes per Triton program
BLOCK_DIM = 128  # embedding columns per step


@numba.njit(parallel=True, cache=True)
def gather_dot_cpu(nodes, queries, ids):
    rows, width = ids.shape
    out = np.zeros((rows, width), dtype=np.float32)
    for b in numba.prange(rows):
        for j in range(width):
            u = ids[b, j]
            if u >= 0:
                acc = np.float32(0.0)
                for c in range(nodes.shape[1]):
                    acc += nodes[u, c] * queries[b, c]
                out[b, j] = acc
    return out


def gather_dot(nodes, queries, ids):
    """(B, L) float32 tensor: ``nodes[ids[b, j]] . queries[b]``; 0 where ``ids`` is -1."""
    import torch

    if nodes.is_cuda or _interpreting():
        kernel = _triton_kernel()
        if kernel is not None:
            nodes, ids, queries = nodes.contiguous(), ids.contiguous(), queries.contiguous()  # no copy if they are
            if _interpreting():  # the interpreter copies arguments by storage: queries cut from the nodes would clash
                queries = queries.clone()
            out = torch.empty(ids.shape, dtype=torch.float32, device=ids.device)
            if ids.numel():
                grid = (ids.shape[0], -(-ids.shape[1] // BLOCK_ROWS))
                kernel[grid](
                    nodes,
                    queries,
                    ids,
                    out,
                    ids.shape[1],
                    nodes.shape[1],
                    BLOCK_ROWS=BLOCK_ROWS,
                    BLOCK_DIM=BLOCK_DIM,
                )
            return out
    if nodes.device.type == "cpu":  # the twin: faster than einsum on CPU (benchmarks/RESULTS.md, *Gather-dot kernel*)
        return torch.from_numpy(gather_dot_cpu(nodes.numpy(), queries.contiguous().numpy(), ids.contiguous().numpy()))
    rows = nodes[ids.clamp(min=0)]  # other devices, or no Triton
    return torch.where(ids >= 0, torch.einsum("bld,bd->bl", rows, queries), 0.0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _triton_kernel():
    """The Triton kernel, compiled on first use; None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather_dot_kernel(nodes, queries, ids, out, width, dim, BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        # every tensor contiguous: a node row starts every dim values, as a query row does
        b = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        in_row = cols < width
        u = tl.load(ids + b * width + cols, mask=in_row, other=-1)
        valid = in_row & (u >= 0)
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, dim, BLOCK_DIM):
            d = start + tl.arange(0, BLOCK_DIM)
            in_dim = d < dim
            q = tl.load(queries + b * dim + d, mask=in_dim, other=0.0)
            rows = tl.load(nodes + u[:, None] * dim + d[None, :], mask=valid[:, None] & in_dim[None, :], other=0.0)
            acc += tl.sum(rows * q[None, :], axis=1)
        tl.store(out + b * width + cols, acc, mask=in_row)

    return gather_dot_kernel
