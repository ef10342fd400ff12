"""Dataset loaders: the real LiHuaWorld dev split with its published flaws, and MultiHop-RAG / JSONL
fixtures written in their exact formats; evidence must name the doc ids the index builder gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qcg_gpu.errors import QCGError
from qcg_gpu.eval.datasets import load_dataset, write_multihop_corpus
from qcg_gpu.indexing.documents import SkipLog, read_documents

from .conftest import REPO

LIHUAWORLD = REPO.parent / "shared" / "data" / "lihuaworld"


def _doc_ids(path: Path) -> set[str]:
    return {doc.doc_id for doc in read_documents(path, SkipLog())}


@pytest.mark.skipif(not LIHUAWORLD.exists(), reason="the shared LiHuaWorld data is not next to this checkout")
def test_lihuaworld_dev_split_with_its_flaws():
    evalset = load_dataset("lihuaworld", LIHUAWORLD)
    questions = {q.qid: q for q in evalset.questions}
    assert len(questions) == 213
    assert [sum(q.type == t for q in evalset.questions) for t in ("single", "multi", "null")] == [169, 22, 22]
    docs = _doc_ids(LIHUAWORLD / "docs")
    assert all(doc in docs for q in evalset.questions for doc in q.evidence)  # every key resolved to a real document
    assert all(q.evidence for q in evalset.questions if q.type != "null")
    assert all(not q.evidence and q.answer == "Insufficient information" for q in evalset.questions if q.type == "null")
    # the record with its evidence key in the answer, after a tab
    assert questions["297"].answer == "To find deeper meaning and fulfillment in Westworld"
    assert questions["297"].evidence == ["week37/20260916_1600"]
    # the key with a stray "Time: " prefix
    assert questions["390"].evidence == ["week39/20260930_1600"]
    assert questions["0"].evidence == ["week3/20260121_1000", "week26/20260701_1000"]
    assert any("297" in p and "tab" in p for p in evalset.problems)
    assert any("390" in p and "Time:" in p for p in evalset.problems)


def _lihuaworld_fixture(tmp_path, records) -> Path:
    (tmp_path / "docs" / "week1").mkdir(parents=True)
    for stem in ("20260105_1100", "20260106_0900"):
        (tmp_path / "docs" / "week1" / f"{stem}.txt").write_text(f"Time: {stem}\nLi Hua: hello\n")
    (tmp_path / "query_set.json").write_text(json.dumps(records))
    return tmp_path


def test_lihuaworld_unresolvable_keys_and_bad_records_are_reported(tmp_path):
    root = _lihuaworld_fixture(
        tmp_path,
        {
            "1": {"question": "Q1?", "answer": "A", "evidence": "20260105_11:00<and>20990101_00:00", "type": "Multi"},
            "2": {"question": "Q2?", "answer": "B", "evidence": "20990101_00:00", "type": "Single"},
            "3": {"question": "Q3?", "answer": 7, "evidence": "N/A", "type": "Null"},
            "4": {"question": "Q4?", "answer": "Insufficient information", "evidence": "N/A", "type": "Null"},
        },
    )
    evalset = load_dataset("lihuaworld", root)
    by_id = {q.qid: q for q in evalset.questions}
    assert sorted(by_id) == ["1", "2", "4"]
    assert by_id["1"].evidence == ["week1/20260105_1100"] and by_id["2"].evidence == []
    assert by_id["4"].type == "null" and by_id["4"].evidence == []
    text = "\n".join(evalset.problems)
    assert "20990101_00:00" in text and "question 3" in text and "question 2: no usable evidence" in text


def test_lihuaworld_layout_errors(tmp_path):
    with pytest.raises(QCGError, match="not found"):
        load_dataset("lihuaworld", tmp_path / "missing")
    (tmp_path / "queries_a.json").write_text("{}")
    (tmp_path / "queries_b.json").write_text("{}")
    with pytest.raises(QCGError, match="expected one questions file"):
        load_dataset("lihuaworld", tmp_path)
    with pytest.raises(QCGError, match="no docs/"):
        load_dataset("lihuaworld", tmp_path / "queries_a.json")
    (tmp_path / "docs").mkdir()
    (tmp_path / "queries_a.json").write_text("{not json")
    with pytest.raises(QCGError, match="not valid JSON"):
        load_dataset("lihuaworld", tmp_path / "queries_a.json")
    with pytest.raises(QCGError, match="unknown dataset"):
        load_dataset("hotpotqa", tmp_path)
    (tmp_path / "queries_a.json").write_text("{}")  # a split with no question scores nothing: refused
    with pytest.raises(QCGError, match="no questions in lihuaworld data"):
        load_dataset("lihuaworld", tmp_path / "queries_a.json")


def _multihop_fixture(tmp_path) -> Path:
    """Three articles and three questions in MultiHop-RAG's published layout and field names."""
    corpus = [
        {
            "title": "Chipmaker beats forecasts",
            "author": "A. Writer",
            "source": "TechWire",
            "published_at": "2023-10-02T10:00:00+00:00",
            "category": "technology",
            "url": "https://example.com/chips",
            "body": "The chipmaker reported record revenue of $10 billion.",
        },
        {
            "title": "League final goes to extra time",
            "author": "B. Writer",
            "source": "SportsDaily",
            "published_at": "2023-11-12T18:00:00+00:00",
            "category": "sports",
            "url": "https://example.com/final",
            "body": "The final was decided in extra time by a late goal.",
        },
        {
            "title": "Rates held steady",
            "author": "C. Writer",
            "source": "MoneyNews",
            "published_at": "2023-12-01T08:00:00+00:00",
            "category": "business",
            "url": "https://example.com/rates",
            "body": "The central bank kept interest rates unchanged.",
        },
    ]
    questions = [
        {
            "query": "Did the chipmaker report record revenue before the central bank held rates?",
            "answer": "Yes",
            "question_type": "temporal_query",
            "evidence_list": [
                {
                    "title": "Chipmaker beats forecasts",
                    "author": "A. Writer",
                    "url": "https://example.com/chips",
                    "source": "TechWire",
                    "category": "technology",
                    "published_at": "2023-10-02T10:00:00+00:00",
                    "fact": "record revenue of $10 billion",
                },
                {
                    "title": "Rates held steady",
                    "author": "C. Writer",
                    "url": "https://example.com/rates",
                    "source": "MoneyNews",
                    "category": "business",
                    "published_at": "2023-12-01T08:00:00+00:00",
                    "fact": "kept interest rates unchanged",
                },
            ],
        },
        {
            "query": "Which source reported the league final?",
            "answer": "SportsDaily",
            "question_type": "inference_query",
            "evidence_list": [
                {"title": "League final goes to extra time", "fact": "decided in extra time"},
                {"title": "An article that is not in the corpus", "fact": "?"},
            ],
        },
        {
            "query": "What did the mayor announce?",
            "answer": "Insufficient information.",
            "question_type": "null_query",
            "evidence_list": [],
        },
    ]
    (tmp_path / "corpus.json").write_text(json.dumps(corpus))
    (tmp_path / "MultiHopRAG.json").write_text(json.dumps(questions))
    return tmp_path


