"""Per-tensor fp8 KV scales (``kv_cache_dtype="fp8"``/``fp8_e4m3``/``fp8_e5m2``): where they come from.

One ``k_scale`` and one ``v_scale`` per attention layer; the cache stores ``fp8(x / scale)``.
Sources, first match wins (vLLM's order, plus calibration, which vLLM 0.33 dropped):

1. ``kv_scales_path`` when the file exists (JSON written by step 3);
2. the checkpoint's ``<layer>.k_scale`` / ``v_scale`` / ``kv_scale`` tensors;
3. ``kv_scales_calibration`` prompts: one unquantized pass records each layer's ``max |K|`` and
   ``max |V|`` and sets ``scale = amax / fp8_max`` (HF's ``Fp8QuantizedLayer`` rule), saved to
   ``kv_scales_path`` when one is given;
4. otherwise 1.0, with vLLM's warning (values past ±448 then saturate).

Per-token-head modes carry their scales in the page and ignore all of this.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pagedkv.core.specs import KVQuantMode

logger = logging.getLogger(__name__)

FP8_MAX = {"fp8": 448.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
Scales = dict[str, tuple[float, float]]


def load_kv_scales(path: str | os.PathLike[str]) -> Scales:
    """Read a scales file; ValueError naming the file on a malformed one."""
    try:
        data = json.loads(Path(path).read_text())
        return {
            name: (float(d["k_scale"]), float(d["v_scale"])) for name, d in data["layers"].items()
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read KV scales from {path}: {e}") from e


def save_kv_scales(path: str | os.PathLike[str], scales: Scales, meta: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = {**meta, "layers": {n: {"k_scale": k, "v_scale": v} for n, (k, v) in scales.items()}}
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, p)  # never a half-written file


def calibration_prompts(source: str | list[str]) -> list[str]:
    """A list of prompts as given, or a text file's non-empty lines."""
    if isinstance(source, list):
        return [p for p in source if p]
    lines = Path(source).read_text().splitlines()
    return [ln for ln in lines if ln.strip()]


def resolve_kv_scales(engine: Any, checkpoint_scales: Scales) -> tuple[Scales, str]:
    """Set ``engine.runner``'s per-tensor scales from the first source that has them; returns
    ``(scales, source)``. A no-op (``({}, "none")``) for other KV formats."""
    config, spec = engine.config, engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if getattr(spec, "kv_quant_mode", None) is not KVQuantMode.FP8_PER_TENSOR:
        return {}, "none"
    fp8_max = FP8_MAX.get(spec.dtype, 448.0)
    scales: Scales
    if config.kv_scales_path and Path(config.kv_scales_path).exists():
        scales, source = load_kv_scales(config.kv_scales_path), f"file {config.kv_scales_path}"
    elif checkpoint_scales:
        scales, source = checkpoint_scales, "checkpoint"
    elif config.kv_scales_calibration:
        prompts = calibration_prompts(config.kv_scales_calibration)
        ids = [engine.tokenizer.encode(p)[: engine.max_model_len] for p in prompts]
        amax = engine.runner.observe_kv_amax([i for i in ids if i])
        scales = {n: (max(k, 1e-6) / fp8_max, max(v, 1e-6) / fp8_max) for n, (k, v) in amax.items()}
        source = f"calibration over {len(ids)} prompts"
        if config.kv_scales_path:
            save_kv_scales(
                config.kv_scales_path,
                scales,
                {"kv_format": spec.kv_format, "fp8_max": fp8_max, "num_prompts": len(ids)},
            )
    else:
        logger.warning(
            "Using KV cache scaling factor 1.0 for %s (no checkpoint scales, no "
            "--kv-scales-calibration): values beyond ±%g saturate",
            spec.dtype,
            fp8_max,
        )
        return {}, "default 1.0"
    engine.runner.set_kv_scales(scales)
    logger.info("fp8 KV scales from %s", source)
    return scales, source
