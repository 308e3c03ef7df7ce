"""HF model directories: ``config.json`` + ``*.safetensors`` + ``tokenizer.json``.

Weights are read with ``safetensors.safe_open`` (memory-mapped, one tensor at a time) and
yielded under their checkpoint names, which are the HF names ``load_weights`` expects.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def is_hf_dir(path: str | Path) -> bool:
    """True for a directory holding ``config.json`` and at least one ``*.safetensors`` file."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").exists() and any(p.glob("*.safetensors"))


def iter_safetensors_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``path``.

    Raises ``FileNotFoundError`` when there is none (``.bin`` pickles are not loaded: unsafe).
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)