def test_multihop_rag_fixture(tmp_path):
    root = _multihop_fixture(tmp_path)
    evalset = load_dataset("multihop-rag", root)
    assert [q.type for q in evalset.questions] == ["temporal", "inference", "null"]
    first, second, null = evalset.questions
    assert first.evidence == ["https://example.com/chips", "https://example.com/rates"]
    assert second.evidence == ["https://example.com/final"]  # matched by title; the unknown article reported
    assert null.evidence == [] and null.answer == "Insufficient information."
    assert len(evalset.problems) == 1 and "not in the corpus" in evalset.problems[0]
    # the corpus as qcg index reads it: evidence names its doc ids
    out = tmp_path / "corpus.jsonl"
    assert write_multihop_corpus(root, out) == (3, [])
    docs = {doc.doc_id: "".join(doc.pieces()) for doc in read_documents(out, SkipLog())}
    assert set(first.evidence + second.evidence) <= set(docs)
    assert docs["https://example.com/chips"].startswith("Chipmaker beats forecasts\nTechWire 2023-10-02")


def test_corpus_articles_that_cannot_be_documents_are_left_out_by_name(tmp_path, cli):
    """Were a TypeError traceback (a number as title, a list as body), silent skips (not an object, no url
    or title), or written as they stood (no body: the title alone; a repeated url: two documents of one id)."""
    articles = [
        {"title": "Kept", "body": "A body.", "url": "u1"},
        3,
        {"title": "No body"},
        {"url": "u1", "body": "The same url again."},
        {"title": 5, "body": "x"},
        {"title": "t", "body": ["x"]},
        {"url": " ", "body": "b"},
        {"title": "Kept too", "body": "Another body."},
    ]
    (tmp_path / "corpus.json").write_text(json.dumps(articles))
    out = tmp_path / "corpus.jsonl"
    written, skipped = write_multihop_corpus(tmp_path / "corpus.json", out)
    assert written == 2 and [doc.doc_id for doc in read_documents(out, SkipLog())] == ["u1", "Kept too"]
    assert skipped == [
        "article 1: not an object (int)",
        "article 2: no body",
        "article 3: repeats the url or title 'u1' (the first is kept)",
        "article 4: its title is not a string",
        "article 5: its body is not a string",
        "article 6: no url or title",
    ]
    result = cli("corpus", "--dataset", "multihop-rag", "--data", tmp_path, "--out", out)
    assert result.returncode == 0 and "left out 6 articles: article 1: not an object (int); article 2" in result.stderr
    for nothing, message in (([], "(an empty list)"), ([3, {"title": "t"}], "(2 left out, the first: article 0")):
        (tmp_path / "corpus.json").write_text(json.dumps(nothing))
        result = cli("corpus", "--dataset", "multihop-rag", "--data", tmp_path, "--out", out)
        assert result.returncode == 2 and "no article to write " + message in result.stderr
        assert [doc.doc_id for doc in read_documents(out, SkipLog())] == ["u1", "Kept too"]  # left as it was


