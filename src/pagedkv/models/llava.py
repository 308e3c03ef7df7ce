"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and a
Llama-family language model over the paged KV cache.

An image enters the prompt as ``image_seq_length`` copies of the image token (the processor's
expansion, done by the engine: `engine.multimodal`); the tower encodes the image's pixels
into one embedding per patch (the ``vision_feature_layer``'s hidden states, the CLS position
dropped under the "default" strategy), the projector maps them to the language model's width,
and they replace the image tokens' embeddings. Everything after the embedding is the language
model's paged forward, so prefix caching, chunked prefill and every cache mode apply unchanged
(the image's content hash enters the block hashes: `core.request.MultiModalFeature`).

The tower is transformers' own CLIP vision transformer (a well-kept implementation of a
standard ViT; it holds no KV cache), loaded from the checkpoint's ``vision_tower.*`` weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedkv.models.config import ModelConfig
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.ops.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]

_ACTIVATIONS = {"gelu": nn.GELU, "quick_gelu": None, "relu": nn.ReLU, "silu": nn.SiLU}


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision features → language model embeddings."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        if _ACTIVATIONS.get(act) is None:
            raise ValueError(f"LLaVA projector activation {act!r} is not supported")
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = _ACTIVATIONS[act]()
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    """See the module docstring. ``forward`` is the language model's, plus ``inputs_embeds``
    (``[T, hidden]``: the step's token embeddings with image rows already placed);
    ``encode_images(pixel_values [N, C, H, W]) -> [N, image_seq_length, hidden]``."""

    supports_kv_eviction = False  # not measured with images; refused with a clear error
    supports_tensor_parallel = False

    def __init__(self, config: ModelConfig, kv_quants: Any = None, parallel: Any = None) -> None:
        super().__init__()
        try:
            from transformers import CLIPVisionConfig, CLIPVisionModel
        except ImportError:
            raise ValueError(
                "LLaVA's vision tower needs transformers: pip install 'pagedkv[vision]'"
            ) from None

        v = config.vision or {}
        self.config = config
        self.language_model = LlamaForCausalLM(config, kv_quants)
        vision = CLIPVisionConfig(
            **{k: x for k, x in v["vision_config"].items() if k != "model_type"}
        )
        vision._attn_implementation = "eager"  # the reference's; sdpa differs in the last bits
        self.vision_tower = CLIPVisionModel(vision)
        self.multi_modal_projector = LlavaProjector(
            vision.hidden_size,
            config.hidden_size,
            v.get("projector_hidden_act", "gelu"),
            bool(v.get("multimodal_projector_bias", True)),
        )
        self.image_token_id: int = int(v.get("image_token_index", v.get("image_token_id", 32000)))
        layer = v.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: one layer is supported")
        self.feature_layer = layer
        self.select_strategy = v.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r}")
        patches = (vision.image_size // vision.patch_size) ** 2
        self.image_seq_length = patches + (self.select_strategy == "full")
        self.image_size = vision.image_size

    # ---- the engine's interface (as LlamaForCausalLM's) ---------------------------------------

    @property
    def model(self) -> nn.Module:
        """The language model's decoder stack (its ``embed_tokens``, ``rotary_emb``)."""
        return self.language_model.model

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True, return_dict=True)
        feats = out.hidden_states[self.feature_layer]
        if self.select_strategy == "default":
            feats = feats[:, 1:]
        return self.multi_modal_projector(feats)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata | list[AttentionMetadata],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model.model(
            input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def param_names(self) -> set[str]:
        return {n for n, _ in self.named_parameters(remove_duplicate=False)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names (both transformers spellings: ``language_model.model.*`` /
        ``model.language_model.*``, ``vision_tower[.vision_model].*``) → this module's."""
        lm: list[tuple[str, torch.Tensor]] = []
        own: dict[str, torch.Tensor] = {}
        for name, w in weights:
            name = name.removeprefix("model.")
            if name.startswith("language_model."):
                rest = name.removeprefix("language_model.")
                lm.append((rest if rest.startswith(("model.", "lm_head.")) else f"model.{rest}", w))
            elif name == "lm_head.weight":
                lm.append((name, w))
            elif name.startswith("vision_tower."):
                rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
                own[f"vision_tower.{rest}"] = w
            elif name.startswith("multi_modal_projector."):
                own[name] = w
            else:
                raise ValueError(f"unexpected LLaVA weight {name!r}")
        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(lm)}
        params = dict(self.named_parameters())
        for name, w in own.items():
            if name not in params:
                if name.endswith("position_ids"):
                    continue
                raise ValueError(f"unexpected LLaVA weight {name!r}")
            with torch.no_grad():
                params[name].copy_(w)
            loaded.add(name)
        return loaded
