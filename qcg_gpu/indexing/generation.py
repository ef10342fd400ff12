"""The generate stage: Doc2Query replies for every chunk, from the stored generation (``--replies-in``),
the cache, or the LLM, and the valid pairs parsed from them.

Every reply is cached the moment it arrives and ``--replies-out`` is rewritten every
``cache.SHARE_EVERY_S`` seconds, so a killed run loses nothing it finished and leaves its replies to share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import IndexConfig
from ..llm.backends import NOT_REPORTED, LLMBackend, make_backend
from ..llm.cache import ReplyStore, generation_cache, reply_entry, stored_settings
from . import doc2query
from .chunking import Chunk
from .stages import IndexSummary, Pairs, chunk_ranges, stage
from .throughput import record_throughput


def generate_pairs(
    chunks: list[Chunk], llm: LLMBackend | None, model_name: str, config: IndexConfig, summary: IndexSummary
) -> Pairs:
    """Pairs of every chunk: stored and cached replies reused, the rest generated (the LLM is
    loaded only when some chunk has no reply yet)."""
    doc2query_run = Doc2QueryRun(llm, model_name, config, summary)
    try:
        return doc2query_run.pairs(chunks)
    finally:
        doc2query_run.close()


@dataclass
class ChunkReplies:
    """One list of chunks' replies as they are gathered, by cache key (equal chunks share one)."""

    chunks: list[Chunk]
    keys: list[str]
    replies: dict
    failed: dict[str, str] = field(default_factory=dict)  # cache key -> the error of its request


class Doc2QueryRun:
    """The generate stage of one build, over its chunks in one list or shard by shard (a Ray build):
    the stored generation is imported once, every shard's replies are cached as they arrive, and
    ``--replies-out`` holds every chunk seen so far."""

    def __init__(self, llm: LLMBackend | None, model_name: str, config: IndexConfig, summary: IndexSummary):
        self.llm, self.model_name, self.gen, self.summary = llm, model_name, config.generation, summary
        settings = reply_settings(config, model_name)
        if self.gen.replies_in:
            summary.notes += check_stored_settings(self.gen.replies_in, settings)
            summary.stored_chunks = 0
        self.store = ReplyStore(generation_cache(self.gen), self.gen.replies_in, self.gen.replies_out, settings)
        self.cache = self.store.cache
        if self.cache.unreadable_stored:
            summary.notes.append(self.store.unreadable_note(self.gen.replies_in))

    def pairs(self, chunks: list[Chunk], first_chunk: int = 0) -> Pairs:
        """The valid pairs of ``chunks`` (numbered from 0 in ``chunks``; ``first_chunk`` numbers their
        failures in the summary, which counts the whole build)."""
        gen, summary = self.gen, self.summary
        keys = [doc2query.cache_key(c.text, self.model_name, gen) for c in chunks]
        self.store.use(keys)
        if self.store.stored is not None:
            summary.stored_chunks = (summary.stored_chunks or 0) + sum(key in self.store.stored for key in keys)
        batch = ChunkReplies(chunks, keys, self.cache.get_many(list(set(keys))))
        summary.cache_corrupt = self.cache.corrupt
        cached = np.array([key in batch.replies for key in keys], dtype=bool)
        summary.cached_chunks += int(cached.sum())
        summary.earlier_replies += chunk_ranges(first_chunk + np.flatnonzero(cached))  # another batch than this run's
        missing = list(dict.fromkeys(i for i, key in enumerate(keys) if key not in batch.replies))
        if missing:
            with stage(summary, "load_llm"):
                self.llm = self.llm or make_backend(gen)
            with stage(summary, "generate"):
                self._generate(batch, missing)
        return self._parse(batch, first_chunk)

    def _generate(self, batch: ChunkReplies, missing: list[int]) -> None:
        """Replies to the chunks numbered ``missing``, cached and shared batch by batch as they arrive."""
        gen, summary, keys = self.gen, self.summary, batch.keys
        assert self.llm is not None
        system = doc2query.system_prompt(gen)
        conversations = [doc2query.build_conversation(batch.chunks[i].text, gen.m, system) for i in missing]
        for rows, completions in self.llm.chat_batches(conversations, doc2query.sampling_spec(gen), gen.batch_chunks):
            fresh = {}
            for i, completion in zip((missing[r] for r in rows), completions):
                if completion.error:
                    batch.failed[keys[i]] = completion.error
                    continue
                fresh[keys[i]] = reply_entry(completion)
                summary.generated_chunks += 1
                summary.generated_output_tokens += completion.output_tokens
            self.cache.put_many(fresh)
            batch.replies.update(fresh)
            self.store.share()
        for i in missing:  # a backend that ends without reporting a request: that chunk failed (retryable)
            if keys[i] not in batch.replies:
                batch.failed.setdefault(keys[i], NOT_REPORTED)
        summary.llm_reproducibility = self.llm.reproducibility()  # what the backend that ran applied

    def _parse(self, batch: ChunkReplies, first_chunk: int) -> Pairs:
        """The valid pairs of every chunk that has a reply; failed and empty chunks noted in the summary."""
        summary = self.summary
        chunk_ids, gen_index, questions, answers = [], [], [], []
        for chunk_id, key in enumerate(batch.keys):
            if key in batch.failed:
                summary.failed_chunks.append((first_chunk + chunk_id, batch.failed[key]))
                summary.failed_documents.setdefault(batch.chunks[chunk_id].doc_id, batch.failed[key])
                continue
            reply = batch.replies[key]
            summary.prompt_tokens += int(reply.get("prompt_tokens") or 0)
            summary.output_tokens += int(reply.get("output_tokens") or 0)
            summary.truncated_replies += reply.get("finish_reason") == "length"
            parsed = doc2query.parse_pairs(reply["text"], self.gen.m)
            summary.dropped.update(parsed.dropped)
            if not parsed.pairs:
                summary.empty_chunks.append(first_chunk + chunk_id)
            for number, (question, answer) in enumerate(parsed.pairs):
                chunk_ids.append(chunk_id)
                gen_index.append(number)
                questions.append(question)
                answers.append(answer)
        return Pairs(np.array(chunk_ids, dtype=np.int64), np.array(gen_index, dtype=np.int64), questions, answers)

    def close(self) -> None:
        """Log the run's generation rate, write --replies-out a last time, close the cache."""
        if self.summary.generated_chunks and "generate" in self.summary.seconds:  # not timed: it failed
            record_throughput(
                self.gen,
                self.model_name,
                self.summary.generated_chunks,
                self.summary.generated_output_tokens,
                self.summary.seconds["generate"],
                workers=getattr(self.llm, "workers", 1),
            )  # a RayLLM runs one engine per worker
        self.store.close()


def reply_settings(config: IndexConfig, model_name: str) -> dict:
    """What decided this build's replies (recorded in a stored generation), with the LLM by the name it is known by."""
    settings = config.reply_settings()
    settings["generation"]["model"] = model_name
    return settings


def check_stored_settings(path: str, settings: dict) -> list[str]:
    """A note for each setting a stored generation was made with that this build changes (its replies will not
    match)."""
    stored = stored_settings(path)
    if stored is None:
        return [
            f"{path} does not record its settings (made before qcg-gpu recorded them); replies match only under the "
            f"same ones"
        ]
    return [
        f"{path} was made with {section}.{key}={value!r}, this build uses {settings[section].get(key)!r}: "
        "chunks it affects are generated anew"
        for section, values in stored.items()
        for key, value in values.items()
        if section in settings and settings[section].get(key, value) != value
    ]
