"""vLLM's engine streamed: replies handed over as they finish, a bounded window kept full (real SmolLM2)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from qcg_gpu import build_index
from qcg_gpu.config import GenerationConfig, IndexConfig
from qcg_gpu.errors import QCGError
from qcg_gpu.indexing import doc2query
from qcg_gpu.indexing.stages import IndexSummary
from qcg_gpu.llm.backends import SamplingSpec

from .conftest import sample_docs

pytestmark = pytest.mark.llm

SAMPLING = SamplingSpec(temperature=0.0, top_p=1.0, max_tokens=12, seed=0)


def conversations(n: int) -> list:
    return [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(n)]


def test_stream_hands_over_every_reply_once_with_a_bounded_window(vllm_backend):
    engine = vllm_backend.llm.llm_engine
    seen, in_flight = [], []
    for finished in vllm_backend.chat_stream(conversations(7), SAMPLING, window=3):
        in_flight.append(engine.get_num_unfinished_requests())
        seen += [position for position, _ in finished]
        assert all(c.error is None and c.text and c.output_tokens > 0 for _, c in finished), finished
    assert sorted(seen) == list(range(7))
    assert max(in_flight) <= 3  # refilled up to the window, never beyond it
    assert not engine.has_unfinished_requests()


def test_stopping_early_frees_the_engine(vllm_backend):
    engine = vllm_backend.llm.llm_engine
    stream = vllm_backend.chat_stream(conversations(6), SAMPLING, window=4)
    first = next(stream)
    assert first and engine.has_unfinished_requests()
    stream.close()  # e.g. the caller was interrupted
    assert not engine.has_unfinished_requests()
    # the engine serves the next call as usual
    assert [c.error for c in vllm_backend.chat(conversations(2), SAMPLING)] == [None, None]


def test_engine_failure_fails_every_unfinished_request(vllm_backend, monkeypatch):
    engine = vllm_backend.llm.llm_engine
    real_step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("engine died")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    handed = {}
    for finished in vllm_backend.chat_stream(conversations(5), SAMPLING, window=2):
        handed.update(finished)
    assert sorted(handed) == list(range(5))  # each request once: finished, or failed with the engine's error
    failed = [c for c in handed.values() if c.error]
    assert failed and all(c.error == "vLLM engine error: RuntimeError: engine died" for c in failed)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()


def test_compact_json_replies_carry_no_optional_whitespace(tmp_path, vllm_backend, embedder):
    """vLLM 0.32 reads the whitespace rule from the engine, not the request, so the backend loads its
    engine so: the session's engine was loaded with the bundled model's setting, compact."""
    config = IndexConfig()
    config.generation.m, config.generation.compact_json = 2, True
    config.generation.cache = str(tmp_path / "cache.sqlite")
    config.generation.replies_out = str(tmp_path / "replies.parquet")
    config.nodes.device = "cpu"
    build_index(sample_docs(tmp_path / "docs", 2), tmp_path / "index", config, llm=vllm_backend, embedder=embedder)
    texts = [json.loads(v)["text"] for v in pq.read_table(tmp_path / "replies.parquet").column("value").to_pylist()]
    assert len(texts) == 2 and all(t.startswith('{"pairs":[{"question":"') and "\n" not in t for t in texts), texts


def test_an_engine_refuses_requests_for_the_other_json_layout(vllm_backend):
    """A reply cached under compact_json=False may be indented: an engine loaded compact (the bundled model's
    setting) refuses such requests, which would be answered compactly."""
    with pytest.raises(QCGError, match="loaded with compact_json=True"):
        vllm_backend.sampling_params(doc2query.sampling_spec(GenerationConfig(m=2, compact_json=False)), [])
    answering = SamplingSpec(temperature=0.0, top_p=1.0, max_tokens=8, seed=0)  # no JSON schema
    assert len(vllm_backend.sampling_params(answering, [[{"role": "user", "content": "Hi"}]])) == 1


def test_a_request_the_engine_refuses_fails_alone(vllm_backend):
    too_long = [{"role": "user", "content": "word " * (vllm_backend.llm.llm_engine.model_config.max_model_len + 100)}]
    handed = {}
    for finished in vllm_backend.chat_stream([*conversations(2), too_long, *conversations(1)], SAMPLING, window=2):
        handed.update(finished)
    assert sorted(handed) == [0, 1, 2, 3]
    assert handed[2].error.startswith("vLLM refused the request")
    assert [handed[i].error for i in (0, 1, 3)] == [None, None, None]
    # a build's summary tells that a rerun as is cannot help such a chunk (it said "rerun to retry")
    lines = IndexSummary(out=Path("idx"), failed_chunks=[(7, handed[2].error)]).format().splitlines()
    assert "  FAILED chunks (no LLM reply): [7]" in lines
    assert "raise --max-model-len (the server's own with --backend openai), then qcg index retry idx" in lines[-1]


def test_the_token_meter_counts_tokens_before_any_reply_finishes(vllm_backend):
    """The bar's count moves while requests run, never exceeds one token a request per engine step
    (an earlier estimate counted requests still waiting for their prefill: ~10,000 tok/s at the start), and
    ends at the replies' true total."""
    from tqdm import tqdm

    from qcg_gpu.llm.backends import TokenMeter, _completion

    engine, asked = vllm_backend.llm.llm_engine, conversations(2)
    meter = TokenMeter(tqdm(total=2, file=io.StringIO()), engine, every_s=0.0)
    vllm_backend.llm.enqueue_chat(asked, vllm_backend.sampling_params(SAMPLING, asked), use_tqdm=False)
    counts, replies = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                replies.append(_completion(out))
                meter.finish(replies[-1].output_tokens)
        counts.append((meter.tokens(), len(replies)))
    assert all(tokens <= 2 * step for step, (tokens, _) in enumerate(counts, 1))
    assert counts == sorted(counts) and max(tokens for tokens, done in counts if done == 0) > 0
    assert counts[-1] == (sum(reply.output_tokens for reply in replies), 2)
    meter.show()
    assert "output tokens" in meter.bar.postfix and "left" in meter.bar.postfix  # time left from tokens


