"""Model folders: a local path, or a built-in name built on first use.

Built-in models are built into ``<model_cache>/<name>`` through a temporary
folder that is renamed into place when complete, so a process that finds the
folder can trust it, and two processes building at once do no harm.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_MODELS = ("tiny", "tiny-moe", "tiny-swa", "tiny-mla", "smollm2", "gemma3-270m", "qwen2.5-coder-0.5b")
MODEL_CACHE = "~/.cache/pdserve/models"  # where built-in models are built (a cluster's model_cache)
MARKER = "pdserve_model.json"  # written last by engine.make_model


def is_builtin(model: str) -> bool:
    return model in BUILTIN_MODELS


def builtin_folder(model: str, cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser().resolve() / model


def needs_build(model: str, cache_dir: str | Path) -> bool:
    """True for a built-in model not built yet (the first launch converts it: minutes on a small CPU)."""
    return is_builtin(model) and not (builtin_folder(model, cache_dir) / MARKER).is_file()


def resolve_model(model: str, cache_dir: str | Path) -> Path:
    """The folder for ``model``, building a built-in one if it is not there yet."""
    if not is_builtin(model):
        folder = Path(model).expanduser().resolve()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"model folder {folder} does not exist (a model is a local folder, or one of "
                f"the built-in models {', '.join(BUILTIN_MODELS)})"
            )
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        return folder
    folder = builtin_folder(model, cache_dir)
    if (folder / MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model}-", dir=folder.parent))
    try:
        build_builtin(model, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / MARKER).is_file():  # not a concurrent builder's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def build_builtin(model: str, out: Path) -> None:
    from engine.make_model import (
        TINY_MLA,
        TINY_MOE,
        TINY_SWA,
        make_gemma3_270m,
        make_qwen_coder_05b,
        make_smollm2,
        make_tiny,
    )

    if model == "tiny":
        make_tiny(out)
    elif model == "tiny-moe":
        make_tiny(out, TINY_MOE)
    elif model == "tiny-swa":
        make_tiny(out, TINY_SWA)
    elif model == "tiny-mla":
        make_tiny(out, TINY_MLA)
    elif model == "smollm2":
        make_smollm2(out)
    elif model == "gemma3-270m":
        make_gemma3_270m(out)
    elif model == "qwen2.5-coder-0.5b":
        make_qwen_coder_05b(out)
    else:
        raise ValueError(f"unknown built-in model {model!r} (expected one of {BUILTIN_MODELS})")
