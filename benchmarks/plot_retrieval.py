"""Plot ``bench_retrieval.py``'s JSON rows: queries/s against N, one line per backend and batch,
with the library route for reference.

    python benchmarks/plot_retrieval.py benchmarks/out/bench_retrieval.json docs/img/retrieval_qps.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", type=Path, help="bench_retrieval.py --out file")
    parser.add_argument("png", type=Path)
    args = parser.parse_args()
    rows = json.loads(args.rows.read_text())
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        for label in dict.fromkeys(f"{r['backend']}, {r['gemm']}" for r in mine):
            line = sorted((r for r in mine if f"{r['backend']}, {r['gemm']}" == label), key=lambda r: r["nodes"])
            ax.plot([r["nodes"] for r in line], [r["queries_per_s"] for r in line], "o-", label=f"qcg-gpu {label}")
        library: dict[int, list[float]] = {}
        for r in mine:
            library.setdefault(r["nodes"], []).append(r["library_queries_per_s"])
        nodes = sorted(library)
        ax.plot(nodes, [max(library[n]) for n in nodes], "k--", label=f"library route ({mine[0]['library']} + numpy)")
        ax.set(xscale="log", yscale="log", xlabel="nodes N", title=f"B = {batch:,} queries")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("queries / s")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"Batched retrieval, {rows[0]['cpu']}", fontsize=9)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
