"""Exact seeds on the CPU kinds users have, imitated by capping oneDNN's instruction set before torch
loads (``ONEDNN_MAX_CPU_ISA``): AVX2 alone (EPYC Zen 2/3, Xeons before Cascade Lake), VNNI without
AMX (Cascade Lake), and this machine's own. Without VNNI oneDNN's int8 GEMM adds products in pairs
into int16 and saturates; the int8 prefilter must notice and stay exact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qcg_gpu.capabilities import WITH_TORCH, _cpuinfo

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not WITH_TORCH, reason="the int8 and bf16 prefilters run their GEMM in torch")
@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE_VNNI", None], ids=["avx2", "vnni", "native"])
def test_low_precision_prefilters_give_the_float64_seeds_on_every_cpu_kind(isa):
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    run = subprocess.run(
        [sys.executable, "-m", "tests.cpu_kind_seeds"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["seeds_per_query"] == 10  # every query has n seeds, so there are seeds to get wrong
    assert report["int8"] == 0, report  # queries whose seeds or seed similarities differ
    assert report["bf16"] == 0, report
    if isa == "AVX2":
        assert report["int8_node_code_max"] == 63  # 7-bit node codes: pair sums fit int16
    elif "avx512_vnni" in _cpuinfo()[1]:
        assert report["int8_node_code_max"] == 127  # VNNI sums in int32: full 8-bit codes