def test_limit_per_type_takes_the_first_of_each_type(tmp_path):
    from qcg_gpu.config import EvalConfig

    path = tmp_path / "q.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": f"Q{i}?", "type": t, "evidence_doc_ids": ["d"]}) + "\n"
            for i, t in enumerate(["Single", "Multi", "Single", "Null", "Multi", "Single"])
        )
    )
    questions = load_dataset("jsonl", path).questions
    assert [q.question for q in EvalConfig(limit_per_type=2).select(questions)] == ["Q0?", "Q1?", "Q2?", "Q3?", "Q4?"]
    assert EvalConfig().select(questions) == questions
    with pytest.raises(QCGError, match="must be >= 1"):
        EvalConfig(limit_per_type=0).select(questions)


def test_jsonl_questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"question": "Who?", "answer": "Ann", "evidence_doc_ids": ["d1"], "type": "Single", "query_id": "x"}\n\n'
        '{"question": "Why?", "answer": "Insufficient information"}\n'
        '{"question": "When?", "answer": "Noon", "evidence_doc_ids": ["d2"]}\n'
        '{"question": "Where?", "type": "Null"}\n'
    )
    evalset = load_dataset("jsonl", path)
    first, second, third, fourth = evalset.questions
    assert (first.qid, first.evidence, first.type) == ("x", ["d1"], "single")
    # neither evidence nor type: not silently a Null question, and reported
    assert (second.qid, second.evidence, second.type) == ("3", [], "untyped")
    assert evalset.problems == [
        "q.jsonl:3: neither 'type' nor 'evidence_doc_ids'; typed 'untyped' (answer metrics only); "
        'give "type": "null" to questions that should be declined'
    ]
    assert (third.type, fourth.type) == ("single", "null")
    path.write_text('{"question": ""}\n')
    with pytest.raises(QCGError, match=":1: needs a non-empty 'question'"):
        load_dataset("jsonl", path)
    path.write_text('{"question": "Q", "evidence_doc_ids": "d1"}\n')
    with pytest.raises(QCGError, match="must be a list"):
        load_dataset("jsonl", path)


