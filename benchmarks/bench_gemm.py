"""The similarity GEMM in each precision a prefilter could use, on this CPU (issue 18): how much
faster than float32 can a low-precision prefilter make retrieval's dominant step?

Times ``queries @ nodes.T`` (384-d, in the prefilters' tiles of 512 x 8192) in float32
(torch.mm: MKL), bf16 and fp16 (torch.mm: oneDNN, AMX where present) and int8 by both routes of
``qcg_gpu/retrieval/int8_gemm.py`` (torch._int_mm, and oneDNN's matmul primitive on 7-bit node
codes as ``int8_matmul``; VNNI/AMX-INT8 where present), and prints operations per second and the
ratio to float32.
An older CPU can be imitated on a recent Intel one by capping the libraries' instruction sets, as
RESULTS.md does (the caps are printed with the CPU): a Xeon with VNNI but no bf16 (Cascade Lake,
Ice Lake) by capping oneDNN, an AMD EPYC Zen 2/3 (AVX2 only) by capping everything:

    python benchmarks/bench_gemm.py
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python benchmarks/bench_gemm.py
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_gemm.py
"""

from __future__ import annotations

import json
import time

import torch

from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.retrieval import int8_gemm

DIM, ROWS, COLS, NODES = 384, 512, 8192, 98_304


def rate(dtype: str, repeat: int = 3) -> float:
    """Best-of-``repeat`` multiply-adds x 2 per second over NODES nodes, in tiles of ROWS x COLS."""
    gen = torch.Generator().manual_seed(0)
    if dtype.startswith("int8"):
        gemm = int8_gemm.QuantizedLinear() if dtype == "int8_matmul" else int8_gemm.IntMm()
        codes = int8_gemm.node_code_max(gemm, DIM)  # the node codes the prefilter gives this route here
        q = gemm.tile(torch.randint(-127, 128, (ROWS, DIM), dtype=torch.int8, generator=gen))
        x = torch.randint(-codes, codes + 1, (NODES, DIM), dtype=torch.int8, generator=gen)
        out = torch.empty((ROWS, COLS), dtype=gemm.output_dtype)
        packed = {}

        def mm(block):
            if block.data_ptr() not in packed:  # packed once, as the prefilter does when it loads the nodes
                packed[block.data_ptr()] = gemm.pack(block)
            return gemm(q, packed[block.data_ptr()], out)
    else:
        kind = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        q = torch.randn((ROWS, DIM), generator=gen).to(kind)
        x = torch.randn((NODES, DIM), generator=gen).to(kind)
        out = torch.empty((ROWS, COLS), dtype=kind)

        def mm(block):
            return torch.mm(q, block.T, out=out)

    blocks = [x[c : c + COLS].contiguous() for c in range(0, NODES, COLS)]
    for block in blocks:  # warm up: oneDNN builds its kernel on the first call, the matmul route packs each block
        mm(block)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for block in blocks:
            mm(block)
        best = min(best, time.perf_counter() - start)
    return 2 * ROWS * NODES * DIM / best / 1e9


def main() -> None:
    rates = {dtype: rate(dtype) for dtype in ("float32", "bf16", "fp16", "int8", "int8_matmul")}
    row = {
        "cpu": cpu_kind(),
        **{f"{d}_gops": round(r, 1) for d, r in rates.items()},
        **{f"{d}_over_float32": round(r / rates["float32"], 2) for d, r in rates.items() if d != "float32"},
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
