"""The similarity GEMM in each precision a prefilter could use, on this CPU (issue 18): how much
faster than float32 can a low-precision prefilter make retrieval's dominant step?

Times ``queries @ nodes.T`` (384-d, in the prefilters' tiles of 512 x 8192) in float32
(torch.mm: MKL), bf16 and fp16 (torch.mm: oneDNN, AMX where present) and int8 (torch._int_mm:
oneDNN, VNNI/AMX-INT8 where present), and prints operations per second and the ratio to float32.
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

DIM, ROWS, COLS, NODES = 384, 512, 8192, 98_304


def rate(dtype: str, repeat: int = 3) -> float:
    """Best-of-``repeat`` multiply-adds x 2 per second over NODES nodes, in tiles of ROWS x COLS."""
    gen = torch.Generator().manual_seed(0)
    if dtype == "int8":
        q = torch.randint(-127, 128, (ROWS, DIM), dtype=torch.int8, generator=gen)
        x = torch.randint(-127, 128, (NODES, DIM), dtype=torch.int8, generator=gen)
        out = torch.empty((ROWS, COLS), dtype=torch.int32)

        def mm(block):
            return torch._int_mm(q, block.T, out=out)
    else:
        kind = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        q = torch.randn((ROWS, DIM), generator=gen).to(kind)
        x = torch.randn((NODES, DIM), generator=gen).to(kind)
        out = torch.empty((ROWS, COLS), dtype=kind)

        def mm(block):
            return torch.mm(q, block.T, out=out)

    blocks = [x[c : c + COLS].contiguous() for c in range(0, NODES, COLS)]
    mm(blocks[0])  # warm up (oneDNN builds its kernel on the first call)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for block in blocks:
            mm(block)
        best = min(best, time.perf_counter() - start)
    return 2 * ROWS * NODES * DIM / best / 1e9


def main() -> None:
    rates = {dtype: rate(dtype) for dtype in ("float32", "bf16", "fp16", "int8")}
    row = {
        "cpu": cpu_kind(),
        **{f"{d}_gops": round(r, 1) for d, r in rates.items()},
        **{f"{d}_over_float32": round(r / rates["float32"], 2) for d, r in rates.items() if d != "float32"},
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
