"""The one order settings take, and the sections a config file may hold."""

from __future__ import annotations

import dataclasses

from ..errors import QCGError
from .answer import AnswerConfig
from .eval import EvalConfig
from .generation import AnsweringLLMConfig, GenerationConfig
from .index import ChunkingConfig, GraphConfig, NodeConfig
from .ray import RayConfig
from .retrieval import RetrievalConfig
from .utils import check_fields

# --- the order of settings ------------------------------------------------------------------
# A config file (files.py) has a table per section, named here.

CONFIG_SECTIONS = {
    "chunking": ChunkingConfig,
    "generation": GenerationConfig,
    "nodes": NodeConfig,
    "graph": GraphConfig,
    "retrieval": RetrievalConfig,
    "answer": AnswerConfig,
    "answer_llm": AnsweringLLMConfig,
    "eval": EvalConfig,
    "ray": RayConfig,
}


def layered(section, from_file: dict | None = None, over: dict | None = None, given: dict | None = None):
    """``section`` (a settings dataclass at its defaults) with its settings in the one order they take
    for every command and for the Python API, each layer overriding the one before:

    1. the defaults (the dataclass);
    2. ``from_file``: a config file's table for this section;
    3. ``over``: a preset, or the settings a stored generation or the index itself was made with;
    4. ``given``: the options on the command line, or a caller's arguments (None: not given).

    So a file written by ``qcg init`` (every default) changes nothing by itself, and a preset or a
    stored generation is never undone by a file."""
    names = {f.name for f in dataclasses.fields(section)}
    for layer in (from_file, over, given):
        for key, value in (layer or {}).items():
            if key not in names:
                raise QCGError(f"unknown {type(section).__name__} setting {key!r}")
            if value is not None or layer is not given:
                setattr(section, key, value)
    check_fields(section)
    return section