def test_questions_with_a_byte_order_mark_repeated_ids_or_lone_surrogates(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"question": "Who?", "query_id": "a"}\n{"question": "Why?", "query_id": "b"}\n', encoding="utf-8-sig"
    )
    assert [q.qid for q in load_dataset("jsonl", path).questions] == ["a", "b"]
    # a repeated id would pair two questions' scores as one in the comparisons
    path.write_text('{"question": "Who?", "query_id": "a"}\n{"question": "Why?", "query_id": "a"}\n')
    with pytest.raises(QCGError, match="q.jsonl: query id 'a' is given 2 times; each query needs its own"):
        load_dataset("jsonl", path)
    path.write_text('{"question": "Who is caf\\udce9?"}\n')  # half a surrogate pair: the embedder crashed
    with pytest.raises(QCGError, match="q.jsonl: query 1 holds a lone surrogate"):
        load_dataset("jsonl", path)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_beir_split_with_qrels(tmp_path):

    _write_jsonl(
        tmp_path / "corpus.jsonl",
        [{"_id": "d1", "title": "Paris", "text": "Capital of France."}, {"_id": "d2", "title": "", "text": "Rome."}],
    )
    _write_jsonl(
        tmp_path / "queries.jsonl",
        [{"_id": "q1", "text": "capital of france?", "metadata": {"answer": "Paris"}}, {"_id": "q2", "text": "rome"}],
    )
    (tmp_path / "qrels").mkdir()
    (tmp_path / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0\nq2\td2\t2\nq3\td1\t1\nq2\td9\t1\n"
    )
    evalset = load_dataset("beir", tmp_path)
    assert [(q.qid, q.question, q.answer, q.evidence) for q in evalset.questions] == [
        ("q1", "capital of france?", "Paris", ["d1"]),  # score 0 is not relevant
        ("q2", "rome", "", ["d2"]),
    ]
    assert len(evalset.problems) == 2 and "'q3' is not in queries.jsonl" in evalset.problems[0]
    assert "'d9' is not in corpus.jsonl" in evalset.problems[1]
    # the index builder reads the same corpus with the same ids, the title on a line of its own
    docs = {d.doc_id: "".join(d.pieces()) for d in read_documents(tmp_path / "corpus.jsonl", SkipLog())}
    assert docs == {"d1": "Paris\nCapital of France.", "d2": "Rome."}


def test_hipporag_layout_resolves_supporting_passages_and_aliases(tmp_path):

    corpus = [
        {"title": "Green", "text": "Green is an album by Steve Hillage."},
        {"title": "Steve Hillage", "text": "Hillage's partner is Miquette Giraudy."},
        {"title": "Green", "text": "Green is a colour."},  # a repeated title: "Green (2)"
        {"title": "Film X", "text": "Film X was directed by Y. Y was born in 1950."},
        {"title": "Hot", "text": "One.Two."},
    ]
    samples = [
        {  # MuSiQue: paragraphs with is_supporting, answer aliases
            "id": "2hop__1_2",
            "question": "Who is the partner of the Green performer?",
            "answer": "Miquette Giraudy",
            "answer_aliases": ["Giraudy"],
            "paragraphs": [
                {"title": "Green", "paragraph_text": "Green is an album by Steve Hillage.", "is_supporting": True},
                {
                    "title": "Steve Hillage",
                    "paragraph_text": "Hillage's partner is Miquette Giraudy.",
                    "is_supporting": True,
                },
                {"title": "Green", "paragraph_text": "Green is a colour.", "is_supporting": False},
            ],
        },
        {  # 2WikiMultiHopQA: supporting_facts over [title, sentences] contexts, sentences joined by spaces
            "_id": "abc",
            "type": "compositional",
            "question": "When was the director of Film X born?",
            "answer": "1950",
            "supporting_facts": [["Film X", 0]],
            "context": [["Film X", ["Film X was directed by Y.", "Y was born in 1950."]], ["Other", ["No."]]],
        },
        {  # HotpotQA: sentences joined without spaces; a passage missing from the corpus is reported
            "_id": "def",
            "type": "bridge",
            "question": "Hot?",
            "answer": "yes",
            "supporting_facts": [["Hot", 0], ["Cold", 0]],
            "context": [["Hot", ["One.", "Two."]], ["Cold", ["Ice."]]],
        },
        {"question": "No answer?"},
    ]
    (tmp_path / "musique_corpus.json").write_text(json.dumps(corpus))
    (tmp_path / "musique.json").write_text(json.dumps(samples))
    evalset = load_dataset("hipporag", tmp_path)
    first, second, third = evalset.questions
    assert (first.qid, first.type, first.evidence) == ("2hop__1_2", "2hop", ["Green", "Steve Hillage"])
    assert first.answers == ["Miquette Giraudy", "Giraudy"]
    assert (second.type, second.evidence, third.type, third.evidence) == (
        "compositional",
        ["Film X"],
        "bridge",
        ["Hot"],
    )
    assert any("'Cold' is not in the corpus" in p for p in evalset.problems)
    assert any("musique.json[3]: no gold answer" in p for p in evalset.problems)
    docs = [d.doc_id for d in read_documents(tmp_path / "musique_corpus.json", SkipLog())]
    assert docs == ["Green", "Steve Hillage", "Green (2)", "Film X", "Hot"]


