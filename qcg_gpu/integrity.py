"""``qcg check INDEX``: verify an index in full — checksums, shapes, unit-length embeddings,
a valid kNN CSR, and tables that agree with each other and with the manifest's counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import QCGError
from .index_format import (
    ARRAYS,
    MANIFEST,
    TABLES,
    csr_problems,
    expected_files,
    index_shards,
    load_array,
    load_shard_array,
    load_table,
    manifest_problems,
    read_manifest,
    verify_file,
)

BLOCK_ROWS = 1 << 18
NORM_TOLERANCE = {np.dtype(np.float32): 1e-3, np.dtype(np.float16): 1e-2}


def check_index(index: str | Path, checksums: bool = True) -> list[str]:
    """Every problem found (an empty list: the index is sound). Raises only when there is no manifest to go by."""
    index = Path(index)
    manifest = read_manifest(index)
    problems = manifest_problems(manifest)
    if problems:
        return problems  # without its counts and models nothing else can be checked
    listed = manifest.get("files", {})
    for name in expected_files(manifest):
        if name not in listed:
            problems.append(f"{name} is not listed in {MANIFEST}")
    if checksums:
        for name in listed:
            problems += _attempt(lambda name=name: verify_file(index, name, manifest))
    if problems:
        return problems  # shapes of corrupt files would only add noise
    problems += _shard_problems(index, manifest)
    if problems:
        return problems
    counts, dim = manifest["counts"], manifest["models"]["embedding_dim"]
    arrays = {name: load_array(index, name) for name in ARRAYS}
    tables = {name: load_table(index, name) for name in TABLES}
    expected_rows = {
        "chunk_embeddings": counts["chunks"],
        "pair_embeddings": counts["pairs_valid"],
        "node_embeddings": counts["nodes"],
    }
    for name, rows in expected_rows.items():
        problems += _embedding_problems(name, arrays[name], rows, dim)
    problems += csr_problems(arrays["knn_indptr"], arrays["knn_indices"], counts["nodes"])
    if len(arrays["knn_scores"]) != len(arrays["knn_indices"]):
        problems.append(f"knn_scores has {len(arrays['knn_scores'])} entries for {len(arrays['knn_indices'])} edges")
    problems += _table_problems(tables, counts)
    return problems


def _shard_problems(index: Path, manifest: dict) -> list[str]:
    """A sharded index's shards: consecutive node, chunk and pair ranges from 0, each with its kNN rows."""
    shards, problems = index_shards(manifest), []
    counts = manifest["counts"]
    for space, total in (("nodes", counts["nodes"]), ("chunks", counts["chunks"]), ("pairs", counts["pairs_valid"])):
        ranges = [s.rows(space) for s in shards]
        if ranges and (
            ranges[0][0] != 0 or ranges[-1][1] != total or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:]))
        ):
            problems.append(f"the shards' {space} ranges {ranges} do not cover 0..{total} in order")
    for shard in shards if not problems else []:
        lo, hi = shard.nodes
        indptr = load_shard_array(index, manifest, shard, "knn_indptr", verify=False)
        indices = load_shard_array(index, manifest, shard, "knn_indices", verify=False)
        problems += [f"shard {shard.name}: {p}" for p in csr_problems(indptr, indices, hi - lo, counts["nodes"], lo)]
    return problems


def _attempt(check) -> list[str]:
    try:
        check()
    except QCGError as exc:
        return [str(exc)]
    return []


def _embedding_problems(name: str, array: np.ndarray, rows: int, dim: int) -> list[str]:
    if array.shape != (rows, dim):
        return [f"{name} has shape {array.shape}, expected ({rows}, {dim})"]
    worst = 0.0
    for start in range(0, len(array), BLOCK_ROWS):  # blocks: a memory-mapped array may be larger than RAM
        block = np.asarray(array[start : start + BLOCK_ROWS], dtype=np.float32)
        if not np.isfinite(block).all():
            return [f"{name} holds NaN or infinite values"]
        worst = max(worst, float(np.abs(np.linalg.norm(block, axis=1) - 1.0).max()))
    tolerance = NORM_TOLERANCE.get(array.dtype, 1e-3)
    return [f"{name} rows are not unit length (worst |norm - 1| = {worst:.2g})"] if worst > tolerance else []


def _table_problems(tables: dict, counts: dict) -> list[str]:
    problems = []
    chunks, pairs, nodes = tables["chunks"], tables["pairs"], tables["nodes"]
    if chunks.num_rows != counts["chunks"] or chunks.column("chunk_id").to_pylist() != list(range(chunks.num_rows)):
        problems.append(
            f"chunks.parquet has {chunks.num_rows} rows / chunk ids not 0..n-1 (manifest: {counts['chunks']} chunks)"
        )
    if pairs.num_rows != counts["pairs_valid"]:
        problems.append(f"pairs.parquet has {pairs.num_rows} rows, manifest says {counts['pairs_valid']} valid pairs")
    elif pairs.num_rows and (kept := sum(pairs.column("kept").to_pylist())) != counts["pairs_kept"]:
        problems.append(f"pairs.parquet keeps {kept} pairs, manifest says {counts['pairs_kept']}")
    if nodes.num_rows != counts["nodes"]:
        problems.append(f"nodes.parquet has {nodes.num_rows} rows, manifest says {counts['nodes']} nodes")
    for name, table in (("pairs", pairs), ("nodes", nodes)):
        ids = table.column("chunk_id").to_numpy()
        if len(ids) and (ids.min() < 0 or ids.max() >= counts["chunks"]):
            problems.append(f"{name}.parquet names chunks outside [0, {counts['chunks']})")
    return problems
