"""Custom kernels for batched retrieval.

Each kernel has a CPU twin or is itself the CPU path: the torch backend in
``qcg_gpu/retrieval/torch_backend.py`` is the GPU path (and runs on CPU tensors for parity
tests), with the Triton kernel of ``gather_dot.py`` on CUDA; the numba kernels
here are the CPU path. The numba kernels take the named structures of ``structs.py`` (the graph,
the ranking settings, the scan's candidates), never a dozen arrays by position.
"""
