"""Every setting of qcg-gpu, one dataclass per concern, a module per part of the engine (like vLLM's
``config/``): the index build (``index``: chunking, nodes, graph; ``generation``: the LLM stage's
concerns, and the answering LLM's), ``retrieval``, ``answer``, ``eval`` and the Ray cluster (``ray``);
``layers`` gives the one order settings take, ``files`` reads and writes config files.

Each field's ``help`` is written once and reused as CLI help (``qcg index --help``). Each field
also says whether it changes results: ``runtime=True`` marks the ones that only say how to run
(which server or device, the cache file, batch sizes). That one mark decides what a stored
generation records about itself, what ``--add`` must match, and what the generation cache key may
ignore (a test checks the key against it). Defaults follow ../shared/METHOD.md (the paper). Every
``validate()`` raises QCGError on a bad value and returns the config.
"""

from .answer import AnswerConfig
from .eval import ABLATIONS, BASELINES, EVAL_METHODS, INDEX_PARAMETERS, SWEEPS, EvalConfig
from .generation import (
    ANSWERING_LLM_CONCERNS,
    GENERATION_CONCERNS,
    MODEL_DECIDED,
    AnsweringLLMConfig,
    Doc2QueryConfig,
    GenerationConfig,
    LLMConfig,
    OpenAIClientConfig,
    ReplyStoreConfig,
    VLLMEngineConfig,
)
from .index import (
    BEFORE_OPTION,
    MACHINE_PATHS,
    NODE_MODES,
    REPLY_SECTIONS,
    ChunkingConfig,
    GraphConfig,
    IndexConfig,
    NodeConfig,
)
from .layers import CONFIG_SECTIONS, layered
from .ray import RayConfig
from .retrieval import PRESETS, RetrievalConfig
from .utils import check_fields, option, prompt_text, result_fields

__all__ = [
    "ABLATIONS",
    "ANSWERING_LLM_CONCERNS",
    "BASELINES",
    "BEFORE_OPTION",
    "CONFIG_SECTIONS",
    "EVAL_METHODS",
    "GENERATION_CONCERNS",
    "INDEX_PARAMETERS",
    "MACHINE_PATHS",
    "MODEL_DECIDED",
    "NODE_MODES",
    "PRESETS",
    "REPLY_SECTIONS",
    "SWEEPS",
    "AnswerConfig",
    "AnsweringLLMConfig",
    "ChunkingConfig",
    "Doc2QueryConfig",
    "EvalConfig",
    "GenerationConfig",
    "GraphConfig",
    "IndexConfig",
    "LLMConfig",
    "NodeConfig",
    "OpenAIClientConfig",
    "RayConfig",
    "ReplyStoreConfig",
    "RetrievalConfig",
    "VLLMEngineConfig",
    "check_fields",
    "layered",
    "option",
    "prompt_text",
    "result_fields",
]