def test_time_left_comes_from_tokens_not_replies():
    """26 replies in flight and none finished: a bar counting replies showed an hour left at 1 of 26."""
    from qcg_gpu.llm.backends import tokens_left

    assert tokens_left(26, 0, 0, 500, 1352) == 26 * 1352 - 500  # no reply finished: the cap bounds them
    assert tokens_left(21, 600, 5, 1000, 1352) == 21 * 120  # the finished replies' mean for each unfinished one
    assert tokens_left(3, 0, 0, 0, None) is None and tokens_left(1, 100, 1, 500, None) == 100


def test_time_left_before_any_reply_finishes_is_a_bound_of_minutes_not_hours():
    """The quickstart's 26 replies (cap 1,032 tokens each; the generation took 106.9 s, 2026-12-07, Zen 4):
    (seconds, output tokens) as its bar saw them before the first reply finished at 0:40. The bar said
    '~4:03:15 left' at 0:12 and '~15:24' at 0:16: the rate since the start counted the prompts' prefill.
    Now it says nothing for 3 s of writing, then at most 2-4x the time truly left."""
    from qcg_gpu.llm.backends import RATE_AFTER_S, seconds_left, tokens_left

    seen = [(12, 23), (14, 49), (15, 257), (16, 465), (17, 673), (18, 881), (19, 1089), (20, 1323), (21, 1557)]
    seen += [(22, 1765), (24, 2181), (26, 2571), (28, 2935), (30, 3247), (33, 3559), (36, 4105), (39, 4651)]
    first_written = seen[0]
    for elapsed, tokens in seen:
        left, truly_left = tokens_left(26, 0, 0, tokens, 1032), 106.9 - elapsed
        seconds = seconds_left(left, 0, tokens, elapsed, first_written)
        if elapsed < first_written[0] + RATE_AFTER_S:
            assert seconds is None, elapsed
        else:
            assert truly_left <= seconds <= 4 * truly_left, (elapsed, seconds, truly_left)
    assert seconds_left(tokens_left(26, 0, 0, 23, 1032), 0, 23, 12, None) is None  # the first tokens: no rate yet
    assert seconds_left(tokens_left(20, 2000, 6, 9000, 1032), 6, 11000, 80, first_written) == pytest.approx(
        20 * 2000 / 6 * 80 / 11000
    )


def test_time_left_is_not_nil_while_replies_are_in_flight():
    """The 26 replies of the quickstart's build (cap 1352), all in flight at once, one token each per
    step: the shortest finish first, so the running ones outgrew the finished ones' mean, and the bar
    said ~00:00 left from the first reply on, for 58 of the generation's 88 s. Now each estimate is
    between 0.6 and 4 times the tokens truly left, until the last 100 tokens (in time, the bar still
    says less than is left: fewer replies in flight write fewer tokens a second)."""
    from qcg_gpu.llm.backends import tokens_left

    lengths = [184, 236, 241, 242, 266, 284, 291, 292, 312, 319, 364, 423, 457]
    lengths += [466, 508, 512, 513, 529, 537, 546, 562, 565, 598, 692, 796, 1032]
    for step in range(min(lengths), max(lengths) - 100, 10):
        finished = [n for n in lengths if n <= step]
        running = [step] * (len(lengths) - len(finished))
        truly_left = sum(lengths) - sum(finished) - sum(running)
        estimate = tokens_left(len(running), sum(finished), len(finished), sum(running), 1352)
        assert 0.6 * truly_left <= estimate <= 4 * truly_left, (step, estimate, truly_left)
