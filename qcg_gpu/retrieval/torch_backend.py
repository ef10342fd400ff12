"""Retrieval as dense tensor operations: seeds selected threshold first (the similarity GEMM runs
over blocks of nodes and keeps only what passes the threshold, so a query tile needs no (B, N)
similarity matrix and can be large), topk over similarity tiles when too many nodes pass; gathers
over the fixed-degree kNN table for the expansion, sort-based segment means for the chunks. CUDA
when present, CPU tensors otherwise (the parity tests run it on both).

The GEMM is a prefilter in either precision, IEEE float32 or (GPUs with bf16 tensor cores) bf16:
candidates within its error bound (``bounds.py``) are rescored as float64 dot products, and rows whose
candidates do not fit are rescored over every node, so seeds and their similarities are the numpy
backend's (the same float64 numbers, summed in another order: equal unless two are within ~1e-15)."""

from __future__ import annotations

import numpy as np

from ..capabilities import ieee_float32_matmul, read_only_tensor, require
from ..config import RetrievalConfig
from ..errors import QCGError
from .bounds import bf16_error_bound, bf16_rounding, bound_from_norms, float32_roundoff, max_row_norm
from .index import QCGIndex
from .result import SIMILARITY_TILE_ELEMENTS, RetrievalResult, seed_threshold, tile_rows

TOPK_MARGIN = 8
PREFILTER_TOPK_MARGIN = 64  # approximations beyond the n best that the topk path rescores
# Threshold-first selection keeps (query, node) candidates, ~20 bytes each; past this many in a tile
# (a low threshold) the tile takes the topk path instead.
CANDIDATE_BUDGET = {"cuda": 1 << 24, "cpu": 1 << 22}


