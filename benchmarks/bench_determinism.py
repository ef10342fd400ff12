"""Are two identical Doc2Query runs equal, and what does a deterministic schedule cost?

    python benchmarks/bench_determinism.py [--docs DIR] [--limit 6] [--m 6] [--runs 4] [--model M]

One vLLM engine generates the same chunks' pairs ``--runs`` times in each of two modes, the modes
alternating so both see the same machine:

- ``async``: vLLM's default, each request's JSON grammar compiled on a thread pool; a request joins
  an engine step only once its grammar is ready, so which requests share a step depends on timing;
- ``in_step``: grammars compiled as requests arrive (``qcg_gpu.llm.vllm_compat.compile_grammars_in_step``,
  what qcg does), so the same requests give the same steps.

Before every run the engine's prefix cache is emptied, so each run starts as a fresh process would.
Prints, per mode, how many distinct sets of replies the runs gave (1 = reproducible), how many
chunks differ from the mode's first run, and output tok/s (median), as JSON lines after the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.config import IndexConfig
from qcg_gpu.indexing import doc2query
from qcg_gpu.indexing.documents import SkipLog
from qcg_gpu.indexing.stages import IndexSummary, iter_chunks
from qcg_gpu.llm.backends import VLLMBackend

DOCS = Path(__file__).resolve().parents[1] / "examples" / "lihuaworld_sample" / "docs"


def doc2query_requests(docs: str, limit: int, m: int, model: str | None):
    """The first ``limit`` chunks' Doc2Query conversations, their sampling and a vLLM engine, as a build
    makes them."""
    config = IndexConfig()
    config.generation.m, config.generation.model = m, model
    chunks = list(iter_chunks(docs, config, IndexSummary(out=None), SkipLog()))[:limit]
    system = doc2query.system_prompt(config.generation)
    conversations = [doc2query.build_conversation(c.text, config.generation.m, system) for c in chunks]
    return conversations, doc2query.sampling_spec(config.generation), VLLMBackend(config.generation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default=str(DOCS))
    parser.add_argument("--limit", type=int, default=6, help="chunks to generate")
    parser.add_argument("--m", type=int, default=6)
    parser.add_argument("--runs", type=int, default=4, help="runs per mode")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    conversations, sampling, backend = doc2query_requests(args.docs, args.limit, args.m, args.model)
    manager = backend.llm.llm_engine.engine_core.engine_core.structured_output_manager
    print(json.dumps({"cpu": cpu_kind(), "chunks": len(conversations), "m": args.m, "model": backend.model_name}))

    replies: dict[str, list[tuple[str, ...]]] = {"async": [], "in_step": []}
    rates: dict[str, list[float]] = {"async": [], "in_step": []}
    for _ in range(args.runs):
        for mode in replies:
            manager._use_async_grammar_compilation = mode == "async"
            start = time.perf_counter()
            completions = backend.chat(conversations, sampling)
            elapsed = time.perf_counter() - start
            replies[mode].append(tuple(c.text for c in completions))
            rates[mode].append(sum(c.output_tokens for c in completions) / elapsed)
    for mode, runs in replies.items():
        first = runs[0]
        print(
            json.dumps(
                {
                    "mode": mode,
                    "runs": len(runs),
                    "distinct_outcomes": len(set(runs)),
                    "chunks_differing_from_first_run": [sum(a != b for a, b in zip(first, run)) for run in runs[1:]],
                    "output_tok_per_s_median": round(statistics.median(rates[mode]), 1),
                    "output_tok_per_s": [round(r, 1) for r in rates[mode]],
                }
            )
        )


if __name__ == "__main__":
    main()
