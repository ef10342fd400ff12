"""What every settings dataclass is made of: fields whose help is also CLI help, and checks."""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import field
from pathlib import Path

from ..errors import QCGError


def option(default, help: str, choices=None, flag: str | None = None, runtime: bool = False):
    """A dataclass field whose help text is also its CLI help (``flag``: a CLI name other than
    --field-name); ``runtime``: it says how to run, never what the results are."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "runtime": runtime})


def option_flag(f: dataclasses.Field) -> str:
    """The command-line option of a settings field: its own ``flag``, else --field-name."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def setting_name(section, name: str) -> str:
    """A setting as an error names it: its command-line option, then its name in config files and the API."""
    (f,) = (f for f in dataclasses.fields(section) if f.name == name)
    return f"{option_flag(f)} ({name})"


def check_at_least(section, low, *names: str) -> None:
    """QCGError naming the first of the settings ``names`` that is set (not None) and below ``low``."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise QCGError(f"{setting_name(section, name)} must be >= {low}, got {value}")


def check_fields(section) -> None:
    """QCGError when a field holds a value its annotation does not allow (``top_k="3"`` or ``hops=1.5``
    from an API call) or one outside its choices; numpy numbers become Python ones (settings go into JSON)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        try:
            setattr(section, f.name, annotated_value(value, str(f.type)))
        except ValueError:
            raise QCGError(f"{setting_name(section, f.name)} must be {f.type}, got {value!r}") from None
        if f.metadata.get("choices") and value not in f.metadata["choices"]:
            raise QCGError(
                f"{setting_name(section, f.name)} must be one of {', '.join(f.metadata['choices'])}, got {value!r}"
            )


def annotated_value(value, annotation: str):
    """``value`` as a field annotated ``annotation`` (e.g. "int | None") holds it, numpy's integers and floats
    as Python's (a Python int stays an int in a float field); ValueError when it does not fit."""
    kinds = {part.strip() for part in annotation.split("|")}
    if value is None and "None" in kinds or isinstance(value, str) and "str" in kinds:
        return value
    if isinstance(value, bool):  # before int: bool is an int to Python, never a count here
        if "bool" in kinds:
            return value
    elif isinstance(value, numbers.Integral) and kinds & {"int", "float"}:
        return value if type(value) is int else int(value)
    elif isinstance(value, numbers.Real) and "float" in kinds:
        return value if isinstance(value, float) else float(value)
    raise ValueError(f"{value!r} is not {annotation}")


def result_fields(section) -> list[str]:
    """The fields of a config dataclass (or instance) that change results."""
    return [f.name for f in dataclasses.fields(section) if not f.metadata.get("runtime")]


def prompt_text(path: str) -> str:
    """The system prompt held in a --prompt-file / --answer-prompt-file."""
    try:
        with open(path, encoding="utf-8-sig") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise QCGError(f"cannot read prompt file {path}: {exc}") from exc
    if not text:
        raise QCGError(f"prompt file {path} is empty")
    return text


def comma_names(text: str, allowed, what: str) -> list[str]:
    """The distinct names of a comma-separated ``text``, each one of ``allowed`` (else QCGError naming ``what``)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise QCGError(f"unknown {what} {unknown or text!r}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def check_output_file(path: str | os.PathLike | None, option: str = "--out", folders_made: bool = False) -> None:
    """Refuse an output file (``option``) that could not be written, before any work: a folder, a file as
    its folder, no write permission, or a missing folder (unless its writer makes the ``folders_made``)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise QCGError(f"{option} {path} is a folder: name a file")
    folder = path.parent
    while folders_made and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise QCGError(f"{option} {path}: {folder} {problem}")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise QCGError(f"{option} {path}: not writable")