class TorchBackend:
    def __init__(self, index: QCGIndex, device: str, prefilter: bool = False):
        from ..kernels.gather_dot import gather_dot

        self.torch = torch = require("torch")
        self._gather_dot = gather_dot
        self.device = torch.device(device)
        # counts only: on a GPU the host's array is not needed after this (a shard owner frees it)
        self.n_nodes = n = len(index.node_embeddings)
        self.n_chunks = index.n_chunks
        self.nodes = read_only_tensor(index.node_embeddings).to(self.device)
        degree = np.diff(index.knn_indptr)
        if n and not (degree == degree[0]).all():
            raise QCGError("the torch backend needs a kNN graph with the same degree on every row")
        self.k = int(degree[0]) if n else 0
        self.neighbors = torch.from_numpy(np.asarray(index.knn_indices, dtype=np.int64)).to(self.device).view(n, self.k)
        # one extra row so that padding (-1 -> n) gathers harmlessly: no neighbours, chunk "n_chunks"
        self.neighbors = torch.cat([self.neighbors, torch.full((1, self.k), n, device=self.device, dtype=torch.int64)])
        self.node_chunk = torch.from_numpy(np.r_[index.node_chunk, index.n_chunks]).to(self.device)
        self.bf16 = bool(prefilter and n)
        self.nodes_low = self.nodes.bfloat16() if self.bf16 else self.nodes  # the GEMM's precision
        if self.bf16:
            self.node_norm, self.node_residual = bf16_rounding(index.node_embeddings, self.nodes_low)
        else:
            self.node_norm, self.node_residual = max_row_norm(index.node_embeddings), 0.0
        self.fallback_rows = 0  # queries whose candidates did not fit the top-k (rescored over every node)
        on_gpu = self.device.type == "cuda"  # big GPUs take 1 GiB similarity blocks and 4096-query tiles
        self.tile_rows, elements = (4096, 4 * SIMILARITY_TILE_ELEMENTS) if on_gpu else (256, SIMILARITY_TILE_ELEMENTS)
        self.node_block = max(1, elements // self.tile_rows)  # nodes per similarity block of a threshold-first tile
        self.topk_rows = tile_rows(n, self.tile_rows, elements)  # queries per (B, N) tile on the topk path
        self.candidate_budget = CANDIDATE_BUDGET.get(self.device.type, CANDIDATE_BUDGET["cpu"])
        self.topk_tiles = 0  # query tiles that took the topk path (too many nodes passed the threshold)

    def search(self, q: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        out = RetrievalResult.empty(len(q), config)
        n_nodes = self.n_nodes
        with self.torch.inference_mode(), ieee_float32_matmul():
            for part, tile, seed_ids, seed_sims in self._seed_tiles(q, config):
                out.seed_ids[part, : seed_ids.shape[1]] = seed_ids.cpu().numpy()
                out.seed_sims[part, : seed_ids.shape[1]] = seed_sims.float().cpu().numpy()
                selected = self._expand(seed_ids, config.hops)
                chunks, scores = self._rank_chunks(tile, selected, config.top_k)
                out.chunk_ids[part], out.scores[part] = chunks.cpu().numpy(), scores.cpu().numpy()
                out.n_selected[part] = (selected < n_nodes).sum(1).cpu().numpy()
        return out

    def seeds(self, q: np.ndarray, config: RetrievalConfig) -> tuple[np.ndarray, np.ndarray]:
        """The seeds alone (B, min(n, N)), best first, with the float64 similarities they rank by: a node
        shard's part of the seeds, which merge exactly with the other shards' (``shard_backend``)."""
        n = min(config.n, self.n_nodes)
        ids, sims = np.full((len(q), n), -1, np.int64), np.full((len(q), n), -np.inf, np.float64)
        with self.torch.inference_mode(), ieee_float32_matmul():
            for part, _, seed_ids, seed_sims in self._seed_tiles(q, config):
                ids[part, : seed_ids.shape[1]], sims[part, : seed_ids.shape[1]] = seed_ids.cpu(), seed_sims.cpu()
        return ids, sims

    def rank(self, q: np.ndarray, selected: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """Steps 4-5 (chunk means, top-K) over a Q* chosen elsewhere: ``selected`` (B, L) node ids, -1
        padded, as a node shard's owner gets its part of Q* (``shard_backend``). Chunk ids and scores."""
        torch, n_nodes = self.torch, self.n_nodes
        chunks, scores = np.full((len(q), top_k), -1, np.int64), np.full((len(q), top_k), -np.inf, np.float32)
        with torch.inference_mode():
            for start in range(0, len(q), self.tile_rows):
                part = slice(start, start + self.tile_rows)
                ids = torch.from_numpy(np.ascontiguousarray(selected[part], dtype=np.int64)).to(self.device)
                ids = unique_rows(torch, torch.where(ids >= 0, ids, n_nodes), n_nodes)  # ascending, as _expand's
                tile = read_only_tensor(q[part]).to(self.device)
                best, values = self._rank_chunks(tile, ids, top_k)
                chunks[part], scores[part] = best.cpu().numpy(), values.cpu().numpy()
        return chunks, scores

    def _seed_tiles(self, q: np.ndarray, config: RetrievalConfig):
        """(rows, query tile, seed ids, float64 seed sims) of each query tile, as tensors on the device."""
        n_nodes = self.n_nodes
        if n_nodes == 0:
            return
        threshold, n = float(seed_threshold(config.gamma)), min(config.n, n_nodes)
        threshold_first = True  # until a tile passes more candidates than the budget: then topk for the rest
        for start in range(0, len(q), self.tile_rows):
            tile = read_only_tensor(q[start : start + self.tile_rows]).to(self.device)  # read-only from Ray
            seeds = self._threshold_first(tile, threshold, n) if threshold_first else None
            if seeds is None:
                threshold_first = False
                seeds = self._topk_seeds(tile, threshold, n)
            yield slice(start, start + len(tile)), tile, *seeds

    def _topk_seeds(self, tile, threshold: float, n: int):
        """(B, n) seed ids and similarities by topk over (B, N) similarity sub-tiles."""
        self.topk_tiles += 1
        parts = []
        for start in range(0, len(tile), self.topk_rows):
            parts.append(self._topk_prefiltered(tile[start : start + self.topk_rows], threshold, n))
        return self.torch.cat([p[0] for p in parts]), self.torch.cat([p[1] for p in parts])

    def _low(self, tile):
        """The tile in the GEMM's precision and each row's bound on |GEMM - exact similarity|."""
        if self.bf16:
            tile_low = tile.bfloat16()
            return tile_low, bf16_error_bound(tile.double(), tile_low.double(), self.node_norm, self.node_residual)
        q_norm = tile.double().norm(dim=1)
        return tile, bound_from_norms(q_norm, q_norm, 0.0, self.node_norm, 0.0, float32_roundoff(tile.shape[1]))

    def _threshold_first(self, tile, threshold: float, n: int):
        """Every (query, node) pair whose approximate similarity reaches t - eps (eps bounds the GEMM's
        error, so no node at or above t is missed), gathered block by block of nodes; those within
        2 eps of their row's n-th best approximation are rescored in float64 like
        :meth:`_topk_prefiltered`'s candidates, then each query's n best (:func:`top_n_per_row`). None
        when more than ``candidate_budget`` pairs pass."""
        torch = self.torch
        tile_low, eps = self._low(tile)
        floor = (threshold - eps.float())[:, None]
        rows, ids, vals, total = [], [], [], 0
        for start in range(0, len(self.nodes), self.node_block):
            sims = (tile_low @ self.nodes_low[start : start + self.node_block].T).float()
            r, c = torch.nonzero(sims >= floor, as_tuple=True)
            vals.append(sims[r, c])
            total += len(r)
            if total > self.candidate_budget:
                return None
            rows.append(r)
            ids.append(c + start)
        rows, ids, sims = torch.cat(rows), torch.cat(ids), torch.cat(vals)
        # only what can still be among a row's n best is rescored: approximation >= a_n - 2 eps,
        # a_n the row's n-th best approximation (the bound of _topk_prefiltered)
        order, rank = rank_in_rows(torch, rows, sims, len(tile))
        nth = torch.full((len(tile),), -float("inf"), device=sims.device)
        at_n = order[rank == n - 1]
        nth[rows[at_n]] = sims[at_n]
        hopeful = sims >= (nth - 2 * eps.float())[rows]
        rows, ids = rows[hopeful], ids[hopeful]
        sims64 = pair_dot(torch, self.nodes, tile, ids, rows)
        exact = sims64 >= threshold
        return top_n_per_row(torch, rows[exact], ids[exact], sims64[exact], len(tile), n)

    def _seeds(self, sims, threshold: float, n: int):
        """Best n with sim >= threshold, ties by lower id; -1 padded."""
        torch = self.torch
        width = min(sims.shape[1], n + TOPK_MARGIN)
        vals, ids = sims.topk(width, dim=1)
        ids, vals = sort_best_first(ids, vals)  # topk does not promise an order among ties
        # a tie between the n-th and the last candidate may continue past the candidates: sort the row fully
        unsure = (vals[:, n - 1] >= threshold) & (vals[:, n - 1] == vals[:, -1]) & (width < sims.shape[1])
        for r in torch.nonzero(unsure).flatten().tolist():
            order = (-sims[r]).argsort(stable=True)[:width]
            ids[r], vals[r] = order, sims[r, order]
        ids, vals = ids[:, :n], vals[:, :n]
        keep = vals >= threshold
        return torch.where(keep, ids, -1), torch.where(keep, vals, torch.full_like(vals, -float("inf")))

    def _topk_prefiltered(self, tile, threshold: float, n: int):
        """Exact seeds from a (B, N) GEMM tile: the top n + margin approximations hold every node that
        can be a seed when the last of them is below max(t, a_n - eps) - eps (see qcg_gpu/kernels/prefilter_cpu.py);
        those are rescored in float64, like the numpy backend's, because the bound is on the exact
        similarity (a float32 rescoring may differ from it by d 2^-24 |q| |u|, outside the bound);
        other rows are rescored over every node (:meth:`_every_node_seeds`)."""
        torch = self.torch
        tile_low, eps = self._low(tile)
        approx = tile_low @ self.nodes_low.T
        width = min(approx.shape[1], n + PREFILTER_TOPK_MARGIN)
        vals, ids = approx.topk(width, dim=1)
        vals, eps = vals.float(), eps.float()
        floor = torch.maximum(threshold - eps, vals[:, n - 1] - 2 * eps)
        complete = (vals[:, -1] < floor) | (width == approx.shape[1])
        sims = exact_dot(torch, self.nodes, tile, ids)
        sims = torch.where((vals >= floor[:, None]) & (sims >= threshold), sims, -float("inf"))
        ids, sims = sort_best_first(ids, sims)  # float64: float32 rounding makes no ties
        ids, sims = ids[:, :n], sims[:, :n]
        ids = torch.where(torch.isfinite(sims), ids, -1)
        if not complete.all():
            rows = torch.nonzero(~complete).flatten()
            self.fallback_rows += len(rows)
            ids[rows], sims[rows] = self._every_node_seeds(tile[rows], threshold, n)
        return ids, sims

    def _every_node_seeds(self, tile, threshold: float, n: int):
        """Seeds of rows with too many near-ties, from every node's float64 similarity, a few rows at a
        time (float64 tiles within the similarity budget)."""
        torch, rows, parts = self.torch, max(1, self.topk_rows // 2), []
        for start in range(0, len(tile), rows):
            sub = tile[start : start + rows].double()
            blocks = range(0, len(self.nodes), self.node_block)
            sims = torch.cat([sub @ self.nodes[b : b + self.node_block].double().T for b in blocks], dim=1)
            parts.append(self._seeds(sims, threshold, n))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _expand(self, seed_ids, hops: int):
        """Q* per row as node ids (sorted, unique), padding = N."""
        torch, n_nodes = self.torch, self.n_nodes
        frontier = torch.where(seed_ids >= 0, seed_ids, n_nodes)
        reached = [frontier]
        for _ in range(hops):
            frontier = self.neighbors[frontier].flatten(1)  # padding rows point to padding
            frontier = unique_rows(torch, frontier, n_nodes)
            reached.append(frontier)
        return unique_rows(torch, torch.cat(reached, dim=1), n_nodes)

    def _rank_chunks(self, tile, selected, top_k: int):
        """Mean similarity per chunk over Q*, then the K best chunks (ties by lower chunk id)."""
        torch, n_chunks = self.torch, self.n_chunks
        # only the Q* entries (Triton on CUDA); gather_dot gives id -1 a 0, so the nodes need no padding row
        sims = self._gather_dot(self.nodes, tile, torch.where(selected < len(self.nodes), selected, -1))
        chunks = self.node_chunk[selected]
        chunks, order = chunks.sort(dim=1, stable=True)
        sims = sims.gather(1, order)
        starts = torch.ones_like(chunks, dtype=torch.bool)
        starts[:, 1:] = chunks[:, 1:] != chunks[:, :-1]
        segment = starts.cumsum(dim=1) - 1  # segment number of each entry within its row
        sums = torch.zeros(sims.shape, dtype=torch.float64, device=sims.device).scatter_add_(1, segment, sims.double())
        counts = torch.zeros_like(sums).scatter_add_(1, segment, torch.ones_like(sums))
        seg_chunk = torch.full_like(chunks, n_chunks).scatter_(1, segment, chunks)
        means = torch.where((counts > 0) & (seg_chunk < n_chunks), sums / counts.clamp(min=1), -float("inf")).float()
        order = means.argsort(dim=1, descending=True, stable=True)[:, :top_k]  # segments ascend by chunk id
        scores, best = means.gather(1, order), seg_chunk.gather(1, order)
        if best.shape[1] < top_k:
            pad = top_k - best.shape[1]
            best = torch.cat([best, torch.full((len(best), pad), n_chunks, device=best.device)], 1)
            scores = torch.cat([scores, torch.full((len(best), pad), -float("inf"), device=best.device)], 1)
        return torch.where(torch.isfinite(scores), best, -1), scores


def exact_dot(torch, nodes, queries, ids):
    """(B, L) float64 tensor ``nodes[ids[b, j]] . queries[b]`` (ids >= 0): :func:`pair_dot` over
    every (b, j), so both seed selections rescore with the same arithmetic."""
    rows = torch.arange(len(ids), device=ids.device).repeat_interleave(ids.shape[1])
    return pair_dot(torch, nodes, queries, ids.clamp(min=0).flatten(), rows).view(ids.shape)


def pair_dot(torch, nodes, queries, ids, rows, block: int = 1 << 18):
    """float64 ``nodes[ids[i]] . queries[rows[i]]`` for every pair i, in blocks of pairs so the
    gathered float64 rows stay small (2^18 x 384 x 8 bytes x 2 = 1.6 GB at most). The same number
    for a pair on every device and in every batch (:func:`halving_sum`), so node shards searched
    apart rank their seeds as one process does."""
    out = torch.empty(ids.shape, dtype=torch.float64, device=ids.device)
    for start in range(0, len(ids), block):
        part = slice(start, start + block)
        out[part] = halving_sum(torch, nodes[ids[part]].double() * queries[rows[part]].double())
    return out


def halving_sum(torch, products):
    """Each row's sum, added in a fixed order: the first half of the columns plus the second, until
    one is left. ``sum(1)``'s order depends on the device and on the number of rows (CUDA's reduction
    kernel picks its layout from the shape); this one depends on neither. The products of float32
    values are exact in float64, so the sums are the same bits on CPU and GPU."""
    while products.shape[1] > 1:
        if products.shape[1] % 2:
            products = torch.nn.functional.pad(products, (0, 1))  # + 0.0 changes no sum
        half = products.shape[1] // 2
        products = products[:, :half] + products[:, half:]
    return products[:, 0] if products.shape[1] else products.new_zeros(len(products))


def rank_in_rows(torch, rows, vals, b: int):
    """The order that sorts (row, value) entries by row, then value desc (stable: equal values keep
    their order), and each sorted entry's rank within its row."""
    order = vals.argsort(descending=True, stable=True)
    order = order[rows[order].argsort(stable=True)]
    counts = torch.bincount(rows, minlength=b)
    return order, torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[rows[order]]


def top_n_per_row(torch, rows, ids, vals, b: int, n: int):
    """(b, n) ids and values: for each row, the n best of its (row, id, value) entries by value
    desc, then id asc; -1 / -inf padded. Entries come grouped by node block and, within a block,
    row-major with ids ascending, so each row's entries are in ascending id order: two stable
    sorts (value, then row) keep that order among equal values."""
    order, rank = rank_in_rows(torch, rows, vals, b)
    rows, ids, vals = rows[order], ids[order], vals[order]
    keep = rank < n
    out_ids = torch.full((b, n), -1, dtype=torch.int64, device=rows.device)
    out_vals = torch.full((b, n), -float("inf"), dtype=vals.dtype, device=rows.device)
    out_ids[rows[keep], rank[keep]] = ids[keep]
    out_vals[rows[keep], rank[keep]] = vals[keep]
    return out_ids, out_vals


def sort_best_first(ids, vals):
    """Each row's (id, value) entries ordered by value desc, then id asc (tensors)."""
    by_id = ids.argsort(dim=1)
    ids, vals = ids.gather(1, by_id), vals.gather(1, by_id)
    order = vals.argsort(dim=1, descending=True, stable=True)
    return ids.gather(1, order), vals.gather(1, order)


def unique_rows(torch, ids, pad: int):
    """Sort each row and replace repeats by ``pad`` (which sorts last)."""
    ids, _ = ids.sort(dim=1)
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = torch.where(repeat, pad, ids)
    ids, _ = ids.sort(dim=1)
    width = int((ids < pad).sum(1).max().item()) if ids.numel() else 0
    return ids[:, : max(width, 1)]
