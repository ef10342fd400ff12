"""Exact seeds on the CPU kinds users have, imitated by capping oneDNN's instruction set before torch
loads (``ONEDNN_MAX_CPU_ISA``): AVX2 alone (EPYC Zen 2/3, Xeons before Cascade Lake), VNNI without
AMX (Cascade Lake), and this machine's own. Without VNNI oneDNN's int8 GEMM may add products in pairs
into int16 and saturate (capped AVX-512 CPUs did); the int8 prefilter must notice and stay exact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    assert report["int8_matmul"] == 0, report
    assert report["bf16"] == 0, report
    # Full 8-bit node codes where a GEMM of the prefilter's size sums them exactly (VNNI sums in int32; so
    # did a real AVX2-only EPYC Zen 2), else 7-bit ones, whose pair sums fit int16 (oneDNN's AVX2 kernel on
    # an AVX-512 CPU capped to AVX2 saturates there).
    assert report["int8_node_code_max"] == (127 if report["int8_full_codes_exact"] else 63), report
    if "avx512_vnni" in _cpuinfo()[1] and isa != "AVX2":
        assert report["int8_node_code_max"] == 127
    assert report["int8_matmul_node_code_max"] in (127, 63), report  # 63 on a real EPYC Zen 3


# MKL's own AVX2 kernels (MKL runs them on AMD CPUs, Zen 4 included), with and without oneDNN capped too.
MKL_AVX2 = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
AVX2_LIBRARIES = MKL_AVX2 | {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.skipif(not WITH_TORCH, reason="the embedder runs in torch")
@pytest.mark.parametrize("caps", [MKL_AVX2, AVX2_LIBRARIES, {}], ids=["mkl-avx2", "avx2", "native"])
def test_a_text_embeds_to_the_same_bits_whatever_the_thread_count(caps, tmp_path):
    """The driver embeds with every core, a Ray worker with its share of them (one thread here), and a
    process may change its count once started (torch.set_num_threads): equal bits on every CPU kind
    (MKL's AVX2 sgemm differed after that switch, by up to 1e-7, unless its strict reproducible mode is on)."""
    env = {k: v for k, v in os.environ.items() if k not in AVX2_LIBRARIES and k != "MKL_CBWR"} | caps
    runs = {"two": ("2",), "one": ("1",), "one_then_two": ("1", "2")}  # OMP_NUM_THREADS[, then torch's]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in runs}  # files, not pipes: none fills up
    processes = {  # side by side: the bits do not depend on the load, and each start takes ~7 s of imports
        name: subprocess.Popen(
            [sys.executable, "-m", "tests.cpu_kind_embeddings", str(tmp_path / f"{name}.npy"), *then],
            cwd=ROOT,
            env=env | {"OMP_NUM_THREADS": threads},
            stdout=subprocess.DEVNULL,
            stderr=logs[name],
        )
        for name, (threads, *then) in runs.items()
    }
    for name, process in processes.items():
        returncode = process.wait(timeout=600)
        logs[name].close()
        assert returncode == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    two = np.load(tmp_path / "two.npy")
    assert len(two) == 64
    for name in ("one", "one_then_two"):
        got = np.load(tmp_path / f"{name}.npy")
        assert np.array_equal(got, two), f"{name}: {int((got != two).any(axis=1).sum())} of 64 rows differ"
