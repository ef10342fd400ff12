"""Config files: one TOML (or YAML) file with a table per settings section, the same fields as the
CLI options::

    [generation]
    model = "qwen2.5-coder-1.5b"

``qcg --config FILE ...`` and the Python API (``qcg_gpu.index_settings``) read one (``config.layered``
gives the order its settings take); ``qcg init`` writes one with every default.
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..errors import QCGError
from .layers import CONFIG_SECTIONS
from .utils import annotated_value


def read_config_file(path: str | os.PathLike) -> dict[str, dict]:
    """{section: {field: value}} from a TOML or YAML file, every name and type checked."""
    from pathlib import Path

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise QCGError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        if path.suffix == ".toml":
            data = _toml().loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise QCGError(f"config file {path}: name it .toml, .yaml or .yml")
    except QCGError:
        raise
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError: the parser's own message
        raise QCGError(f"config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise QCGError(f"config file {path}: expected a table per section ({', '.join(CONFIG_SECTIONS)})")
    for name, values in data.items():
        if name not in CONFIG_SECTIONS:
            raise QCGError(f"config file {path}: unknown section [{name}] (choose from {', '.join(CONFIG_SECTIONS)})")
        if not isinstance(values, dict):
            raise QCGError(f"config file {path}: [{name}] must be a table of options")
        fields = {f.name: f for f in dataclasses.fields(CONFIG_SECTIONS[name])}
        for key, value in values.items():
            if key not in fields:
                raise QCGError(f"config file {path}: unknown option {name}.{key}")
            try:
                annotated_value(value, str(fields[key].type))
            except ValueError:
                raise QCGError(f"config file {path}: {name}.{key} = {value!r}, expected {fields[key].type}") from None
            choices = fields[key].metadata.get("choices")
            if choices and value not in choices:
                raise QCGError(f"config file {path}: {name}.{key} = {value!r}, choose from {', '.join(choices)}")
    return data


def _toml():
    """tomllib (Python 3.11 on), else tomli, its backport (a dependency on Python 3.10)."""
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib
    return tomllib


def config_file_text() -> str:
    """A config file (TOML) with every option at its default and its help as a comment."""
    lines = [
        "# qcg-gpu settings: qcg --config qcg.toml ...",
        "# They override the defaults; a --preset or a stored generation's settings (--replies-in, an index's own for",
        "# qcg index add) override them, and options given on the command line override everything.",
    ]
    for name, section in CONFIG_SECTIONS.items():
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(section):
            lines.append(f"# {f.metadata['help']}")
            value = f.default
            lines.append(f"# {f.name} =" if value is None else f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings escape like JSON
    return repr(value)
