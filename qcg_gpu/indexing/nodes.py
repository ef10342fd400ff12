"""Graph nodes and their texts, for each node-text mode of the paper's ablation.

``qa`` (default) ``q ⊕ a``; ``q`` question only; ``a`` answer only — all from
the kept pairs; ``sentence``: each sentence of each chunk, no LLM involved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def pair_text(question: str, answer: str) -> str:
    """q ⊕ a: query, a space, answer (METHOD.md)."""
    return f"{question} {answer}"


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: cut after . ! ? and at line breaks (a chat line is one utterance)."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


@dataclass
class Nodes:
    chunk_id: np.ndarray  # int64, source chunk of each node (E_inter)
    source_index: np.ndarray  # int64, pairs.parquet row for pair nodes, sentence number in its chunk otherwise
    text: list[str]
    from_pairs: bool = True  # source_index names pairs.parquet rows (False: sentence numbers)


def pair_nodes(
    mode: str, pair_rows: np.ndarray, chunk_id: np.ndarray, questions: list[str], answers: list[str]
) -> Nodes:
    """Nodes for the kept pairs ``pair_rows`` (rows of pairs.parquet), in that order."""
    pick = {
        "qa": lambda i: pair_text(questions[i], answers[i]),
        "q": lambda i: questions[i],
        "a": lambda i: answers[i],
    }[mode]
    return Nodes(chunk_id[pair_rows], pair_rows.astype(np.int64), [pick(i) for i in pair_rows])


def sentence_nodes(chunk_texts: list[str]) -> Nodes:
    chunk_ids, numbers, texts = [], [], []
    for cid, text in enumerate(chunk_texts):
        for number, sentence in enumerate(split_sentences(text)):
            chunk_ids.append(cid)
            numbers.append(number)
            texts.append(sentence)
    return Nodes(np.array(chunk_ids, dtype=np.int64), np.array(numbers, dtype=np.int64), texts, from_pairs=False)
