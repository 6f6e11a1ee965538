"""Where a model named by a folder or a hub id lives on this machine (`resolve_model_path`).

A module of its own, without torch or transformers, so that a command can refuse a folder that
is not a model before it imports the parts that load one (`saccade bench parity`: in seconds,
where the loaders' imports took 15).
"""

from __future__ import annotations

import os
from pathlib import Path


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id, downloaded (or found in the HF cache)."""
    path = Path(model)
    if path.exists():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: it is not a Hugging Face model folder")
        return path
    if str(model).startswith((".", "/")) or str(model).count("/") != 1:
        raise ValueError(f"model {str(model)!r} is neither an existing folder nor a hub id like 'Org/Model-Name'")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))
