"""The Triton gather-dot kernel (qcg_gpu/kernels/gather_dot.py) and its numba twin against float64:
compiled on CUDA when a GPU is present, and in Triton's interpreter on CPU tensors (in a
subprocess: the interpreter is chosen when the kernel is compiled), also inside the torch
retrieval backend against the plain reference."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from qcg_gpu.capabilities import WITH_TORCH
from qcg_gpu.kernels.gather_dot import gather_dot, gather_dot_cpu

from .conftest import DEVICES, REPO

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _case(seed: int = 0):
    rng = np.random.default_rng(seed)
    nodes = rng.standard_normal((300, 384)).astype(np.float32)
    queries = rng.standard_normal((9, 384)).astype(np.float32)
    ids = rng.integers(-1, 300, (9, 70))  # -1: padding; 70 = two full blocks of rows and a partial one
    want = np.einsum("bld,bd->bl", nodes[np.maximum(ids, 0)].astype(np.float64), queries.astype(np.float64))
    return nodes, queries, ids, np.where(ids >= 0, want, 0.0)


def test_numba_twin_matches_float64():
    nodes, queries, ids, want = _case()
    got = gather_dot_cpu(nodes, queries, ids)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert (got[ids < 0] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_gather_dot_matches_float64(device):
    torch = pytest.importorskip("torch")
    nodes, queries, ids, want = _case(1)
    got = gather_dot(*(torch.from_numpy(a).to(device) for a in (nodes, queries, ids))).cpu().numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert (got[ids < 0] == 0).all()


@pytest.mark.skipif(not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (see the next test)")
def test_interpreted_triton_kernel_is_the_one_used():
    from qcg_gpu.kernels.gather_dot import _triton_kernel

    assert type(_triton_kernel()).__name__ == "InterpretedFunction"


@pytest.mark.skipif(INTERPRETED, reason="starts the interpreted run itself")
def test_triton_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tests = [
        "tests/test_kernels.py",
        "tests/test_retrieval.py",
        "-k",
        # the kernel's edges (a partial block of rows, padding, 3 column steps) are in gather_dot's own case;
        # the backend's tests at a few nodes run it in place (its 9000-node tiles took 28 of 40 s here)
        "gather_dot or interpreted or (torch-cpu and (tiny or ties or expansion or no_seed))",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def one_openmp_thread() -> dict[str, str]:
    """This process's environment told OMP_NUM_THREADS=1, with nothing set for numba."""
    return {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"} | {"OMP_NUM_THREADS": "1"}


THREADS_AFTER_A_KERNEL = """
import qcg_gpu  # first, as the command line imports it: numba reads its thread count at import
import numpy as np, numba, torch
from qcg_gpu.kernels.seeds_cpu import top_n_above
top_n_above(np.ones((2, 5), np.float32), np.float32(0.5), 2)  # numba's thread pool starts
print(numba.get_num_threads(), torch.get_num_threads())
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every count is 1")
@pytest.mark.skipif(not WITH_TORCH, reason="torch's count is the one numba changed")
def test_omp_num_threads_holds_for_numba_and_for_torch_once_a_kernel_ran():
    """A process told OMP_NUM_THREADS=1 ran numba on every core, and once numba's OpenMP pool had
    started, torch too (it set OpenMP's count, which torch runs on, to its own)."""
    env = one_openmp_thread()
    run = subprocess.run([sys.executable, "-c", THREADS_AFTER_A_KERNEL], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["1", "1"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: numba's own count is OMP_NUM_THREADS=1 too")
def test_numba_imported_before_qcg_gpu_is_named_where_it_ignores_omp_num_threads():
    """Numba reads its thread count at import, so one imported before qcg_gpu ran on every core whatever
    OMP_NUM_THREADS said, silently."""
    env = one_openmp_thread()

    def stderr_of(program: str) -> str:
        run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stderr

    assert "numba was imported before qcg_gpu and runs" in stderr_of("import numba; import qcg_gpu")
    assert "numba was imported before" not in stderr_of("import qcg_gpu; import numba")
