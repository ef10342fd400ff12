"""The package's shape (issue 30): imports point one way, and the top level stays small."""

from __future__ import annotations

import ast
import graphlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: list[str], modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{module}.{a.name}" for a in node.names} | {module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & modules


def test_no_import_cycle():
    files = sorted((ROOT / "qcg_gpu").rglob("*.py"))
    names = {path: _module_name(path) for path in files}
    modules = set(names.values())
    graph = {}
    for path, name in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        # a module importing its own package's __init__ (or a parent's) is not an edge back
        graph[name] = {m for m in _imports(path, package, modules) if m != name and not name.startswith(m + ".")}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_the_wheel_ships_every_module_and_data_file(tmp_path):
    """What ``pip install qcg-gpu`` gets: the editable install the tests run on finds any module, a wheel only
    those its setup names (a hand-kept package list once left ``qcg_gpu.config`` out, so nothing imported)."""
    source = tmp_path / "source"  # a copy, so that the build's own folders stay out of the checkout
    shutil.copytree(ROOT / "qcg_gpu", source / "qcg_gpu", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    wheel_dir = tmp_path / "wheel"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir)]
    subprocess.run([*pip, str(source)], check=True, capture_output=True)
    (wheel,) = wheel_dir.glob("*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("qcg_gpu/")}
    wanted = {str(p.relative_to(source)) for p in (source / "qcg_gpu").rglob("*") if p.is_file()}
    assert wanted - shipped == set()


def test_top_level_holds_at_most_twelve_modules():
    top = sorted(p.name for p in (ROOT / "qcg_gpu").glob("*.py"))
    assert len(top) <= 12, top


def test_public_names_resolve_from_the_package():
    import qcg_gpu

    for name in qcg_gpu.__all__:
        assert getattr(qcg_gpu, name) is not None, name


def test_no_function_takes_more_than_eight_parameters():
    """Kernels take named structures (qcg_gpu/kernels/structs.py) instead of a dozen positional arrays,
    so a swapped indptr/indices or hops/top_k cannot compile and run (issue 38 §1)."""
    wide = []
    for path in sorted((ROOT / "qcg_gpu").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                count = len(names) + bool(args.vararg) + bool(args.kwarg) - (names[:1] in (["self"], ["cls"]))
                if count > 8:
                    wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count})")
    assert wide == []


def test_settings_are_split_by_concern_with_at_most_twenty_fields():
    """Issue 38 §3: the [generation] table joins one dataclass per concern, each field in exactly one."""
    import dataclasses

    from qcg_gpu import config

    sections = [*config.CONFIG_SECTIONS.values(), *config.GENERATION_CONCERNS]
    wide = {s.__name__: len(dataclasses.fields(s)) for s in sections if s is not config.GenerationConfig}
    assert max(wide.values()) <= 20, wide
    concern_fields = [f.name for c in config.GENERATION_CONCERNS for f in dataclasses.fields(c)]
    assert sorted(concern_fields) == sorted(f.name for f in dataclasses.fields(config.GenerationConfig))
    assert len(set(concern_fields)) == len(concern_fields)
    assert set(config.ANSWERING_LLM_CONCERNS) < set(config.GENERATION_CONCERNS)


def test_the_development_page_names_every_module():
    """docs/development.md's layout table is where a newcomer looks for a module: a module added without
    a word there is found only by searching."""
    layout = (ROOT / "docs" / "development.md").read_text().split("## Tests")[0]
    named = {name.removesuffix(".py").split("/")[-1] for name in re.findall(r"`([\w/.]+)`", layout)}
    modules = [path for path in sorted((ROOT / "qcg_gpu").rglob("*.py")) if path.stem not in ("__init__", "__main__")]
    assert [str(path.relative_to(ROOT)) for path in modules if path.stem not in named] == []
