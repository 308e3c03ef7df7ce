"""Which model class runs which architecture, and the interface every model class offers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from pagedkv.models.bamba import BambaForCausalLM
from pagedkv.models.config import ModelConfig
from pagedkv.models.deepseek_v2 import DeepseekV2ForCausalLM
from pagedkv.models.gemma2 import Gemma2ForCausalLM
from pagedkv.models.gemma4 import Gemma4ForCausalLM
from pagedkv.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.llama4 import Llama4ForCausalLM
from pagedkv.models.llava import LlavaForConditionalGeneration
from pagedkv.models.nemotron_nas import DeciLMForCausalLM
from pagedkv.ops.metadata import AttentionMetadata


class CausalLM(Protocol):
    """What the engine calls: a flat token batch in, hidden states out, logits on demand."""

    config: ModelConfig

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def param_names(self) -> set[str]: ...


# Keys are GGUF general.architecture / HF model_type values (lower case).
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # Llama + sliding window (from the config)
    "qwen2": LlamaForCausalLM,  # Llama + q/k/v bias (config.attention_bias)
    "deepseek_v2": DeepseekV2ForCausalLM,  # MLA latent cache, DeepSeekMoE (config.mla)
    "deepseek_v3": DeepseekV2ForCausalLM,  # V2 + sigmoid grouped router, interleaved-pair RoPE
    "gemma2": Gemma2ForCausalLM,  # sliding/global layers, soft caps (its own layers, Llama loading)
    "gemma3_text": Gemma2ForCausalLM,  # Gemma 2 + q/k norms, local rope theta (config.qk_norm)
    "gemma4_text": Gemma4ForCausalLM,  # per-layer head geometry, k=v, partial RoPE, PLE, KV sharing (config.gemma4)
    "bamba": BambaForCausalLM,  # Mamba-2 mixers + attention layers, states in MambaSpec pages (config.mamba)
    "granitemoehybrid": GraniteMoeHybridForCausalLM,  # Bamba's mixer in a Granite decoder (config.granite)
    "llama4_text": Llama4ForCausalLM,  # chunked local + NoPE global layers, MoE (config.llama4)
    "llava": LlavaForConditionalGeneration,  # CLIP tower + projector + Llama LM (config.vision)
    "nemotron-nas": DeciLMForCausalLM,  # per-layer KV heads / MLP width, no-op and linear blocks (config.deci)
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The model class for ``architecture``; ``ValueError`` listing the supported ones otherwise."""
    cls = _MODELS.get(architecture.lower())
    if cls is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(_MODELS)}")
    return cls


def tensor_parallel_architectures() -> list[str]:
    """Architectures whose model class splits across tensor-parallel ranks."""
    return sorted(
        a for a, c in _MODELS.items() if c.__dict__.get("supports_tensor_parallel", False)
    )


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
