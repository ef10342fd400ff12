"""Command-line options made from the config dataclasses (each field's help is its option's help),
and the pieces several subcommands share."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ..config import (
    ANSWERING_LLM_CONCERNS,
    CONFIG_SECTIONS,
    GENERATION_CONCERNS,
    PRESETS,
    AnsweringLLMConfig,
    RayConfig,
    RetrievalConfig,
    layered,
)
from ..config.utils import option_flag
from ..errors import QCGError
from ..log import logger
from ..models import DEFAULT_LLM, resolve_model

RETRIEVAL_PREFIX = "retrieval_"
ANSWERING_FIELDS = dataclasses.fields(AnsweringLLMConfig)
SECTION_NAMES = {cls: name for name, cls in CONFIG_SECTIONS.items()}  # a config file's table per dataclass
NO_VERIFY_HELP = "skip checking the index files against their checksums when loading (saves a few seconds per GB)"


def add_options(parser, section, title: str, only=None, prefix: str = "") -> None:
    """One option per dataclass field; ``prefix`` keeps the dests of same-named fields apart. An option
    not given stays None, so :func:`resolve` can tell it from a default, a config file or a preset."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if only and f.name not in only:
            continue
        flag = option_flag(f)
        kind = hints[f.name]
        default_help = f" (default: {f.default})" if f.default is not None else ""
        help_text = (f.metadata["help"] + default_help).replace("%", "%%")  # argparse %-formats help texts
        if kind is bool or set(typing.get_args(kind)) == {bool, type(None)}:  # bool, bool | None
            group.add_argument(
                flag,
                dest=prefix + f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)  # X | None -> X
        group.add_argument(
            flag,
            dest=prefix + f.name,
            metavar=None if f.metadata.get("choices") else f.name.upper(),
            type=base,
            default=None,
            choices=f.metadata.get("choices"),
            help=help_text,
        )


def resolve(section, args: argparse.Namespace, prefix: str = "", over: dict | None = None):
    """``section`` (a config dataclass at its defaults) with its settings in the one order they take
    (:func:`config.layered`): defaults < the ``--config`` file's table for this section < ``over`` (a
    ``--preset``, or the settings a stored generation or the index itself was made with) < the options
    given on the command line."""
    from_file = args_config_file(args).get(SECTION_NAMES.get(type(section), ""), {})
    given = {f.name: getattr(args, prefix + f.name, None) for f in dataclasses.fields(section)}
    return layered(section, from_file, over, given)


def args_config_file(args: argparse.Namespace) -> dict[str, dict]:
    """The settings of the ``--config`` file the command line named ({} without one)."""
    return getattr(args, "config_file_settings", None) or {}


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


def add_output_options(parser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress bars or stage messages")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show the LLM engine's own log (vLLM's INFO lines) and torch's C++ notices",
    )


def add_retrieval_options(parser, preset_help: str) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), help=preset_help)
    add_options(parser, RetrievalConfig(), "retrieval options", prefix=RETRIEVAL_PREFIX)


def retrieval_config(args) -> RetrievalConfig:
    """Defaults < config file < --preset < the retrieval options given."""
    preset = PRESETS[args.preset] if args.preset else None
    return resolve(RetrievalConfig(), args, RETRIEVAL_PREFIX, over=preset).validate()


def add_ray_options(parser) -> None:
    add_options(parser, RayConfig(), "Ray options (scale-out)")


def ray_config(args) -> RayConfig:
    return resolve(RayConfig(), args).validate()


def ray_cluster(args):
    """The Ray cluster of --ray (connected, or started locally), else None."""
    ray = ray_config(args)
    if not ray.ray:
        return None
    from ..cluster import RayCluster

    return RayCluster(ray)


def add_llm_options(parser) -> None:
    """The answering LLM's options: one group per concern (which LLM, the vLLM engine, the OpenAI client)."""
    for concern in ANSWERING_LLM_CONCERNS:
        add_options(parser, concern(), "answering LLM, " + concern_title(concern))


def add_generation_options(parser) -> None:
    """The build's [generation] options: one group per concern of GenerationConfig."""
    for concern in GENERATION_CONCERNS:
        add_options(parser, concern(), "generation options, " + concern_title(concern))


def concern_title(concern) -> str:
    """A settings dataclass's option-group title: the first line of its docstring."""
    first = (concern.__doc__ or concern.__name__).strip().split("\n")[0].rstrip(".")
    capitals_inside = any(c.isupper() for c in first.split()[0][1:])  # "Doc2Query", "LLM" keep their case
    return first if capitals_inside else first[0].lower() + first[1:]


def answering_llm(args, cluster=None, model: str | None = None, store=None):
    """The answering (or, with ``model``, judging) LLM: in this process, or one engine per Ray worker.
    With a ``cache.ReplyStore``, its replies are kept there and it is loaded only when one is missing."""
    from ..llm.backends import make_backend
    from ..llm.cache import CachedLLM

    generation = resolve(AnsweringLLMConfig(), args).as_generation()  # [answer_llm], never [generation]
    from_file = args_config_file(args)
    if "answer_llm" not in from_file and set(from_file.get("generation", {})) & {f.name for f in ANSWERING_FIELDS}:
        logger.warning("the config file's [generation] table is the build's: the answering LLM reads [answer_llm]")
    generation.model = model or generation.model
    generation.validate()  # a server's URL and model, retries and timeout, checked before any query is embedded

    def load():
        if cluster is None:
            return make_backend(generation)
        from ..indexing.distributed import ray_llm

        return ray_llm(cluster, generation)

    if store is None:
        return load()
    if generation.backend == "vllm":
        resolve_model(generation.model, DEFAULT_LLM)  # a wrong path fails now, not after the retrieval
    return CachedLLM(generation, store, load)
