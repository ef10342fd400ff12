"""The named structures the CPU kernels take, so that no call passes a dozen arrays by position (a
swapped ``indptr``/``indices`` or ``hops``/``top_k`` would compile and run). numba accepts named
tuples as arguments and builds them inside kernels; fields are read by name on both sides."""

from __future__ import annotations

from collections import namedtuple

Graph = namedtuple("Graph", ["indptr", "indices", "node_chunk", "n_chunks"])
Graph.__doc__ = """What expansion and chunk means read: the kNN CSR (out-edges of node u are
indices[indptr[u]:indptr[u + 1]]), each node's chunk, and the number of chunks."""

Ranking = namedtuple("Ranking", ["hops", "top_k", "n_threads"])
Ranking.__doc__ = "How to rank from seeds: h hops of expansion, K chunks kept, threads taking queries round-robin."

Candidates = namedtuple("Candidates", ["ids", "vals", "counts", "best", "overflow"])
Candidates.__doc__ = """The prefilter scan's state per query row: candidate node ids and their approximate
similarities (rows, capacity), how many each row holds, its n best approximations (descending), and
whether its near-ties overflowed the buffer."""

RowBounds = namedtuple("RowBounds", ["t_minus_eps", "eps", "unit"])
RowBounds.__doc__ = """Per query row: the threshold minus the row's error bound, the bound itself, and
the value of one integer key (int8 GEMMs; 1 otherwise)."""

Scratch = namedtuple("Scratch", ["stamp", "chunk_stamp", "chunk_sum", "chunk_count", "selected", "touched"])
Scratch.__doc__ = """One thread's work arrays for ranking, kept across its queries so that nothing of
size N is cleared per query: visit stamps of nodes and chunks, chunk sums and counts, Q* in visit
order, the chunks touched."""