@pytest.mark.parametrize(
    "samples,message",
    [
        ([], "no usable questions in"),
        ([{"question": "No answer?"}], "no usable questions in"),
        (
            [{"_id": "a", "question": "Q?", "answer": "x", "supporting_facts": [["Elsewhere", 0]], "context": []}],
            "no supporting passage of any question in musique.json is in musique_corpus.json",
        ),
    ],
)
def test_hipporag_questions_with_nothing_to_score_are_refused(tmp_path, samples, message):
    """Like the jsonl and BEIR loaders: an evaluation that could only print empty metrics is refused."""
    (tmp_path / "musique_corpus.json").write_text(json.dumps([{"title": "Hot", "text": "One.Two."}]))
    (tmp_path / "musique.json").write_text(json.dumps(samples))
    with pytest.raises(QCGError, match=message):
        load_dataset("hipporag", tmp_path)


MALFORMED_HIPPORAG = [  # each was a traceback (TypeError, ValueError, AttributeError, KeyError)
    {"supporting_facts": 3},
    {"context": ["Hot"]},
    {"context": [["Hot", 5]]},
    {"answer_aliases": 5},
    {"supporting_facts": None, "context": None, "paragraphs": "x"},
    {"supporting_facts": None, "context": None, "paragraphs": [{"text": "One.Two."}]},
    {"supporting_facts": None, "context": None, "paragraphs": [3]},
]


def test_malformed_records_are_skipped_by_name_and_the_rest_scored(tmp_path):
    """A record whose fields have another shape than the dataset's is reported and skipped; the
    well-formed ones around it are loaded as before."""
    good = {
        "question": "Hot?",
        "answer": "yes",
        "supporting_facts": [["Hot", 0]],
        "context": [["Hot", ["One.", "Two."]]],
    }
    samples = [{k: v for k, v in {**good, **bad}.items() if v is not None} for bad in MALFORMED_HIPPORAG]
    (tmp_path / "musique_corpus.json").write_text(json.dumps([{"title": "Hot", "text": "One.Two."}]))
    (tmp_path / "musique.json").write_text(json.dumps([*samples, good]))
    evalset = load_dataset("hipporag", tmp_path)
    assert [q.evidence for q in evalset.questions] == [["Hot"]]
    assert [p.split(": its")[0] for p in evalset.problems] == [f"musique.json[{i}]" for i in range(len(samples))]
    assert all("malformed" in p and p.endswith("skipped") for p in evalset.problems)

    root = tmp_path / "multihop"
    root.mkdir()
    articles = [{"title": "T", "body": "B", "url": "u"}, {"title": ["x"], "url": {"a": 1}, "body": "B"}]
    records = [
        {"query": "q0", "evidence_list": "abc"},
        {"query": "q1", "evidence_list": [3]},
        {"query": "q2", "evidence_list": [{"url": ["u"], "title": "T"}]},  # the title still finds it
        {"query": "q3", "evidence_list": [{"url": "u"}]},
    ]
    (root / "corpus.json").write_text(json.dumps(articles))
    (root / "MultiHopRAG.json").write_text(json.dumps(records))
    evalset = load_dataset("multihop-rag", root)
    assert [(q.question, q.evidence) for q in evalset.questions] == [("q2", ["u"]), ("q3", ["u"])]
    assert evalset.problems == [f"question {i}: evidence_list is not a list of objects; skipped" for i in (0, 1)]
