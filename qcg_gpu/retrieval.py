"""Batched QCG retrieval (METHOD.md, "Retrieval"): B queries at once, as dense GEMM tiles
plus sparse steps, on one of two backends with identical results:

* ``numpy``: BLAS GEMM per query tile, then the numba kernels in ``qcg_gpu.kernels``
  (fused threshold/top-n seed selection; fused expansion + gather-dot + chunk mean + top-K);
  on CPUs with fast bf16 (AMX) the GEMM runs in bf16 as a prefilter and the candidates it
  keeps are rescored exactly, so the seeds are the float32 path's (``prefilter``);
* ``torch``: the same steps as dense tensor operations (topk, gathers over the fixed-degree
  kNN table, sort-based segment means); CUDA when present, CPU tensors otherwise.

The B x N similarity matrix is never materialised beyond one tile of queries.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .capabilities import WITH_TORCH, cpu_has_fast_bf16, default_device, require, with_cuda
from .config import option
from .errors import QCGError
from .index_format import csr_problems, data_dir, load_array, load_table, read_manifest

PRESETS = {  # the paper's per-dataset settings (k, the kNN degree, is fixed when the index is built)
    "lihuaworld": {"gamma": 1.5, "n": 10, "hops": 1, "top_k": 5},
    "multihop-rag": {"gamma": 1.0, "n": 15, "hops": 1, "top_k": 5},
}
SIMILARITY_TILE_ELEMENTS = 1 << 26  # 256 MiB of float32 similarities per query tile
TOPK_MARGIN = 8
PREFILTER_TOPK_MARGIN = 64  # bf16 approximations beyond the n best that the torch prefilter rescores


@dataclass
class RetrievalConfig:
    gamma: float = option(1.5, "Seed threshold on sim + 1 (in [0, 2]; paper: 1.5 LiHuaWorld, 1.0 MultiHop-RAG).")
    n: int = option(10, "Most seed nodes per query (paper: 10 LiHuaWorld, 15 MultiHop-RAG).")
    hops: int = option(1, "Expansion hops along kNN edges (0-3; paper: 1).")
    top_k: int = option(5, "Chunks returned per query (K).")
    backend: str = option(
        "auto", "Retrieval backend: torch (CUDA when present), numpy (numba kernels), or auto.", ("auto", "torch", "numpy"),
        flag="--retrieval-backend",
    )
    device: Optional[str] = option(None, "Torch device for the torch backend (default: cuda when present, else cpu).", flag="--retrieval-device")
    prefilter: str = option(
        "auto", "bf16 similarity GEMM as a prefilter with exact rescoring of the candidates (same seeds; several "
        "times faster on GPUs and on CPUs with AMX); auto = where the hardware has fast bf16.",
        ("auto", "bf16", "off"),
    )

    def validate(self) -> "RetrievalConfig":
        if not 0.0 <= self.gamma <= 2.0:
            raise QCGError(f"gamma must be in [0, 2], got {self.gamma}")
        if self.n < 1 or self.top_k < 1:
            raise QCGError(f"n and top_k must be >= 1, got n={self.n}, top_k={self.top_k}")
        if not 0 <= self.hops <= 3:
            raise QCGError(f"hops must be in 0..3, got {self.hops}")
        return self

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "torch" if with_cuda() else "numpy"

    def resolved_prefilter(self, device: str = "cpu") -> bool:
        """auto: bf16 where it is fast, i.e. CUDA GPUs with bf16 tensor cores (Ampere on) and CPUs with AMX/AVX512-BF16."""
        if self.prefilter != "auto":
            return self.prefilter == "bf16"
        if self.resolved_backend() == "torch" and device.startswith("cuda"):
            return require("torch").cuda.get_device_capability(device)[0] >= 8
        return self.resolved_backend() == "numpy" and WITH_TORCH and cpu_has_fast_bf16()


def seed_threshold(gamma: float) -> np.float32:
    """sim + 1 >= gamma as a float32 bound on sim: the smallest float32 >= gamma - 1, so every backend agrees."""
    t = np.float32(gamma - 1.0)
    return t if float(t) >= gamma - 1.0 else np.nextafter(t, np.float32(np.inf))


@dataclass
class QCGIndex:
    """The arrays retrieval needs, loaded from an index directory (embeddings memory-mapped)."""

    path: Path
    manifest: dict
    node_embeddings: np.ndarray  # (N, d) float32, unit rows
    knn_indptr: np.ndarray
    knn_indices: np.ndarray
    node_chunk: np.ndarray  # (N,) int64
    n_chunks: int

    verified: bool = False  # files were checked against the manifest's checksums (lazy reads are too)
    data: Optional[Path] = None  # the version directory loaded: later reads stay on it while a rebuild publishes another

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> "QCGIndex":
        """Load an index; ``verify`` checks each file read against its sha256 in the manifest
        (a few seconds per GB) so a corrupt index is refused instead of answering wrongly."""
        path = Path(path)
        manifest = read_manifest(path)
        data = data_dir(path, manifest)
        checked = manifest if verify else None
        emb = load_array(data, "node_embeddings", manifest=checked)
        if emb.dtype != np.float32:
            emb = emb.astype(np.float32)
        node_chunk = load_table(data, "nodes", checked).column("chunk_id").to_numpy().astype(np.int64)
        indptr = load_array(data, "knn_indptr", mmap=False, manifest=checked)
        indices = load_array(data, "knn_indices", mmap=False, manifest=checked)
        n, n_chunks = len(emb), int(manifest["counts"]["chunks"])
        # cheap structural checks always: the numba kernels index with these arrays unchecked
        problems = [] if emb.ndim == 2 else [f"node_embeddings has shape {emb.shape}"]
        problems += [f"{len(node_chunk)} nodes for {n} node embeddings"] if len(node_chunk) != n else []
        problems += csr_problems(indptr, indices, n) if not problems else []
        if len(node_chunk) and not problems and (node_chunk.min() < 0 or node_chunk.max() >= n_chunks):
            problems.append(f"nodes.parquet names chunks outside [0, {n_chunks})")
        if problems:
            raise QCGError(f"index {path} is inconsistent: {'; '.join(problems)}; run: qcg check {path}")
        return cls(path, manifest, emb, indptr, indices, node_chunk, n_chunks, verified=verify, data=data)

    @property
    def dim(self) -> int:
        return self.node_embeddings.shape[1]

    @functools.cached_property
    def chunks(self):
        """chunks.parquet as a pyarrow Table, read on first use."""
        return self.table("chunks")

    def table(self, name: str):
        """Another table of the index (pairs, chunks), checksum-verified like the index was."""
        return load_table(self.data or self.path, name, self.manifest if self.verified else None)

    def array(self, name: str) -> np.ndarray:
        """Another array of the index (chunk or pair embeddings), checksum-verified like the index was."""
        return load_array(self.data or self.path, name, manifest=self.manifest if self.verified else None)

    def chunk_texts(self) -> list[str]:
        return self.chunks.column("text").to_pylist()


@dataclass
class RetrievalResult:
    chunk_ids: np.ndarray  # (B, K) int64, -1 where a query has fewer than K chunks
    scores: np.ndarray  # (B, K) float32 mean similarity, -inf where chunk_ids is -1
    seed_ids: np.ndarray  # (B, n) int64, -1 padded, best first
    seed_sims: np.ndarray  # (B, n) float32
    n_selected: np.ndarray  # (B,) size of Q* per query


def check_queries(queries: np.ndarray, dim: int) -> np.ndarray:
    """Queries as a contiguous float32 (B, dim) array of unit rows; refuses what cannot be fixed."""
    q = np.asarray(queries, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != dim:
        raise QCGError(f"query embeddings must have shape (B, {dim}) to match the index, got {tuple(np.shape(queries))}")
    norms = np.sqrt(np.einsum("ij,ij->i", q, q))[:, None]  # one pass; NaN or inf in a row makes its norm non-finite
    if not np.isfinite(norms).all():
        if not np.isfinite(q).all():
            raise QCGError("query embeddings contain NaN or infinite values")
        norms = np.linalg.norm(q.astype(np.float64), axis=1, keepdims=True).astype(np.float32)  # huge but finite
    if (norms == 0).any():
        raise QCGError("a query embedding is all zeros")
    return np.ascontiguousarray(q / norms if not np.allclose(norms, 1.0, atol=1e-3) else q)


class Retriever:
    """Batched QCG retrieval over one index. It reuses its work buffers between calls, so use one
    ``Retriever`` per thread (the Ray workers each hold their own)."""

    def __init__(self, index: QCGIndex | str | Path, config: RetrievalConfig | None = None):
        self.index = index if isinstance(index, QCGIndex) else QCGIndex.load(index)
        self.config = (config or RetrievalConfig()).validate()
        self.backend = self.config.resolved_backend()
        if self.backend == "torch":
            device = self.config.device or default_device()
            self._impl = _TorchBackend(self.index, device, self.config.resolved_prefilter(device))
        elif self.backend == "numpy":
            self._impl = _NumpyBackend(self.index, self.config.resolved_prefilter())
        else:
            raise QCGError(f"unknown retrieval backend {self.backend!r}")

    def search(self, queries: np.ndarray, config: RetrievalConfig | None = None) -> RetrievalResult:
        config = (config or self.config).validate()
        q = check_queries(queries, self.index.dim)
        return self._impl.search(q, config)


def _tile_rows(n_nodes: int, max_rows: int = 256, budget: int = SIMILARITY_TILE_ELEMENTS) -> int:
    """Queries per similarity tile: at most max_rows (256 measured best for CPU BLAS at N = 100k)
    and at most ``budget`` similarities."""
    return int(max(1, min(max_rows, budget // max(n_nodes, 1))))


def _empty_result(b: int, config: RetrievalConfig) -> RetrievalResult:
    return RetrievalResult(
        np.full((b, config.top_k), -1, np.int64), np.full((b, config.top_k), -np.inf, np.float32),
        np.full((b, config.n), -1, np.int64), np.full((b, config.n), -np.inf, np.float32), np.zeros(b, np.int64),
    )


class _NumpyBackend:
    def __init__(self, index: QCGIndex, prefilter: bool = False):
        import numba

        from .kernels import expand_cpu, seeds_cpu

        self.index, self._seeds, self._expand = index, seeds_cpu.top_n_above, expand_cpu.expand_and_rank
        self._threads = numba.get_num_threads
        self._buffer = None  # float32 similarity tile, reused: no page faults per tile
        self._gemm = float32_gemm(index.node_embeddings)
        self.graph = compact_graph(index)
        self.prefilter = _Bf16Prefilter(index, self.graph) if prefilter and len(index.node_embeddings) else None
        self.fallback_rows = 0  # queries whose near-ties overflowed the bf16 candidates (float32 path instead)

    def search(self, q: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        index, out = self.index, _empty_result(len(q), config)
        if len(index.node_embeddings) == 0:
            return out
        threshold, n = seed_threshold(config.gamma), min(config.n, len(index.node_embeddings))
        rows = self.prefilter.rows if self.prefilter else _tile_rows(len(index.node_embeddings))
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
        return self._expand(seed_ids, indptr, indices, self.index.node_embeddings, tile, node_chunk,
                            self.index.n_chunks, config.hops, config.top_k, self._threads())

    def exact_seeds(self, tile: np.ndarray, threshold: np.float32, n: int):
        """float32 GEMM of the tile against every node, then the fused threshold/top-n pass."""
        if self._buffer is None or self._buffer.shape[0] < len(tile):
            self._buffer = np.empty((len(tile), len(self.index.node_embeddings)), np.float32)
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


BF16_UNIT_ROUNDOFF = 2.0**-8
BF16_TILE = (512, 8192)  # queries x nodes per bf16 GEMM on CPU: 8 MiB of output, measured fastest with AMX


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

    return bound_from_norms(norms(queries), norms(rounded), norms(queries - rounded), queries.shape[1], node_norm, node_residual)


def bound_from_norms(q_norm, rounded_norm, residual_norm, dim: int, node_norm: float, node_residual: float):
    """The bound from the query norms |q|, |q~| and |q - q~| (arrays or tensors):
    |q.u - q~.u~| <= |q| |u - u~| + |q - q~| |u~|, plus the float32 accumulation of d products
    and the rounding of the output to bf16 (relative 2^-8), with 1e-6 to spare."""
    gemm = rounded_norm * (node_norm + node_residual)  # >= |q~.u~|
    bound = q_norm * node_residual + residual_norm * (node_norm + node_residual)
    return bound + gemm * (dim * 2.0**-24 + BF16_UNIT_ROUNDOFF * (1 + dim * 2.0**-24)) + 1e-6


class _Bf16Prefilter:
    """Exact seeds from a bf16 GEMM on CPU (kernels/prefilter_cpu.py): candidates within the
    rounding bound of the n best are rescored exactly; rows with too many near-ties are flagged."""

    rows = BF16_TILE[0]

    def __init__(self, index: QCGIndex, graph: tuple | None = None):
        import numba

        from .kernels import prefilter_cpu

        self.torch = torch = require("torch")
        self.kernels, self.index, self.nodes = prefilter_cpu, index, index.node_embeddings
        self.graph = graph if graph is not None else compact_graph(index)
        self._threads = numba.get_num_threads
        nodes = index.node_embeddings
        self.nodes_bf16 = torch.empty(nodes.shape, dtype=torch.bfloat16)
        for start in range(0, len(nodes), 65536):  # in blocks: nodes may be a read-only memory map
            self.nodes_bf16[start : start + 65536] = torch.from_numpy(np.array(nodes[start : start + 65536], np.float32))
        self.node_norm, self.node_residual = bf16_rounding(nodes, self.nodes_bf16)
        self._gemm_out = None

    def error_bound(self, tile: np.ndarray, tile_bf16) -> np.ndarray:
        norms = self.kernels.rounding_norms(tile, tile_bf16.float().numpy())
        return bound_from_norms(*norms, tile.shape[1], self.node_norm, self.node_residual).astype(np.float32)

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
            k.scan_block(approx.view(torch.int16).numpy(), col0, t_minus_eps, eps, n,
                         cand_ids, cand_vals, counts, best, overflow, k.VALUES)
        ids, vals, *ranked = k.rescore_and_rank(
            tile, self.nodes, threshold, eps, n, cand_ids, cand_vals, counts, best, overflow,
            *self.graph, index.n_chunks, config.hops, config.top_k, self._threads(),
        )
        return ids, vals, ranked, overflow


class _TorchBackend:
    def __init__(self, index: QCGIndex, device: str, prefilter: bool = False):
        from .kernels.gather_dot import gather_dot

        self.torch = torch = require("torch")
        self._gather_dot = gather_dot
        self.index, self.device = index, torch.device(device)
        n = len(index.node_embeddings)
        self.nodes = torch.from_numpy(np.ascontiguousarray(index.node_embeddings)).to(self.device)
        degree = np.diff(index.knn_indptr)
        if n and not (degree == degree[0]).all():
            raise QCGError("the torch backend needs a kNN graph with the same degree on every row")
        self.k = int(degree[0]) if n else 0
        self.neighbors = torch.from_numpy(np.asarray(index.knn_indices, dtype=np.int64)).to(self.device).view(n, self.k)
        # one extra row so that padding (-1 -> n) gathers harmlessly: no neighbours, chunk "n_chunks"
        self.neighbors = torch.cat([self.neighbors, torch.full((1, self.k), n, device=self.device, dtype=torch.int64)])
        self.nodes_padded = torch.cat([self.nodes, torch.zeros((1, index.dim), device=self.device)])
        self.node_chunk = torch.from_numpy(np.r_[index.node_chunk, index.n_chunks]).to(self.device)
        self.nodes_bf16 = self.nodes.bfloat16() if prefilter and n else None
        if self.nodes_bf16 is not None:
            self.node_norm, self.node_residual = bf16_rounding(index.node_embeddings, self.nodes_bf16)
        self.fallback_rows = 0  # queries whose candidates did not fit the prefilter's top-k (float32 path instead)

    def search(self, q: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        torch, index, out = self.torch, self.index, _empty_result(len(q), config)
        n_nodes = len(index.node_embeddings)
        if n_nodes == 0:
            return out
        threshold = float(seed_threshold(config.gamma))
        on_gpu = self.device.type == "cuda"  # big GPUs take 1 GiB tiles of 4096 queries
        rows = _tile_rows(n_nodes, 4096 if on_gpu else 256, SIMILARITY_TILE_ELEMENTS * (4 if on_gpu else 1))
        with torch.inference_mode():
            for start in range(0, len(q), rows):
                tile = torch.from_numpy(q[start : start + rows]).to(self.device)
                part = slice(start, start + len(tile))
                n = min(config.n, n_nodes)
                if self.nodes_bf16 is not None:
                    seed_ids, seed_sims = self._seeds_bf16(tile, threshold, n)
                else:
                    seed_ids, seed_sims = self._seeds(tile @ self.nodes.T, threshold, n)
                out.seed_ids[part, : seed_ids.shape[1]] = seed_ids.cpu().numpy()
                out.seed_sims[part, : seed_ids.shape[1]] = seed_sims.cpu().numpy()
                selected = self._expand(seed_ids, config.hops)
                chunks, scores = self._rank_chunks(tile, selected, config.top_k)
                out.chunk_ids[part], out.scores[part] = chunks.cpu().numpy(), scores.cpu().numpy()
                out.n_selected[part] = (selected < n_nodes).sum(1).cpu().numpy()
        return out

    def _seeds(self, sims, threshold: float, n: int):
        """Best n with sim >= threshold, ties by lower id; -1 padded."""
        torch = self.torch
        width = min(sims.shape[1], n + TOPK_MARGIN)
        vals, ids = sims.topk(width, dim=1)
        ids, vals = _best_first(ids, vals)  # topk does not promise an order among ties
        # a tie between the n-th and the last candidate may continue past the candidates: sort the row fully
        unsure = (vals[:, n - 1] >= threshold) & (vals[:, n - 1] == vals[:, -1]) & (width < sims.shape[1])
        for r in torch.nonzero(unsure).flatten().tolist():
            order = (-sims[r]).argsort(stable=True)[:width]
            ids[r], vals[r] = order, sims[r, order]
        ids, vals = ids[:, :n], vals[:, :n]
        keep = vals >= threshold
        return torch.where(keep, ids, -1), torch.where(keep, vals, torch.full_like(vals, -float("inf")))

    def _seeds_bf16(self, tile, threshold: float, n: int):
        """Exact seeds from a bf16 GEMM: the top n + margin approximations hold every node that can
        be a seed when the last of them is below max(t, a_n - eps) - eps (see kernels/prefilter_cpu.py);
        those are rescored in float32, other rows take the float32 path."""
        torch = self.torch
        tile_bf16 = tile.bfloat16()
        with _float32_accumulation(torch):
            approx = tile_bf16 @ self.nodes_bf16.T
        eps = bf16_error_bound(tile.double(), tile_bf16.double(), self.node_norm, self.node_residual).float()
        width = min(approx.shape[1], n + PREFILTER_TOPK_MARGIN)
        vals, ids = approx.topk(width, dim=1)
        vals = vals.float()
        floor = torch.maximum(threshold - eps, vals[:, n - 1] - 2 * eps)
        complete = (vals[:, -1] < floor) | (width == approx.shape[1])
        sims = self._gather_dot(self.nodes, tile, ids)
        sims = torch.where((vals >= floor[:, None]) & (sims >= threshold), sims, -float("inf"))
        ids, sims = _best_first(ids, sims)
        ids, sims = ids[:, :n], sims[:, :n]
        ids = torch.where(torch.isfinite(sims), ids, -1)
        if not complete.all():
            rows = torch.nonzero(~complete).flatten()
            self.fallback_rows += len(rows)
            ids[rows], sims[rows] = self._seeds(tile[rows] @ self.nodes.T, threshold, n)
        return ids, sims

    def _expand(self, seed_ids, hops: int):
        """Q* per row as node ids (sorted, unique), padding = N."""
        torch, n_nodes = self.torch, len(self.index.node_embeddings)
        frontier = torch.where(seed_ids >= 0, seed_ids, n_nodes)
        reached = [frontier]
        for _ in range(hops):
            frontier = self.neighbors[frontier].flatten(1)  # padding rows point to padding
            frontier = _unique_rows(torch, frontier, n_nodes)
            reached.append(frontier)
        return _unique_rows(torch, torch.cat(reached, dim=1), n_nodes)

    def _rank_chunks(self, tile, selected, top_k: int):
        """Mean similarity per chunk over Q*, then the K best chunks (ties by lower chunk id)."""
        torch, n_chunks = self.torch, self.index.n_chunks
        sims = self._gather_dot(self.nodes_padded, tile, selected)  # only the Q* entries (Triton on CUDA)
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


@contextlib.contextmanager
def _float32_accumulation(torch):
    """cuBLAS may reduce bf16 GEMMs in bf16 by default; the prefilter's error bound assumes float32 sums."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved


