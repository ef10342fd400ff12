import sqlite3

from qcg_gpu.cache import GenerationCache


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
