"""Index-build benchmark: per-stage seconds, Doc2Query tokens/s, and the pipeline's
generation throughput as a ratio to a bare ``vllm.LLM.generate`` call on the same
prompts with the same sampling, measured side by side in one process.

    python benchmarks/bench_index.py --limit 40 --m 20          # ~10 min on 2 CPU cores
    python benchmarks/bench_index.py --docs PATH --model MODEL   # any corpus / model (GPU: vllm)
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.config import IndexConfig
from qcg_gpu.embedding import Embedder
from qcg_gpu.indexing import doc2query
from qcg_gpu.indexing.chunking import chunk_document, load_tokenizer
from qcg_gpu.indexing.documents import SkipLog, read_documents
from qcg_gpu.indexing.pipeline import build_index
from qcg_gpu.llm.backends import VLLMBackend

DEFAULT_DOCS = Path(__file__).resolve().parents[2] / "shared" / "data" / "lihuaworld" / "docs"


def bare_generate(backend: VLLMBackend, conversations, config) -> tuple[float, int]:
    """Seconds and output tokens of one plain LLM.generate over pre-rendered prompts."""
    tokenizer = backend.llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    params = backend.sampling_params(doc2query.sampling_spec(config.generation), conversations)
    backend.llm.reset_prefix_cache()  # every prompt prefilled in full, as the build's generation does
    start = time.perf_counter()
    outputs = backend.llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS)
    parser.add_argument("--limit", type=int, default=40, help="documents to index (0 = all)")
    parser.add_argument("--m", type=int, default=20)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "bench_index.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qcg-bench-") as work:  # the copied documents and the indexes
        run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> None:
    config = IndexConfig()
    config.generation.m = args.m
    config.generation.model = args.model
    config.generation.cache = str(work / "cache.sqlite")  # fresh: every chunk is generated

    docs = work / "docs"
    docs.mkdir()
    paths = sorted(args.docs.rglob("*.txt"))[: args.limit or None]
    for path in paths:
        (docs / f"{path.parent.name}_{path.name}").write_text(path.read_text())

    tokenizer = load_tokenizer(config.chunking.tokenizer)
    chunks = [
        c
        for d in read_documents(docs, SkipLog())
        for c in chunk_document(d.doc_id, d.pieces(), tokenizer, config.chunking)
    ]
    conversations = [doc2query.build_conversation(c.text, args.m) for c in chunks]

    start = time.perf_counter()
    backend = VLLMBackend(config.generation)
    load_s = time.perf_counter() - start
    embedder = Embedder(device=config.nodes.device)
    bare_generate(backend, conversations[:4], config)  # warm-up: grammar compilation, first batches

    bare_s, bare_tokens = bare_generate(backend, conversations, config)
    summary = build_index(docs, work / "index", config, llm=backend, embedder=embedder)
    bare2_s, bare2_tokens = bare_generate(backend, conversations, config)

    bare_rate = (bare_tokens + bare2_tokens) / (bare_s + bare2_s)
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} ({__import__('os').cpu_count()} cores)".strip(),
        "documents": len(paths),
        "chunks": summary.chunks,
        "m": args.m,
        "llm": backend.model_name,
        "llm_load_s": round(load_s, 1),
        "stage_seconds": {k: round(v, 2) for k, v in summary.seconds.items()},
        "pipeline_output_tokens": summary.generated_output_tokens,
        "pipeline_tokens_per_s": round(summary.generation_tokens_per_s, 1),
        "bare_runs": [
            {"seconds": round(bare_s, 2), "output_tokens": bare_tokens},
            {"seconds": round(bare2_s, 2), "output_tokens": bare2_tokens},
        ],
        "bare_tokens_per_s": round(bare_rate, 1),
        "ratio_pipeline_to_bare": round(summary.generation_tokens_per_s / bare_rate, 3),
        "pairs_valid": summary.pairs_valid,
        "pairs_kept": summary.pairs_kept,
        "pairs_dropped": dict(summary.dropped),
        "embedding_texts_per_s": round((summary.chunks + summary.pairs_valid) / summary.seconds["embed"], 1),
        "cpu": cpu_kind(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
