"""LLM reply caches: each reply stored under a hash of what decided it.

SQLite gives atomic commits and safe concurrent readers, so a run killed at
any point keeps every batch it finished, and a rerun asks the LLM only for the rest.
Doc2Query replies are keyed by chunk (qcg_gpu/indexing/doc2query.py); answers and judgements of
``qcg eval`` by conversation (:class:`CachedLLM`). A :class:`ReplyStore` adds a stored
Parquet file to a cache first and shares a run's replies as one, rewritten as they come.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from ..config import GenerationConfig
from ..errors import QCGError
from ..log import logger
from ..models import cache_dir
from .backends import Completion, Conversation, LLMBackend, SamplingSpec, llm_name

# Parquet schema metadata of a stored generation: the settings its keys were made with (JSON).
SETTINGS_KEY = b"qcg.generation"
STREAM_ROWS = 4096  # replies per batch when a stored generation is written or read
SHARE_EVERY_S = 30.0  # how often a run rewrites its shared replies file (--replies-out, --answers-out)


class GenerationCache:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=60)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.commit()
        except (OSError, sqlite3.Error) as exc:
            raise QCGError(f"cannot open the cache {self.path}: {exc}") from exc
        self.corrupt = 0  # entries found unreadable (treated as missing and regenerated)
        self.unreadable_stored = 0  # rows of imported Parquet files that held no reply (skipped, so regenerated)

    def get_many(self, keys: list[str]) -> dict[str, dict]:
        found: dict[str, dict] = {}
        for start in range(0, len(keys), 500):  # SQLite caps bound parameters per statement
            batch = keys[start : start + 500]
            rows = self._db.execute(
                f"SELECT key, value FROM replies WHERE key IN ({','.join('?' * len(batch))})", batch
            ).fetchall()
            for key, value in rows:
                entry = self._decode(value)
                if entry is None:
                    self.corrupt += 1
                else:
                    found[key] = entry
        return found

    @staticmethod
    def _decode(value: str) -> dict | None:
        try:
            entry = json.loads(value)
        except (json.JSONDecodeError, TypeError):
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
            return None
        return entry

    def put_many(self, entries: dict[str, dict]) -> None:
        with self._db:  # one transaction: all of the batch or none of it
            self._db.executemany(
                "INSERT OR REPLACE INTO replies (key, value) VALUES (?, ?)",
                [(key, json.dumps(entry)) for key, entry in entries.items()],
            )

    def export_parquet(self, keys: list[str], path: str | Path, settings: dict | None = None) -> int:
        """Write the replies of ``keys`` to a Parquet file (key, reply JSON), atomically, with the
        ``settings`` that made them as metadata; returns the row count. Streamed, STREAM_ROWS rows
        at a time: a whole corpus's replies are never in memory at once."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema({"key": pa.string(), "value": pa.string()})
        if settings is not None:
            schema = schema.with_metadata({SETTINGS_KEY: json.dumps(settings, sort_keys=True)})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp, rows = path.with_name(f".{path.name}.tmp"), 0
        with pq.ParquetWriter(tmp, schema, compression="zstd", compression_level=19) as writer:
            for start in range(0, len(keys), STREAM_ROWS):
                batch = keys[start : start + STREAM_ROWS]
                entries = self.get_many(batch)
                found = [key for key in batch if key in entries]
                values = [json.dumps(entries[key], ensure_ascii=False) for key in found]
                writer.write_table(pa.table({"key": found, "value": values}, schema=schema))
                rows += len(found)
        tmp.replace(path)  # a reader (or a kill mid-write) never sees half a file
        return rows

    def import_parquet(self, path: str | Path) -> dict[str, None]:
        """Add the replies of a file written by :meth:`export_parquet`, STREAM_ROWS rows at a time;
        returns their keys in the file's order (an ordered set). Unreadable rows are skipped and
        counted in ``unreadable_stored``."""
        import pyarrow.parquet as pq

        if not Path(path).is_file():
            raise QCGError(f"stored replies file not found: {path}")
        keys: dict[str, None] = {}
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=STREAM_ROWS, columns=["key", "value"]):
                entries = {}
                for key, value in zip(batch.column("key").to_pylist(), batch.column("value").to_pylist()):
                    entry = self._decode(value)
                    if isinstance(key, str) and entry is not None:
                        entries[key] = entry
                    else:
                        self.unreadable_stored += 1
                self.put_many(entries)
                keys.update(dict.fromkeys(entries))
        except (OSError, ValueError, KeyError) as exc:
            raise QCGError(f"cannot read stored replies {path}: {exc}") from exc
        return keys

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]

    def close(self) -> None:
        self._db.close()


