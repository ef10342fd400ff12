import sqlite3

import pytest

from qcg_gpu.errors import QCGError
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


def test_a_cache_file_that_is_not_a_database_is_refused_in_one_line(tmp_path):
    (tmp_path / "cache.sqlite").write_bytes(bytes(range(256)) * 20)  # was a sqlite3.DatabaseError traceback
    with pytest.raises(QCGError, match=r"cannot open the cache .*cache.sqlite: file is not a database"):
        GenerationCache(tmp_path / "cache.sqlite")


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
    assert list(fresh.import_parquet(tmp_path / "out.parquet")) == keys[:-1]  # in the file's order
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
    assert list(store.stored) == ["a"] and store.cache.unreadable_stored == 3  # a key of None counts too
    assert "3 rows of" in capsys.readouterr().err  # a warning line on stderr (and a note in the build's summary)
    store.close()


def test_a_run_rewriting_the_file_it_read_keeps_the_replies_it_did_not_use(tmp_path):
    """Two evaluations sharing one --answers-in/--answers-out file (run.sh answers runs two): the second
    must add its replies to the file, not replace the first's (it did, and lost them)."""
    import pyarrow.parquet as pq

    from qcg_gpu.llm.cache import ReplyStore

    shared = tmp_path / "answers.parquet"
    first = ReplyStore(tmp_path / "one.sqlite", None, str(shared))
    first.use(["a", "b"])
    first.cache.put_many({"a": {"text": "A"}, "b": {"text": "B"}})
    first.close()
    second = ReplyStore(tmp_path / "two.sqlite", str(shared), str(shared))  # another machine's cache
    second.use(["b", "c"])
    second.cache.put_many({"c": {"text": "C"}})
    second.close()
    assert pq.read_table(shared).column("key").to_pylist() == ["a", "b", "c"]
    elsewhere = tmp_path / "subset.parquet"  # written to another file, a run shares only what it used
    third = ReplyStore(tmp_path / "two.sqlite", str(shared), str(elsewhere))
    third.use(["c"])
    third.close()
    assert pq.read_table(elsewhere).column("key").to_pylist() == ["c"]
