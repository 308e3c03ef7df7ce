"""``get_model``: a model name or path in, a ready model + config + tokenizer out.

Accepted ``model`` values: ``None`` (the default SmolLM2-135M-Instruct GGUF), a ``*.gguf`` file,
a directory with ``config.json`` + ``*.safetensors`` (HF layout), or a directory holding exactly
one ``*.gguf``. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.distributed.parallel_state import ParallelContext
from pagedkv.models.config import ModelConfig, default_model_path, load_model_config
from pagedkv.models.gguf_loader import (
    gguf_tokenizer,
    iter_gguf_quantized,
    iter_gguf_weights,
    read_gguf,
)
from pagedkv.models.hf_loader import is_hf_dir, iter_safetensors_weights
from pagedkv.models.registry import CausalLM, get_model_class, tensor_parallel_architectures
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.models.tp_sharding import local_model_config
from pagedkv.ops import native
from pagedkv.ops.kv_quant import LayerKVQuants

log = logging.getLogger(__name__)

# Given the checkpoint's config and the resolved dtype, the KV formats of the model's attention
# layers (the engine's: from the KV cache specs it will allocate).
KVQuantsFor = Callable[[ModelConfig, torch.dtype], LayerKVQuants]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


@dataclass(slots=True)
class LoadedModel:
    """A model ready for ``forward``, its architecture config and its tokenizer (None only for
    an HF directory without ``tokenizer.json``, e.g. a tiny random-weight test model)."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    source: Path  # the .gguf file or HF directory the weights came from
    load_seconds: float
    # fp8 KV scales the checkpoint carries (``model.layers.N.self_attn.k_scale`` / ``v_scale``
    # / a shared ``kv_scale``): attention layer name → (k_scale, v_scale).
    kv_scales: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


def model_identity(path: str | Path) -> str:
    """Names the weights, not just the architecture: file name, size and a digest of the first
    4 MiB (cheap, and different for every real checkpoint)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        parts = [f"{f.name}:{f.stat().st_size}" for f in files]
        return f"{p.name}|" + ",".join(parts)
    with open(p, "rb") as f:
        head = hashlib.sha256(f.read(4 << 20)).hexdigest()[:16]
    return f"{p.name}|{p.stat().st_size}|{head}"


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig | None = None) -> torch.dtype:
    """A torch dtype from a dtype or its name; "auto" is the checkpoint's declared float dtype
    when it has one (HF ``torch_dtype``), else float32 (GGUF weights are dequantized to it)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return _DTYPES.get((config.dtype if config else None) or "float32", torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def resolve_model_path(model: str | Path | None) -> Path:
    """The ``.gguf`` file or HF directory ``model`` names (see module docstring)."""
    if model is None:
        return default_model_path()
    p = Path(model).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir():
        if (p / "config.json").exists():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise FileNotFoundError(
        f"{model!r} is not a .gguf file, an HF model directory or a directory with one .gguf"
    )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are allocated directly in ``dtype`` (no float32 detour)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    model: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    kv_quants: KVQuantsFor | None = None,
    parallel: ParallelContext | None = None,
    gguf_activations: str = "float32",
) -> LoadedModel:
    """Load weights, config and tokenizer. Raises ``ValueError`` if the checkpoint leaves any
    parameter unwritten (or has one the model lacks), so a half-loaded model never runs.
    ``gguf_activations``: ``"q8"`` turns on the GGUF q8 mode (``EngineConfig.gguf_activations``;
    ValueError for a model that is not a GGUF file; a warning where it cannot apply: no native
    kernels, not on CPU, an architecture without ggml rows).
    ``parallel``: build and load only one tensor-parallel rank's share (ValueError for an
    architecture without tensor parallelism); ``LoadedModel.config`` stays the whole model's.
    ``kv_quants``: called with the config and dtype before the model is built, it gives the
    quantized/rotated KV formats its attention layers are built with (None: plain caches)."""
    start = time.perf_counter()
    path = resolve_model_path(model)
    if gguf_activations not in ("float32", "q8"):
        raise ValueError(f"gguf_activations must be 'float32' or 'q8', got {gguf_activations!r}")
    if gguf_activations == "q8" and path.suffix.lower() != ".gguf":
        raise ValueError(
            f"gguf_activations='q8' quantizes the activations of a GGUF model's ggml rows; "
            f"{path} is not a .gguf file"
        )
    config = load_model_config(path)
    torch_dtype = resolve_dtype(dtype, config)
    tokenizer: Tokenizer | None
    kv_scales: dict[str, dict[str, float]] = {}
    if path.suffix.lower() == ".gguf":
        gguf = read_gguf(path)
        tokenizer = gguf_tokenizer(gguf)
        weights = iter_gguf_weights(gguf)
    elif is_hf_dir(path):
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
        weights = _split_kv_scales(iter_safetensors_weights(path), kv_scales := {})
    else:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    cls = get_model_class(config.architecture)
    extra: dict[str, object] = {}
    local = config
    if parallel is not None:
        if not cls.__dict__.get("supports_tensor_parallel", False):
            raise ValueError(
                f"tensor_parallel_size > 1 is not supported for architecture "
                f"{config.architecture!r} (supported: {tensor_parallel_architectures()})"
            )
        extra["parallel"] = parallel
        local = local_model_config(config, parallel.layout)
    layer_quants = kv_quants(local, torch_dtype) if kv_quants is not None else None
    with _default_dtype(torch_dtype), torch.device(device):
        net = cls(config, kv_quants=layer_quants, **extra)
    missing = net.param_names() - net.load_weights(weights)
    if missing:
        raise ValueError(
            f"{path}: checkpoint did not provide {sorted(missing)[:8]} ({len(missing)} missing)"
        )
    if (
        path.suffix.lower() == ".gguf"
        and torch.device(device).type == "cpu"
        and hasattr(net, "load_quantized")
        and native.available()
    ):
        # Small-batch steps stream the file's 4/8-bit blocks instead of the dense weights.
        net.load_quantized(iter_gguf_quantized(gguf, native.SUPPORTED_QTYPES))
        if gguf_activations == "q8":
            net.set_q8_activations(True)
    elif gguf_activations == "q8":
        log.warning(
            "gguf_activations='q8' has no effect here (no native kernels or not on CPU): "
            "the model runs in float32 on the dequantized weights"
        )
    net.eval()
    scales = {
        name: (d.get("k_scale", d.get("kv_scale", 1.0)), d.get("v_scale", d.get("kv_scale", 1.0)))
        for name, d in kv_scales.items()
    }
    return LoadedModel(
        net, config, tokenizer, torch_dtype, path, time.perf_counter() - start, scales
    )


KV_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")


def _split_kv_scales(
    weights: Iterator[tuple[str, torch.Tensor]], into: dict[str, dict[str, float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass weights through, collecting fp8 KV-cache scales (``<layer>.k_scale`` etc., also
    under ``<layer>.attn.`` as some exporters write them) into ``into[layer][name]``."""
    for name, t in weights:
        head, _, leaf = name.rpartition(".")
        if leaf in KV_SCALE_NAMES and t.numel() == 1:
            into.setdefault(head.removesuffix(".attn"), {})[leaf] = float(t)
        else:
            yield name, t
