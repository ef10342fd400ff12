"""Generation cache: each chunk's LLM reply stored under its content hash.

SQLite gives atomic commits and safe concurrent readers, so a run killed at
any point keeps every batch it finished, and a rerun generates only the rest.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from .errors import QCGError
from .models import cache_dir

# Parquet schema metadata of a stored generation: the settings its keys were made with (JSON).
SETTINGS_KEY = b"qcg.generation"
STREAM_ROWS = 4096  # replies per batch when a stored generation is written or read


class GenerationCache:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=60)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.commit()
        self.corrupt = 0  # entries found unreadable (treated as missing and regenerated)

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

    def import_parquet(self, path: str | Path) -> set[str]:
        """Add the replies of a file written by :meth:`export_parquet`, STREAM_ROWS rows at a time;
        returns their keys (unreadable rows are skipped)."""
        import pyarrow.parquet as pq

        if not Path(path).is_file():
            raise QCGError(f"stored replies file not found: {path}")
        keys: set[str] = set()
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=STREAM_ROWS, columns=["key", "value"]):
                entries = {}
                for key, value in zip(batch.column("key").to_pylist(), batch.column("value").to_pylist()):
                    entry = self._decode(value)
                    if isinstance(key, str) and entry is not None:
                        entries[key] = entry
                self.put_many(entries)
                keys.update(entries)
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
