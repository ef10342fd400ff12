"""Real embeddings for the retrieval benchmarks, made offline: every LiHuaWorld chat line and the
docstring paragraphs of installed Python packages (torch, transformers, scipy, ...), up to
``--count`` texts (cut at 240 characters, shuffled), embedded by the bundled all-MiniLM-L6-v2 (in
bf16 where the CPU has AMX, else float32). Their similarities have the spectrum and spread of real
text, which the synthetic clusters of ``qcg_gpu.eval.bench`` do not (issue 18: how wide are the
prefilters' candidate windows on them?).

    python benchmarks/real_embeddings.py --count 110000 --out benchmarks/out/real.npy   # ~3 min on 2 cores
    python benchmarks/bench_retrieval.py --embeddings benchmarks/out/real.npy --nodes 100000 --batch 10000

The texts depend on the installed packages' versions; the file records nothing else.
"""

from __future__ import annotations

import argparse
import ast
import random
import re
from pathlib import Path

import numpy as np

from qcg_gpu.capabilities import cpu_has_amx
from qcg_gpu.embedding import Embedder

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lihuaworld" / "docs"
PACKAGES = ("torch", "transformers", "scipy", "numpy", "vllm", "sklearn", "pandas", "pyarrow", "ray", "sympy")
MAX_CHARS = 240


def chat_lines(root: Path) -> list[str]:
    lines = (line.strip() for f in sorted(root.rglob("*.txt")) for line in f.read_text(errors="ignore").splitlines())
    return [line[:MAX_CHARS] for line in lines if len(line) > 30]


def docstring_paragraphs(package: Path) -> list[str]:
    out = []
    for f in sorted(package.rglob("*.py")):
        try:
            tree = ast.parse(f.read_text(errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                for para in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                    para = " ".join(para.split())
                    if len(para) > 40 and not para.startswith((">>>", "..", "Args", "Returns", "Parameters")):
                        out.append(para[:MAX_CHARS])
    return out


def real_texts(count: int) -> list[str]:
    texts = list(dict.fromkeys(chat_lines(DATA)))
    site = Path(np.__file__).parents[1]
    for name in PACKAGES:
        if len(texts) >= count:
            break
        if (site / name).is_dir():
            texts = list(dict.fromkeys(texts + docstring_paragraphs(site / name)))
    random.Random(0).shuffle(texts)
    return texts[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=110_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "real.npy")
    args = parser.parse_args()
    import torch

    texts = real_texts(args.count)
    embedder = Embedder(batch_size=128)
    if cpu_has_amx():  # 2x faster there; the benchmark needs real spread, not the last bit
        embedder.model.to(torch.bfloat16)  # elsewhere bf16 is far slower: 72 s per batch on an EPYC Zen 3
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, embedder.encode(texts, "real texts").astype(np.float32))
    print(f"{len(texts)} texts -> {args.out}")


if __name__ == "__main__":
    main()
