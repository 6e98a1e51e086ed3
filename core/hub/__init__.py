"""Models named by hub id ("Qwen/Qwen3-0.6B"): resolved to a local snapshot folder.

An existing folder is used as it is. Anything else that looks like ``org/name`` goes to
``huggingface_hub.snapshot_download``: downloaded when online, read from the local cache
(``HF_HUB_CACHE``) under ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hookllm.config import EngineConfig

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def is_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository (``org/name``, and no such local path)."""
    return not Path(model).exists() and bool(HUB_ID.match(model))


def short_model_name(model: str) -> str:
    """A name for ``model`` as the user gave it that shows nothing of the local file system:
    a hub id as it is, else the folder's own name (the default model's is ``SmolLM2-135M-Instruct``)."""
    return model if is_hub_id(model) else Path(model).resolve().name


def resolve_model_path(model: str) -> str:
    """A local folder for ``model``: the folder itself, or the hub id's snapshot. One-line
    ``ValueError`` when it is neither a folder nor an available hub id."""
    if not is_hub_id(model):
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    # Read the cache location now (huggingface_hub reads the variable once, when imported).
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return snapshot_download(model, cache_dir=cache_dir, local_files_only=offline)
    except LocalEntryNotFoundError:
        raise ValueError(f"model {model!r} is neither a local folder nor in the hub cache "
                         f"({cache_dir or constants.HF_HUB_CACHE}), and downloading is off (HF_HUB_OFFLINE=1)"
                         if offline else f"model {model!r}: could not download it from the hub, "
                         "and it is not in the local cache") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {model!r} is neither a local folder nor a hub repository") from None


def with_local_paths(config: EngineConfig) -> EngineConfig:
    """``config`` with its model, tokenizer and draft model hub ids resolved to local folders."""
    speculative = config.speculative_config
    if speculative is not None and speculative.model:
        speculative = dataclasses.replace(speculative, model=resolve_model_path(speculative.model))
    return dataclasses.replace(config, model=resolve_model_path(config.model),
                               tokenizer=resolve_model_path(config.tokenizer) if config.tokenizer else None,
                               speculative_config=speculative)
