"""The generation runs measured on this machine: every build that generates appends its rate to
``throughput.jsonl`` next to its generation cache, and ``qcg index --dry-run`` plans from them."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from ..llm.cache import generation_cache

THROUGHPUT_LOG = "throughput.jsonl"


def throughput_log(gen) -> Path:
    return generation_cache(gen).with_name(THROUGHPUT_LOG)


def record_throughput(gen, model: str, chunks: int, output_tokens: int, seconds: float, workers: int = 1) -> None:
    """Append one generation run's measured rate to the log the forecasts read; ``workers``: Ray
    engines that shared the run (their rate includes starting them), 1 for one process."""
    if not chunks or seconds <= 0:
        return
    entry = {
        "unix": time.time(),
        "host": platform.node(),
        "model": model,
        "backend": gen.backend,
        "m": gen.m,
        "chunks": chunks,
        "workers": workers,
        "output_tokens": output_tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(output_tokens / seconds, 1),
    }
    path = throughput_log(gen)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(entry) + "\n")


def measured_runs(gen, model: str) -> list[dict]:
    """This machine's logged one-process runs of ``model`` on the backend of ``gen`` (what a forecast
    plans), largest first."""
    path, backend = throughput_log(gen), gen.backend
    runs = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                run = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if (run.get("model"), run.get("backend"), run.get("host"), run.get("workers", 1)) == (
                model,
                backend,
                platform.node(),
                1,
            ):
                runs.append(run)
    return sorted(runs, key=lambda r: -r["output_tokens"])
