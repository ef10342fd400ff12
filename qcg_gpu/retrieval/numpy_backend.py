"""CPU retrieval: a BLAS GEMM per query tile, then the numba kernels of ``kernels/`` (fused
threshold/top-n seed selection; fused expansion + gather-dot + chunk mean + top-K). On CPUs with
fast bf16 (AMX) the GEMM runs in bf16 as a prefilter (``bf16.py``) and the candidates it keeps
are rescored exactly; rows with too many near-ties take the float32 path, so the seeds are
always the float32 path's."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..capabilities import WITH_TORCH, require
from ..config import RetrievalConfig
from .bf16 import bf16_rounding, bound_from_norms
from .index import QCGIndex
from .result import RetrievalResult, seed_threshold, tile_rows

BF16_TILE = (512, 8192)  # queries x nodes per bf16 GEMM on CPU: 8 MiB of output, measured fastest with AMX


class NumpyBackend:
    def __init__(self, index: QCGIndex, prefilter: bool = False):
        import numba

        from ..kernels import expand_cpu, seeds_cpu

        self.index, self._seeds, self._expand = index, seeds_cpu.top_n_above, expand_cpu.expand_and_rank
        self._threads = numba.get_num_threads
        self._buffer: np.ndarray | None = None  # float32 similarity tile, reused: no page faults per tile
        self._gemm = float32_gemm(index.node_embeddings)
        self.graph = compact_graph(index)
        self.prefilter = Bf16Prefilter(index, self.graph) if prefilter and index.n_nodes else None
        self.fallback_rows = 0  # queries whose near-ties overflowed the bf16 candidates (float32 path instead)

    def search(self, q: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        index, out = self.index, RetrievalResult.empty(len(q), config)
        if index.n_nodes == 0:
            return out
        threshold, n = seed_threshold(config.gamma), min(config.n, index.n_nodes)
        rows = self.prefilter.rows if self.prefilter else tile_rows(index.n_nodes)
        for start in range(0, len(q), rows):
            tile = q[start : start + rows]
            part = slice(start, start + len(tile))
            if self.prefilter:
                ids, vals, ranked, overflow = self.prefilter.search(tile, threshold, n, config)
                self._redo_in_float32(tile, np.flatnonzero(overflow), threshold, n, config, ids, vals, ranked)
            else:
                ids, vals = self.exact_seeds(tile, threshold, n)
                ranked = self.rank(tile, ids, config)
            out.seed_ids[part, : ids.shape[1]], out.seed_sims[part, : ids.shape[1]] = ids, vals
            out.chunk_ids[part], out.scores[part], out.n_selected[part] = ranked
        return out

    def _redo_in_float32(self, tile, rows: np.ndarray, threshold, n: int, config, ids, vals, ranked) -> None:
        """Rows whose near-ties overflowed the bf16 candidates: seeds and chunks from the float32 path, in place."""
        if len(rows) == 0:
            return
        self.fallback_rows += len(rows)
        ids[rows], vals[rows] = self.exact_seeds(tile[rows], threshold, n)
        for array, values in zip(ranked, self.rank(tile[rows], ids[rows], config)):
            array[rows] = values

    def rank(self, tile: np.ndarray, seed_ids: np.ndarray, config: RetrievalConfig):
        """Expansion, node scores, chunk means and top-K of each query from its seeds (numba)."""
        indptr, indices, node_chunk = self.graph
        return self._expand(
            seed_ids,
            indptr,
            indices,
            self.index.node_embeddings,
            tile,
            node_chunk,
            self.index.n_chunks,
            config.hops,
            config.top_k,
            self._threads(),
        )

    def exact_seeds(self, tile: np.ndarray, threshold: np.float32, n: int):
        """float32 GEMM of the tile against every node, then the fused threshold/top-n pass."""
        if self._buffer is None or self._buffer.shape[0] < len(tile):
            self._buffer = np.empty((len(tile), self.index.n_nodes), np.float32)
        sims = self._gemm(tile, self._buffer[: len(tile)])
        return self._seeds(sims, threshold, n)


def float32_gemm(nodes: np.ndarray):
    """``gemm(tile, out)``: tile @ nodes.T into ``out``, through torch where it is installed. After
    numpy's OpenBLAS GEMM, its threads spin for ~0.1 s and made the numba kernel that followed 2x
    slower on 2 cores (measured); after torch's GEMM (as fast here) they do not."""
    if not WITH_TORCH:
        return lambda tile, out: np.matmul(tile, nodes.T, out=out)
    torch = require("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only memory map is fine: it is only read
        nodes_t = torch.from_numpy(np.asarray(nodes))

    def gemm(tile: np.ndarray, out: np.ndarray) -> np.ndarray:
        torch.mm(torch.from_numpy(tile), nodes_t.T, out=torch.from_numpy(out))
        return out

    return gemm


def compact_graph(index: QCGIndex) -> tuple:
    """(knn_indptr, knn_indices, node_chunk) as int32 where every value fits: the CPU kernels look them
    up at random, and half the bytes stay in cache (measured: expansion 10-15% faster at N = 100k)."""
    arrays = (index.knn_indptr, index.knn_indices, index.node_chunk)
    fits = all(len(a) == 0 or int(a.max()) < 2**31 - 1 for a in arrays)
    return tuple(np.ascontiguousarray(a, np.int32 if fits else np.int64) for a in arrays)


class Bf16Prefilter:
    """Exact seeds from a bf16 GEMM on CPU (kernels/prefilter_cpu.py): candidates within the
    rounding bound of the n best are rescored exactly; rows with too many near-ties are flagged."""

    rows = BF16_TILE[0]

    def __init__(self, index: QCGIndex, graph: tuple | None = None):
        import numba

        from ..kernels import prefilter_cpu

        self.torch = torch = require("torch")
        self.kernels, self.index, self.nodes = prefilter_cpu, index, index.node_embeddings
        self.graph = graph if graph is not None else compact_graph(index)
        self._threads = numba.get_num_threads
        nodes = index.node_embeddings
        self.nodes_bf16 = torch.empty(nodes.shape, dtype=torch.bfloat16)
        for start in range(0, len(nodes), 65536):  # in blocks: nodes may be a read-only memory map
            self.nodes_bf16[start : start + 65536] = torch.from_numpy(
                np.array(nodes[start : start + 65536], np.float32)
            )
        self.node_norm, self.node_residual = bf16_rounding(nodes, self.nodes_bf16)
        self._gemm_out: Any = None  # the bf16 GEMM's output tile (a torch tensor), reused

    def error_bound(self, tile: np.ndarray, tile_bf16) -> np.ndarray:
        norms = self.kernels.rounding_norms(tile, tile_bf16.float().numpy())
        q_norm, rounded_norm, residual_norm = norms
        return bound_from_norms(
            q_norm, rounded_norm, residual_norm, tile.shape[1], self.node_norm, self.node_residual
        ).astype(np.float32)

    def search(self, tile: np.ndarray, threshold: np.float32, n: int, config: RetrievalConfig):
        """Seeds, [chunk ids, scores, |Q*|] and the overflow mask per query. Overflowed rows (thousands
        of near-ties) are left empty for the caller's float32 path."""
        torch, k, index = self.torch, self.kernels, self.index
        tile_bf16 = torch.from_numpy(tile).bfloat16()
        eps = self.error_bound(tile, tile_bf16)
        rows, capacity = len(tile), 4 * n + 256
        cand_ids, cand_vals = np.empty((rows, capacity), np.int64), np.empty((rows, capacity), np.float32)
        counts, overflow = np.zeros(rows, np.int64), np.zeros(rows, np.bool_)
        best = np.full((rows, n), -np.inf, np.float32)
        t_minus_eps = (threshold - eps).astype(np.float32)
        if self._gemm_out is None or len(self._gemm_out) < rows:
            self._gemm_out = torch.empty((rows, BF16_TILE[1]), dtype=torch.bfloat16)
        out = self._gemm_out[:rows]  # reused: a fresh 8 MiB tile costs page faults on every write
        for col0 in range(0, len(self.nodes), BF16_TILE[1]):
            block = self.nodes_bf16[col0 : col0 + BF16_TILE[1]]
            approx = torch.mm(tile_bf16, block.T, out=out if len(block) == out.shape[1] else None)
            k.scan_block(
                approx.view(torch.int16).numpy(),
                col0,
                t_minus_eps,
                eps,
                n,
                cand_ids,
                cand_vals,
                counts,
                best,
                overflow,
                k.VALUES,
            )
        ids, vals, *ranked = k.rescore_and_rank(
            tile,
            self.nodes,
            threshold,
            eps,
            n,
            cand_ids,
            cand_vals,
            counts,
            best,
            overflow,
            *self.graph,
            index.n_chunks,
            config.hops,
            config.top_k,
            self._threads(),
        )
        return ids, vals, ranked, overflow
