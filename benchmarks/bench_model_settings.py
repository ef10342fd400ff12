"""Which Doc2Query settings suit a packaged model: each variant builds the same index, one after another,
each in a fresh process (compact JSON is an engine setting), and prints one JSON line with what the
settings cost and gave: runaway replies (hit max_tokens), valid and kept pairs, chunks left with no
pair, output tokens per valid pair, and the generation's seconds.

    python benchmarks/bench_model_settings.py                                   # SmolLM2, the quickstart's 26 chunks
    python benchmarks/bench_model_settings.py --model qwen2.5-coder-1.5b \
        --docs ../shared/data/lihuaworld/docs --limit 12

A variant is "name:key=value,key=value" over [generation] fields (values in JSON); "model:" sets none, so
the model's own settings apply (models.PackagedModel.generation).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SAMPLE_DOCS = Path(__file__).resolve().parents[1] / "examples" / "lihuaworld_sample" / "docs"
VARIANTS = (
    "model:",
    "indented:compact_json=false,repetition_penalty=1.1",
    "compact:compact_json=true,repetition_penalty=1.1",
    "compact-rp1:compact_json=true,repetition_penalty=1.0",
)


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, fields = text.partition(":")
    settings = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        settings[key] = json.loads(value)
    return name, settings


def run_one(variant: str, args, work: Path) -> dict:
    """Build the index under one variant in this process, in ``work``, and describe its generation."""
    from qcg_gpu.capabilities import cpu_kind
    from qcg_gpu.config import IndexConfig
    from qcg_gpu.indexing.pipeline import build_index
    from qcg_gpu.log import quiet
    from qcg_gpu.models import llm_identity

    quiet()
    name, settings = parse_variant(variant)
    config = IndexConfig()
    config.generation.model, config.generation.m = args.model, args.m
    for key, value in settings.items():
        setattr(config.generation, key, value)
    config.generation.cache = str(work / "cache.sqlite")  # fresh: every chunk is generated
    docs = work / "docs"
    docs.mkdir()
    for path in sorted(args.docs.rglob("*.txt"))[: args.limit or None]:
        target = docs / path.relative_to(args.docs)  # the same document ids as the corpus's own
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    summary = build_index(docs, work / "index", config)
    return {
        "variant": name,
        "model": llm_identity(config.generation.model),
        "settings": {
            k: getattr(config.generation, k)
            for k in ("compact_json", "repetition_penalty", "max_pair_tokens", "max_tokens")
        },
        "chunks": summary.chunks,
        "m": args.m,
        "runaway_replies": summary.truncated_replies,
        "empty_chunks": len(summary.empty_chunks),
        "pairs_valid": summary.pairs_valid,
        "pairs_kept": summary.pairs_kept,
        "output_tokens": summary.generated_output_tokens,
        "tokens_per_valid_pair": round(summary.generated_output_tokens / max(summary.pairs_valid, 1), 1),
        "generate_s": round(summary.seconds["generate"], 1),
        "tokens_per_s": round(summary.generation_tokens_per_s, 1),
        "cpu": cpu_kind(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--docs", type=Path, default=SAMPLE_DOCS)
    parser.add_argument("--limit", type=int, default=0, help="documents to index (0 = all)")
    parser.add_argument("--m", type=int, default=10, help="pairs per chunk (the quickstart's 10)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this variant and print its line
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory(prefix="qcg-settings-") as work:
            print(json.dumps(run_one(args.one, args, Path(work))), flush=True)
        return
    passed = [a for a in sys.argv[1:] if a != "--variants" and a not in args.variants]
    for variant in args.variants:  # one LLM at a time: two engines on one machine slow each other
        result = subprocess.run(
            [sys.executable, __file__, *passed, "--one", variant], capture_output=True, text=True, check=False
        )
        if result.returncode:
            sys.exit(f"variant {variant} failed:\n{result.stderr[-3000:]}")
        print(result.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
