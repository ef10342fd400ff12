"""Retrieval settings and the paper's per-dataset presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QCGError
from .utils import check_at_least, check_fields, option, setting_name

PRESETS = {  # the paper's per-dataset retrieval settings (k, the kNN degree, is fixed when the index is built)
    "lihuaworld": {"gamma": 1.5, "n": 10, "hops": 1, "top_k": 5},
    "multihop-rag": {"gamma": 1.0, "n": 15, "hops": 1, "top_k": 5},
}


@dataclass
class RetrievalConfig:
    gamma: float = option(1.5, "Seed threshold on sim + 1 (in [0, 2]; paper: 1.5 LiHuaWorld, 1.0 MultiHop-RAG).")
    n: int = option(10, "Most seed nodes per query (paper: 10 LiHuaWorld, 15 MultiHop-RAG).")
    hops: int = option(1, "Expansion hops along kNN edges (0-3; paper: 1).")
    top_k: int = option(5, "Chunks returned per query (K).")
    backend: str = option(
        "auto",
        "Retrieval backend: torch (CUDA when present), numpy (numba kernels), or auto.",
        ("auto", "torch", "numpy"),
        flag="--retrieval-backend",
        runtime=True,
    )
    device: str | None = option(
        None,
        "Torch device for the torch backend (default: cuda when present, else cpu).",
        flag="--retrieval-device",
        runtime=True,
    )
    prefilter: str = option(
        "auto",
        "Precision of the similarity GEMM, a prefilter whose candidates are rescored in float64 (the same seeds "
        "and similarities in every precision): off = IEEE float32, bf16 (GPUs, CPUs with AMX) or int8 (CPU "
        "backend; x86 CPUs: several times faster with VNNI, about 2x on AVX2 alone); auto = bf16 on GPUs from "
        "Ampere on and AMX CPUs, int8 on other x86 CPUs, else off.",
        ("auto", "bf16", "int8", "off"),
        runtime=True,
    )

    def validate(self) -> RetrievalConfig:
        check_fields(self)
        if not 0.0 <= self.gamma <= 2.0:
            raise QCGError(f"{setting_name(self, 'gamma')} must be in [0, 2], got {self.gamma}")
        check_at_least(self, 1, "n", "top_k")
        if not 0 <= self.hops <= 3:
            raise QCGError(f"{setting_name(self, 'hops')} must be in 0..3, got {self.hops}")
        return self
