"""Command-line options made from the config dataclasses (each field's help is its option's help),
and the pieces several subcommands share."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ..config import PRESETS, GenerationConfig, RayConfig, RetrievalConfig, read_config_file
from ..errors import QCGError
from ..models import DEFAULT_LLM, resolve_model

# the part of GenerationConfig that picks and runs an LLM (qcg answer and qcg eval reuse it)
LLM_OPTIONS = (
    "backend",
    "model",
    "base_url",
    "api_key_env",
    "concurrency",
    "max_retries",
    "request_timeout",
    "max_model_len",
    "enforce_eager",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefix_caching",
    "engine_args",
)
RETRIEVAL_PREFIX = "retrieval_"
NO_VERIFY_HELP = "skip checking the index files against their checksums when loading (saves a few seconds per GB)"


def add_options(parser, section, title: str, only=None, prefix: str = "", unset_default: bool = False) -> None:
    """One option per dataclass field; ``prefix`` keeps the dests of same-named fields apart;
    ``unset_default`` leaves options that were not given at None (so a preset or a stored
    generation can fill them)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if only and f.name not in only:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool or set(typing.get_args(kind)) == {bool, type(None)}:  # bool, bool | None
            group.add_argument(
                flag,
                dest=prefix + f.name,
                action=argparse.BooleanOptionalAction,
                default=None if unset_default else f.default,
                help=f.metadata["help"],
            )
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)  # X | None -> X
        group.add_argument(
            flag,
            dest=prefix + f.name,
            metavar=None if f.metadata.get("choices") else f.name.upper(),
            type=base,
            default=None if unset_default else f.default,
            choices=f.metadata.get("choices"),
            help=f.metadata["help"] + (f" (default: {f.default})" if f.default is not None else ""),
        )


def fill(section, args: argparse.Namespace, prefix: str = ""):
    """``section`` with the options given in ``args`` (None: not given, the section's value stays)."""
    for f in dataclasses.fields(section):
        if getattr(args, prefix + f.name, None) is not None:
            setattr(section, f.name, getattr(args, prefix + f.name))
    return section


def pop_config_file(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--config FILE, the other arguments): the option may stand anywhere on the command line."""
    for i, token in enumerate(argv):
        if token == "--config":
            if i + 1 >= len(argv):
                raise QCGError("--config needs a file")
            return argv[i + 1], argv[:i] + argv[i + 2 :]
        if token.startswith("--config="):
            return token.split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return None, argv


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """The file's settings become the defaults of every (sub)command that has their option, so an
    option given on the command line still wins."""
    defaults = {
        (RETRIEVAL_PREFIX if section == "retrieval" else "") + key: value
        for section, values in read_config_file(path).items()
        for key, value in values.items()
    }
    for sub in _all_parsers(parser):
        dests = {action.dest for action in sub._actions}
        sub.set_defaults(**{dest: value for dest, value in defaults.items() if dest in dests})


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _all_parsers(sub)


def add_output_options(parser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress bars or stage messages")
    parser.add_argument("--verbose", action="store_true", help="also show the LLM engine's own log (vLLM's INFO lines)")


def add_retrieval_options(parser, preset_help: str) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), help=preset_help)
    add_options(parser, RetrievalConfig(), "retrieval options", prefix=RETRIEVAL_PREFIX, unset_default=True)


def retrieval_config(args) -> RetrievalConfig:
    """The preset's settings, then the retrieval options given."""
    config = RetrievalConfig()
    for key, value in PRESETS.get(args.preset, {}).items() if args.preset else ():
        setattr(config, key, value)
    return fill(config, args, RETRIEVAL_PREFIX).validate()


def add_ray_options(parser) -> None:
    add_options(parser, RayConfig(), "Ray options (scale-out)")


def ray_cluster(args):
    """The Ray cluster of --ray (connected, or started locally), else None."""
    ray = fill(RayConfig(), args).validate()
    if not ray.ray:
        return None
    from ..distributed import RayCluster

    return RayCluster(ray)


def add_llm_options(parser, title: str = "answering LLM options") -> None:
    add_options(parser, GenerationConfig(), title, only=LLM_OPTIONS)


def answering_llm(args, cluster=None, model: str | None = None, store=None):
    """The answering (or, with ``model``, judging) LLM: in this process, or one engine per Ray worker.
    With a ``cache.ReplyStore``, its replies are kept there and it is loaded only when one is missing."""
    from ..cache import CachedLLM
    from ..llm import make_backend

    generation = fill(GenerationConfig(), args)
    generation.model = model or generation.model
    if generation.backend == "openai" and (not generation.base_url or not generation.model):
        raise QCGError("--backend openai needs --base-url and --model")

    def load():
        return cluster.llm(generation) if cluster else make_backend(generation)

    if store is None:
        return load()
    if generation.validate().backend == "vllm":
        resolve_model(generation.model, DEFAULT_LLM)  # a wrong path fails now, not after the retrieval
    return CachedLLM(generation, store, load)
