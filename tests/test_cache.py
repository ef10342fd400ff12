import sqlite3

from qcg_gpu.llm.cache import GenerationCache


def test_roundtrip_and_persistence(tmp_path):
    path = tmp_path / "c.sqlite"
    cache = GenerationCache(path)
    cache.put_many({"a": {"text": "reply a", "output_tokens": 3}, "b": {"text": "reply b"}})
    cache.close()
    reopened = GenerationCache(path)
    assert reopened.get_many(["a", "b", "c"]) == {
        "a": {"text": "reply a", "output_tokens": 3},
        "b": {"text": "reply b"},
    }
    assert len(reopened) == 2


def test_corrupt_entries_are_misses_and_counted(tmp_path):
    path = tmp_path / "c.sqlite"
    GenerationCache(path).put_many({"good": {"text": "ok"}})
    db = sqlite3.connect(path)
    db.executemany("INSERT INTO replies VALUES (?, ?)", [("bad_json", "{trunc"), ("bad_shape", '{"no_text": 1}')])
    db.commit()
    cache = GenerationCache(path)
    assert cache.get_many(["good", "bad_json", "bad_shape"]) == {"good": {"text": "ok"}}
    assert cache.corrupt == 2


def test_many_keys_beyond_sqlite_parameter_limit(tmp_path):
    cache = GenerationCache(tmp_path / "c.sqlite")
    cache.put_many({str(i): {"text": str(i)} for i in range(1200)})
    assert len(cache.get_many([str(i) for i in range(1300)])) == 1200


def test_a_stored_generation_is_written_and_read_in_batches(tmp_path):
    """More replies than one batch (STREAM_ROWS): all of them go out in the keys' order, missing
    keys left out, with the settings; a fresh cache reads every one back."""
    import pyarrow.parquet as pq

    from qcg_gpu.llm.cache import STREAM_ROWS, stored_settings

    n = 2 * STREAM_ROWS + 5
    cache = GenerationCache(tmp_path / "c.sqlite")
    cache.put_many({f"k{i}": {"text": f"reply {i}", "output_tokens": i} for i in range(n)})
    keys = [f"k{i}" for i in reversed(range(n))] + ["missing"]
    assert cache.export_parquet(keys, tmp_path / "out.parquet", {"generation": {"m": 3}}) == n
    file = pq.ParquetFile(tmp_path / "out.parquet")
    assert file.metadata.num_row_groups == 3 and file.read().column("key").to_pylist() == keys[:-1]
    assert stored_settings(tmp_path / "out.parquet") == {"generation": {"m": 3}}
    fresh = GenerationCache(tmp_path / "fresh.sqlite")
    assert fresh.import_parquet(tmp_path / "out.parquet") == set(keys[:-1])
    assert fresh.get_many(["k0", f"k{n - 1}"]) == {
        "k0": {"text": "reply 0", "output_tokens": 0},
        f"k{n - 1}": {"text": f"reply {n - 1}", "output_tokens": n - 1},
    }


def test_unreadable_stored_rows_are_counted_and_reported(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qcg_gpu.llm.cache import ReplyStore

    path = tmp_path / "replies.parquet"
    values = ['{"text": "fine"}', "{not json", '{"no_text": 1}', '{"text": "also fine"}']
    pq.write_table(pa.table({"key": ["a", "b", "c", None], "value": values}), path)
    store = ReplyStore(tmp_path / "cache.sqlite", str(path))
    assert store.stored == {"a"} and store.cache.unreadable_stored == 3  # a key of None counts too
    assert "3 rows of" in capsys.readouterr().err  # a warning line on stderr (and a note in the build's summary)
    store.close()