def _best_first(ids, vals):
    """Each row's (id, value) entries ordered by value desc, then id asc (tensors)."""
    by_id = ids.argsort(dim=1)
    ids, vals = ids.gather(1, by_id), vals.gather(1, by_id)
    order = vals.argsort(dim=1, descending=True, stable=True)
    return ids.gather(1, order), vals.gather(1, order)


def _unique_rows(torch, ids, pad: int):
    """Sort each row and replace repeats by ``pad`` (which sorts last)."""
    ids, _ = ids.sort(dim=1)
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = torch.where(repeat, pad, ids)
    ids, _ = ids.sort(dim=1)
    width = int((ids < pad).sum(1).max().item()) if ids.numel() else 0
    return ids[:, : max(width, 1)]


def trace_query(index: QCGIndex, query: np.ndarray, seed_ids: np.ndarray, seed_sims: np.ndarray, hops: int) -> dict:
    """The paper's case-study view of one query: seeds, nodes added by expansion, and every chunk's score."""
    seeds = [int(u) for u in seed_ids if u >= 0]
    selected, frontier, added = set(seeds), set(seeds), []
    for _ in range(hops):
        frontier = {int(v) for u in frontier for v in index.knn_indices[index.knn_indptr[u] : index.knn_indptr[u + 1]]} - selected
        selected |= frontier
        added += sorted(frontier)
    nodes = np.array(sorted(selected), dtype=np.int64)
    sims = index.node_embeddings[nodes] @ query if len(nodes) else np.zeros(0)
    chunks: dict[int, list[float]] = {}
    for u, s in zip(nodes.tolist(), sims.tolist()):
        chunks.setdefault(int(index.node_chunk[u]), []).append(s)
    ranked = sorted(chunks.items(), key=lambda item: (-float(np.mean(item[1])), item[0]))
    return {
        "seeds": [{"node_id": u, "sim": float(s)} for u, s in zip(seeds, seed_sims.tolist())],
        "expanded": added,
        "chunks": [{"chunk_id": c, "score": float(np.mean(v)), "n_nodes": len(v)} for c, v in ranked],
    }