def stored_settings(path: str | Path) -> dict | None:
    """The settings a stored generation (:meth:`GenerationCache.export_parquet`) records, or None."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, ValueError) as exc:
        raise QCGError(f"cannot read stored replies {path}: {exc}") from exc
    return json.loads(metadata[SETTINGS_KEY]) if SETTINGS_KEY in metadata else None


def generation_cache(gen) -> Path:
    """The SQLite file of ``gen.cache``, or the user cache's default."""
    return Path(gen.cache) if gen.cache else cache_dir() / "doc2query-cache.sqlite"


def answer_cache(path: str | None) -> Path:
    """The SQLite file of ``qcg eval``'s answers and judgements: ``path``, or the user cache's default."""
    return Path(path) if path else cache_dir() / "answer-cache.sqlite"


class ReplyStore:
    """A run's replies: the cache, a stored file added to it first (``replies_in``), and the keys the run
    used, written to ``replies_out`` in that order at most every SHARE_EVERY_S seconds and at
    :meth:`close`, so a killed run leaves what it finished to share or commit. When ``replies_out`` is
    the file read in, it keeps that file's replies first: two runs sharing one file add to it."""

    def __init__(
        self,
        cache_path: str | Path,
        replies_in: str | None = None,
        replies_out: str | None = None,
        settings: dict | None = None,
    ):
        self.cache = GenerationCache(cache_path)
        self.stored = self.cache.import_parquet(replies_in) if replies_in else None  # the stored file's keys
        if self.cache.unreadable_stored:
            logger.warning(self.unreadable_note(replies_in))
        self.out, self.settings = replies_out, settings
        self.seen = dict[str, None]()  # the run's keys in order (an ordered set); kept only for replies_out
        if self.stored and replies_out and Path(replies_out).resolve() == Path(replies_in or "").resolve():
            self.seen.update(self.stored)  # rewriting the file read in: keep every reply it held, not only this run's
        self.last_shared = 0.0

    def unreadable_note(self, path) -> str:
        return f"{self.cache.unreadable_stored} rows of {path} held no readable reply: skipped (asked again)"

    def use(self, keys: list[str]) -> None:
        if self.out:
            self.seen.update(dict.fromkeys(keys))

    def share(self, force: bool = False) -> None:
        if self.out and (force or time.monotonic() - self.last_shared >= SHARE_EVERY_S):
            self.cache.export_parquet(list(self.seen), self.out, self.settings)
            self.last_shared = time.monotonic()

    def close(self) -> None:
        self.share(force=True)
        self.cache.close()


class CachedLLM(LLMBackend):
    """An LLM whose replies are kept in a :class:`ReplyStore`, each under a hash of the model, the engine
    settings that change replies, the sampling and the conversation: a rerun of a killed evaluation asks
    only what is missing, and the LLM is loaded (``load``) only when something is."""

    def __init__(self, config: GenerationConfig, store: ReplyStore, load: Callable[[], LLMBackend]):
        self.model_name = llm_name(config)
        self.identity = {"model": self.model_name, "engine": config.reply_engine_settings()}
        self.store, self.load, self.window = store, load, config.batch_chunks
        self.backend: LLMBackend | None = None
        self.reused = self.asked = 0  # replies taken from the store / asked of the LLM

    def key(self, conversation: Conversation, sampling: SamplingSpec) -> str:
        identity = {**self.identity, "sampling": sampling.__dict__, "conversation": conversation}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def chat(self, conversations: list[Conversation], sampling: SamplingSpec) -> list[Completion]:
        keys = [self.key(c, sampling) for c in conversations]
        self.store.use(keys)
        replies = self.store.cache.get_many(list(set(keys)))
        missing = list(dict.fromkeys(i for i, key in enumerate(keys) if key not in replies))  # each key once
        self.reused += len(keys) - len(missing)
        failed: dict[str, Completion] = {}
        if missing:
            logger.info(f"{len(missing)} of {len(keys)} replies not cached: asking {self.model_name}")
            self.backend = self.backend or self.load()
            batches = self.backend.chat_batches([conversations[i] for i in missing], sampling, self.window)
            for rows, completions in batches:
                fresh = {}
                for row, completion in zip(rows, completions):
                    key = keys[missing[row]]
                    if completion.error:  # not kept: a rerun asks again
                        failed[key] = completion
                    else:
                        fresh[key] = reply_entry(completion)
                self.store.cache.put_many(fresh)
                replies.update(fresh)
                self.asked += len(completions)
                self.store.share()
        return [failed[key] if key in failed else _completion(replies[key]) for key in keys]


def reply_entry(completion: Completion) -> dict:
    """What a cache keeps of a reply."""
    return {
        "text": completion.text,
        "prompt_tokens": completion.prompt_tokens,
        "output_tokens": completion.output_tokens,
        "finish_reason": completion.finish_reason,
    }


def _completion(entry: dict) -> Completion:
    return Completion(
        text=entry["text"],
        prompt_tokens=entry.get("prompt_tokens", 0),
        output_tokens=entry.get("output_tokens", 0),
        finish_reason=entry.get("finish_reason"),
    )
