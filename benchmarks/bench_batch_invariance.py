"""Does a Doc2Query reply depend on the requests batched with it, and does vLLM's batch-invariant mode
(``VLLM_BATCH_INVARIANT=1``) change that here? (issue 37 §4: a resumed or added build generates
its chunks in other batches than an uninterrupted one.)

    python benchmarks/bench_batch_invariance.py [--docs DIR] [--limit 6] [--m 6] [--model M]

For each mode (the variable unset, then 1) a fresh process starts one engine and generates the same
chunks twice: all at once (one engine window) and one at a time (a window of 1), its prefix cache
emptied before each. Prints, per mode, how many chunks' replies differ between the two, and the
output tok/s of each, as JSON lines after the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "examples" / "lihuaworld_sample" / "docs"


def generate(args) -> None:
    """In this process (the mode set in its environment): both batchings, one JSON line."""
    from bench_determinism import doc2query_requests  # this folder is on the path of a script run from it

    conversations, sampling, backend = doc2query_requests(args.docs, args.limit, args.m, args.model)
    texts, rates, errors = {}, {}, []
    for window in (len(conversations), 1):
        start = time.perf_counter()
        replies = dict(pair for done in backend.chat_stream(conversations, sampling, window) for pair in done)
        elapsed = time.perf_counter() - start
        texts[window] = [replies[i].text for i in range(len(conversations))]
        errors += [r.error for r in replies.values() if r.error]
        rates[window] = sum(r.output_tokens for r in replies.values()) / elapsed
    together, alone = texts[len(conversations)], texts[1]
    row = {"batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "unset"), "chunks": len(conversations)}
    row |= {"chunks_differing": sum(a != b for a, b in zip(together, alone)), "model": backend.model_name}
    row |= {"together_tok_per_s": round(rates[len(conversations)], 1), "alone_tok_per_s": round(rates[1], 1)}
    row |= {"failed_replies": len(errors), "first_error": errors[0][:300] if errors else None}
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default=str(DOCS))
    parser.add_argument("--limit", type=int, default=6, help="chunks to generate")
    parser.add_argument("--m", type=int, default=6)
    parser.add_argument("--model", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return generate(args)
    from qcg_gpu.capabilities import cpu_kind

    print(json.dumps({"cpu": cpu_kind(), "m": args.m}), flush=True)
    for mode in (None, "1"):  # the engine reads the variable when it starts: a process each
        env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"} | (
            {"VLLM_BATCH_INVARIANT": mode} if mode else {}
        )
        argv = [
            sys.executable,
            __file__,
            "--child",
            "--docs",
            args.docs,
            "--limit",
            str(args.limit),
            "--m",
            str(args.m),
        ]
        run = subprocess.run(
            argv + (["--model", args.model] if args.model else []), env=env, capture_output=True, text=True
        )
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        print(lines[-1] if run.returncode == 0 and lines else json.dumps({"mode": mode, "error": run.stderr[-1500:]}))


if __name__ == "__main__":
    main()
