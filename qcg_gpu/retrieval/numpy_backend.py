"""CPU retrieval: a similarity GEMM per query tile, then the numba kernels of ``qcg_gpu/kernels/``.

Every precision is a prefilter (``qcg_gpu/kernels/prefilter_cpu.py``): the GEMM, in float32, bf16 (CPUs with
AMX) or int8 (other x86 CPUs), keeps each query's candidates within its proven error bound
(``bounds.py``) of the threshold and of the n-th best, and the candidates are rescored as float64 dot
products, then expanded and ranked in one fused pass. Rows with thousands of near-ties are rescored
over every node. So the seeds and their similarities are the same whatever the precision."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..capabilities import WITH_TORCH, ieee_float32_matmul, read_only_tensor, require
from ..config import RetrievalConfig
from ..errors import QCGError
from ..kernels.structs import Candidates, Graph, Ranking, RowBounds
from . import int8_gemm
from .bounds import (
    INT8_MAX,
    INT8_OUTPUT_ROUNDOFF,
    NODE_BLOCK,
    bf16_rounding,
    bf16_roundoff,
    bound_from_norms,
    float32_roundoff,
    int8_node_scale,
    int8_row_scales,
    max_row_norm,
    node_blocks,
)
from .index import QCGIndex
from .result import RetrievalResult, seed_threshold


class NumpyBackend:
    def __init__(self, index: QCGIndex, prefilter: str | None = None):
        """``prefilter``: the GEMM's precision, None (float32), "bf16" or "int8"."""
        import numba

        self.index, self._threads = index, numba.get_num_threads
        self.graph = compact_graph(index)
        self.prefilter = PREFILTERS[prefilter or "float32"](index, self.graph) if index.n_nodes else None
        self.fallback_rows = 0  # queries whose near-ties overflowed the candidates (rescored over every node)

    def search(self, q: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        out = RetrievalResult.empty(len(q), config)
        for part, ids, sims, ranked in self._tiles(q, config):
            out.seed_ids[part, : ids.shape[1]], out.seed_sims[part, : ids.shape[1]] = ids, sims  # float32 of float64
            out.chunk_ids[part], out.scores[part], out.n_selected[part] = ranked
        return out

    def seeds(self, q: np.ndarray, config: RetrievalConfig) -> tuple[np.ndarray, np.ndarray]:
        """The seeds alone (B, min(n, N)), best first, with the float64 similarities they rank by: a node
        shard's part of the seeds, which merge exactly with the other shards' (``shard_backend``)."""
        n = min(config.n, self.index.n_nodes)
        ids, sims = np.full((len(q), n), -1, np.int64), np.full((len(q), n), -np.inf, np.float64)
        for part, tile_ids, tile_sims, _ in self._tiles(q, dataclasses.replace(config, hops=0, top_k=1)):
            ids[part], sims[part] = tile_ids, tile_sims
        return ids, sims

    def rank(self, q: np.ndarray, selected: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """Steps 4-5 (chunk means, top-K) over a Q* chosen elsewhere: ``selected`` (B, L) node ids, -1
        padded, as a node shard's owner gets its part of Q* (``shard_backend``); each chunk's
        similarities are summed in ``selected``'s order. Chunk ids and scores."""
        chunks, scores, _ = rank_from_seeds(self.index, q, selected, 0, top_k, self.graph)  # Q* given whole
        return chunks, scores

    def _tiles(self, q: np.ndarray, config: RetrievalConfig):
        """(rows, seed ids, float64 seed sims, [chunk ids, scores, |Q*|]) of each query tile."""
        if self.prefilter is None:
            return
        threshold, n = seed_threshold(config.gamma), min(config.n, self.index.n_nodes)
        for start in range(0, len(q), self.prefilter.rows):
            tile = q[start : start + self.prefilter.rows]
            ids, vals, ranked, overflow = self.prefilter.search(tile, threshold, n, config)
            self._rescore_every_node(tile, np.flatnonzero(overflow), threshold, n, config, ids, vals, ranked)
            yield slice(start, start + len(tile)), ids, vals, ranked

    def _rescore_every_node(self, tile, rows: np.ndarray, threshold, n: int, config, ids, vals, ranked) -> None:
        """Rows whose near-ties overflowed the candidates: seeds and chunks from every node's float64
        similarity (the same arithmetic as the candidates'), in place; no (rows, N) matrix."""
        if len(rows) == 0:
            return
        from ..kernels import prefilter_cpu

        self.fallback_rows += len(rows)
        seed_ids, seed_sims, *exact = prefilter_cpu.rescore_all_and_rank(
            np.ascontiguousarray(tile[rows]),
            self.index.node_embeddings,
            threshold,
            n,
            self.graph,
            Ranking(hops=config.hops, top_k=config.top_k, n_threads=self._threads()),
        )
        ids[rows], vals[rows] = seed_ids, seed_sims
        for array, values in zip(ranked, exact):
            array[rows] = values


def compact_graph(index: QCGIndex) -> Graph:
    """The kernels' :class:`Graph` of ``index``: its kNN CSR and node chunks as int32 where every value
    fits (the CPU kernels look them up at random, and half the bytes stay in cache)."""
    arrays = (index.knn_indptr, index.knn_indices, index.node_chunk)
    fits = all(len(a) == 0 or int(a.max()) < 2**31 - 1 for a in arrays)
    indptr, indices, node_chunk = (np.ascontiguousarray(a, np.int32 if fits else np.int64) for a in arrays)
    return Graph(indptr=indptr, indices=indices, node_chunk=node_chunk, n_chunks=index.n_chunks)


def rank_from_seeds(
    index: QCGIndex, queries: np.ndarray, seed_ids: np.ndarray, hops: int, top_k: int, graph: Graph | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Retrieval steps 3-5 (expansion, per-chunk mean, top-K) of this backend from seeds chosen
    elsewhere (``seed_ids``, (B, n), -1 padded): the kernel ``search`` runs after its own seeds, for
    the bench's library routes and the trace. Returns chunk ids, scores and |Q*| per query."""
    from ..kernels import expand_cpu

    return expand_cpu.expand_and_rank(
        np.ascontiguousarray(seed_ids, dtype=np.int64),
        np.ascontiguousarray(queries, dtype=np.float32),
        index.node_embeddings,
        graph if graph is not None else compact_graph(index),
        Ranking(hops=hops, top_k=top_k, n_threads=_threads()),
    )


def reached_nodes(
    index: QCGIndex, seeds: np.ndarray, hops: int, graph: Graph | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Q* of one query from its seeds, in breadth-first order (the seeds, then each hop's new nodes),
    and its size after 0, 1, ..., h hops."""
    from ..kernels import expand_cpu

    graph = graph if graph is not None else compact_graph(index)
    return expand_cpu.reached_nodes(np.asarray(seeds, dtype=np.int64), graph, index.n_nodes, hops)


def _threads() -> int:
    import numba

    return numba.get_num_threads()


class Prefilter:
    """Exact seeds from a low-precision GEMM on CPU (qcg_gpu/kernels/prefilter_cpu.py): candidates within the
    error bound (``bounds.py``) of the n best are rescored exactly; rows with too many near-ties are
    flagged. A subclass gives the precision: the nodes' copy, a query tile's copy with its bound, the GEMM."""

    # queries x nodes per GEMM (its rate per precision: benchmarks/bench_gemm.py, RESULTS.md)
    rows, cols = 512, NODE_BLOCK
    spare = 256  # candidates kept per query beyond 4n before a row counts as near-ties (rescored over every node)
    nodes_low: Any  # the nodes in the GEMM's precision (a torch tensor)
    output_dtype: Any  # the GEMM's output dtype, and the dtype its bits are read as keys in
    key_dtype: Any

    def __init__(self, index: QCGIndex, graph: Graph | None = None):
        import numba

        from ..kernels import prefilter_cpu

        self.torch: Any = None  # the bf16 and int8 GEMMs run in torch
        self.kernels, self.index, self.nodes = prefilter_cpu, index, index.node_embeddings
        self.graph = graph if graph is not None else compact_graph(index)
        self._threads = numba.get_num_threads
        self._gemm_out: Any = None  # the GEMM's output tile (a torch tensor), reused: a fresh one costs page faults

    def round_tile(self, tile: np.ndarray):
        """(the tile in the GEMM's precision, the error bound per row, the value of one integer key per row)."""
        raise NotImplementedError

    def gemm(self, tile_low, block, out):
        """The approximate similarities of the tile and a block of nodes (``out`` or a new tensor)."""
        raise NotImplementedError

    def output(self, rows: int):
        if self._gemm_out is None or len(self._gemm_out) < rows:
            self._gemm_out = self.torch.empty((rows, self.cols), dtype=self.output_dtype)
        return self._gemm_out[:rows]

    def keys(self, tile_low, col0: int, out) -> np.ndarray:
        """The GEMM of the tile and nodes col0.. into ``out`` (a new tile for a shorter last block), as
        the scan's integer keys."""
        block = self.nodes_low[col0 : col0 + self.cols]
        approx = self.gemm(tile_low, block.T, out if len(block) == out.shape[1] else None)
        return approx.view(self.key_dtype).numpy()

    def search(self, tile: np.ndarray, threshold: np.float32, n: int, config: RetrievalConfig):
        """Seeds, [chunk ids, scores, |Q*|] and the overflow mask per query. Overflowed rows (thousands
        of near-ties) are left empty for the caller to rescore over every node."""
        k = self.kernels
        tile_low, eps, unit = self.round_tile(tile)
        rows, capacity = len(tile), 4 * n + self.spare
        cand_ids, cand_vals = np.empty((rows, capacity), np.int64), np.empty((rows, capacity), np.float32)
        counts, overflow = np.zeros(rows, np.int64), np.zeros(rows, np.bool_)
        best = np.full((rows, n), -np.inf, np.float32)
        candidates = Candidates(ids=cand_ids, vals=cand_vals, counts=counts, best=best, overflow=overflow)
        bounds = RowBounds(t_minus_eps=(threshold - eps).astype(np.float32), eps=eps, unit=unit)
        out = self.output(rows)
        for col0 in range(0, len(self.nodes), self.cols):
            k.scan_block(self.keys(tile_low, col0, out), col0, bounds, n, candidates, k.VALUES)
        ranking = Ranking(hops=config.hops, top_k=config.top_k, n_threads=self._threads())
        ids, vals, *ranked = k.rescore_and_rank(tile, self.nodes, threshold, eps, n, candidates, self.graph, ranking)
        return ids, vals, ranked, overflow


class Bf16Prefilter(Prefilter):
    """bf16 GEMM (AMX tiles through oneDNN), its output read as int16 bit patterns."""

    def __init__(self, index: QCGIndex, graph: Graph | None = None):
        super().__init__(index, graph)
        self.torch = torch = require("torch")
        nodes = index.node_embeddings
        self.output_dtype, self.key_dtype = torch.bfloat16, torch.int16  # bf16 bit patterns as keys
        self.nodes_low = torch.empty(nodes.shape, dtype=torch.bfloat16)
        for start, block in node_blocks(nodes, np.float32):
            self.nodes_low[start : start + len(block)] = read_only_tensor(block)  # a memory map's rows, read
        self.node_norm, self.node_residual = bf16_rounding(nodes, self.nodes_low)

    def error_bound(self, tile: np.ndarray, tile_bf16) -> np.ndarray:
        q_norm, rounded_norm, residual_norm = self.kernels.rounding_norms(tile, tile_bf16.float().numpy())
        roundoff = bf16_roundoff(tile.shape[1])
        bound = bound_from_norms(q_norm, rounded_norm, residual_norm, self.node_norm, self.node_residual, roundoff)
        return bound.astype(np.float32)

    def round_tile(self, tile: np.ndarray):
        tile_bf16 = read_only_tensor(tile).bfloat16()  # queries from Ray are read-only
        return tile_bf16, self.error_bound(tile, tile_bf16), np.ones(len(tile), np.float32)  # bf16 keys need no unit

    def gemm(self, tile_bf16, block, out):
        return self.torch.mm(tile_bf16, block, out=out)


class Int8Prefilter(Prefilter):
    """int8 GEMM, exact integer sums, by the route this CPU runs fastest (``int8_gemm.for_this_cpu``):
    node codes of 7 bits where that route saturates (``int8_gemm.node_code_max``). Its speed against
    float32 with VNNI and with AVX2 alone: benchmarks/RESULTS.md, *Retrieval throughput*."""

    def __init__(self, index: QCGIndex, graph: Graph | None = None, gemm: Any = None):
        """``gemm``: an :mod:`int8_gemm` route (default: this CPU's)."""
        super().__init__(index, graph)
        self.torch = torch = require("torch")
        self.gemm_route = gemm or int8_gemm.for_this_cpu()
        nodes = index.node_embeddings
        self.output_dtype = self.key_dtype = self.gemm_route.output_dtype  # exact integer dot products as keys
        self.spare = 1024  # its bound is ~2.5x bf16's (~4x with 7-bit node codes), so more candidates are within it
        self.code_max = int8_gemm.node_code_max(self.gemm_route, nodes.shape[1])
        if not self.code_max:
            raise QCGError(f"this CPU's int8 GEMM ({self.gemm_route.name}) does not sum exactly; use --prefilter off")
        self.node_scale = int8_node_scale(nodes, self.code_max)
        self.packed, norms, residuals = [], [0.0], [0.0]  # a block packed as it is rounded: no whole int8 copy
        for _, block in node_blocks(nodes, np.float32):  # blocks of NODE_BLOCK = self.cols nodes, one GEMM each
            scale = np.full(len(block), self.node_scale)
            rounded, norm, _, residual = self.kernels.quantize_int8(block, scale, float(self.code_max))
            self.packed.append(self.gemm_route.pack(torch.from_numpy(rounded)))
            norms.append(norm.max())
            residuals.append(residual.max())
        self.node_norm, self.node_residual = max(norms), max(residuals)  # the node side of the bound

    def round_tile(self, tile: np.ndarray):
        scale = int8_row_scales(tile)
        tile_int8, q_norm, rounded_norm, residual_norm = self.kernels.quantize_int8(tile, scale, INT8_MAX)
        eps = bound_from_norms(
            q_norm, rounded_norm, residual_norm, self.node_norm, self.node_residual, INT8_OUTPUT_ROUNDOFF
        )
        unit = (1.0 / (scale * self.node_scale)).astype(np.float32)
        return self.gemm_route.tile(self.torch.from_numpy(tile_int8)), eps.astype(np.float32), unit

    def keys(self, tile_low, col0: int, out) -> np.ndarray:
        block = self.packed[col0 // self.cols]
        full = col0 + self.cols <= len(self.nodes)
        return self.gemm_route(tile_low, block, out if full else None).numpy()


class Float32Prefilter(Prefilter):
    """The float32 GEMM (torch's where installed, else numpy's), its values read as keys. Its bound is
    float32 rounding alone (~d 2^-24), so few candidates pass: it ranks seeds by the same float64
    similarities as the bf16 and int8 prefilters, at the float32 GEMM's speed."""

    spare = 64  # within d 2^-24 of the n-th best: near-duplicates only

    def __init__(self, index: QCGIndex, graph: Graph | None = None):
        super().__init__(index, graph)
        nodes = index.node_embeddings
        self.node_norm = max_row_norm(nodes)
        self.roundoff = float32_roundoff(nodes.shape[1])
        self._out: np.ndarray | None = None  # the GEMM's output tile, reused: a fresh one costs page faults
        self._gemm = float32_gemm(nodes)

    def round_tile(self, tile: np.ndarray):
        q_norm = np.linalg.norm(tile.astype(np.float64), axis=1)
        eps = bound_from_norms(q_norm, q_norm, 0.0, self.node_norm, 0.0, self.roundoff)
        return tile, eps.astype(np.float32), np.ones(len(tile), np.float32)

    def output(self, rows: int):
        if self._out is None or len(self._out) < rows:
            self._out = np.empty((rows, self.cols), np.float32)
        return self._out[:rows]

    def keys(self, tile, col0: int, out) -> np.ndarray:
        width = min(self.cols, len(self.nodes) - col0)
        return self._gemm(tile, col0, width, out if width == out.shape[1] else np.empty((len(tile), width), np.float32))


def float32_gemm(nodes: np.ndarray):
    """``gemm(tile, col0, width, out)``: tile @ nodes[col0 : col0 + width].T into ``out``, in IEEE float32,
    through torch where it is installed. After numpy's OpenBLAS GEMM, its threads spin for a while and
    slow the numba kernel that follows on a machine of few cores; after torch's GEMM (as fast here)
    they do not."""
    if not WITH_TORCH:
        return lambda tile, col0, width, out: np.matmul(tile, nodes[col0 : col0 + width].T, out=out)
    torch = require("torch")
    nodes_t = read_only_tensor(nodes)

    def gemm(tile: np.ndarray, col0: int, width: int, out: np.ndarray) -> np.ndarray:
        with ieee_float32_matmul():
            torch.mm(read_only_tensor(tile), nodes_t[col0 : col0 + width].T, out=torch.from_numpy(out))
        return out

    return gemm


# --prefilter's precisions (search.prefilter_kind; float32 for "off")
PREFILTERS = {"float32": Float32Prefilter, "bf16": Bf16Prefilter, "int8": Int8Prefilter}
