"""pagedkv: a paged KV-cache memory system for LLM inference.

``from pagedkv import LLM, SamplingParams`` loads lazily, so ``import pagedkv.core`` stays free of
torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedkv.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedkv.engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedkv.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
