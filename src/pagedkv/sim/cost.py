"""The simulator's forward pass: a step-time cost model.

One engine step (one forward pass over a flat batch) costs::

    step_s = base_s + prefill_token_s * P + decode_seq_s * D + context_token_s * C

``P``: prompt tokens computed in the step (all prefill chunks); ``D``: sequences decoding one
token; ``C``: KV tokens the step's attention reads (sum over scheduled requests of their
context length after the step). Loads from a CPU tier add ``blocks * block_bytes / host_bw``.

plus ``request_overhead_s`` on each request's TTFT and e2e (the serving path outside the steps).

Two sources:

* ``pagedkv simulate calibrate`` measures the real engine on this machine (`calibrate.py`) and
  fits the coefficients by least squares; saved as JSON (`CostModel.save` / `load`). In-process
  (`LLMEngine.step` timed per step) or, with ``--server``, through a real ``pagedkv serve``
  process (TTFT of single requests and ITL of concurrent streams, as a client sees them).
* `GPU_TABLE`: rows for an accelerator. These are APPROXIMATIONS (a roofline with measured
  efficiencies), not measurements of pagedkv. Sources:
  - NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3;
    NVIDIA H200 datasheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e
    (https://www.nvidia.com/en-us/data-center/h100/, https://www.nvidia.com/en-us/data-center/h200/).
  - Llama-3.1-8B (BF16): 16 GB of weights, ~16 GFLOP per token, KV 128 KiB per token
    (32 layers x 8 KV heads x 128 x 2 x 2 B).
  - Efficiencies are set so the rows reproduce public vLLM figures on 1x H100 80GB for
    Llama-3.1-8B: ~12,500 output tok/s at high concurrency (https://www.morphllm.com/vllm-benchmarks,
    citing third-party vLLM V1 runs) and vLLM's v0.6.0 performance blog
    (https://blog.vllm.ai/2024/09/05/perf-update.html: Llama-8B on 1x H100, ShareGPT, TPOT of a
    few ms to ~10 ms depending on load). Decode floor = weights / (0.8 x HBM bandwidth);
    prefill = 16 GFLOP / (0.5 x peak); attention reads KV at 0.8 x HBM bandwidth;
    host (PCIe Gen5 x16) ~ 50 GB/s effective for CPU-tier loads.
  Use a calibrated JSON for anything that must be trusted; use these for relative questions
  (tier size, routing policy) at a scale this machine cannot host.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(slots=True)
class CostModel:
    """Seconds per step as a linear function of the batch (see the module docstring)."""

    name: str
    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    block_size: int = 16
    block_bytes: int = 0  # bytes of one KV block over all layers (tier loads, memory)
    host_bw_bytes_s: float = 50e9  # device <-> CPU tier bandwidth for loads
    # Client-visible latency outside the engine steps (HTTP, request intake, first chunk out),
    # added to every request's TTFT and e2e. Fitted by `calibrate --server`; 0 for raw engine.
    request_overhead_s: float = 0.0
    # Prefill -> decode KV transfer bandwidth with a PD split (a 200 Gb/s RDMA NIC ~ 25 GB/s).
    kv_transfer_bw_bytes_s: float = 25e9
    source: str = ""

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def decode_run_time(self, num_seqs: int, context_tokens: int, steps: int) -> float:
        """Total time of ``steps`` pure-decode steps of ``num_seqs`` sequences whose summed
        context is ``context_tokens`` after the first step (it grows by ``num_seqs`` per step)."""
        per = self.base_s + self.decode_seq_s * num_seqs
        ctx = context_tokens * steps + num_seqs * steps * (steps - 1) // 2
        return per * steps + self.context_token_s * ctx

    def load_time(self, num_blocks: int) -> float:
        if num_blocks <= 0 or self.block_bytes <= 0:
            return 0.0
        return num_blocks * self.block_bytes / self.host_bw_bytes_s

    def transfer_time(self, num_blocks: int) -> float:
        if num_blocks <= 0 or self.block_bytes <= 0:
            return 0.0
        return num_blocks * self.block_bytes / self.kv_transfer_bw_bytes_s

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> CostModel:
        d = json.loads(Path(path).read_text())
        d = d.get("cost_model", d)  # a calibration report wraps the model
        return CostModel(**{k: d[k] for k in CostModel.__dataclass_fields__ if k in d})


def _roofline(
    name: str,
    hbm_bw: float,
    peak_flops: float,
    weight_bytes: float,
    flop_per_token: float,
    kv_bytes_per_token: int,
    block_size: int = 16,
) -> CostModel:
    return CostModel(
        name=name,
        base_s=weight_bytes / (0.8 * hbm_bw),  # weights read once per step
        prefill_token_s=flop_per_token / (0.5 * peak_flops),
        decode_seq_s=flop_per_token / (0.35 * peak_flops),  # small-M GEMMs run far from peak
        context_token_s=kv_bytes_per_token / (0.8 * hbm_bw),
        block_size=block_size,
        block_bytes=kv_bytes_per_token * block_size,
        host_bw_bytes_s=50e9,
        source="roofline approximation from NVIDIA datasheets, checked against public vLLM "
        "Llama-3.1-8B H100 figures (see pagedkv/sim/cost.py)",
    )


# Llama-3.1-8B BF16 on one GPU (see the module docstring for sources).
GPU_TABLE: dict[str, CostModel] = {
    "h100-llama3-8b": _roofline("h100-llama3-8b", 3.35e12, 989e12, 16.06e9, 16.06e9, 131072),
    "h200-llama3-8b": _roofline("h200-llama3-8b", 4.8e12, 989e12, 16.06e9, 16.06e9, 131072),
}


def resolve_cost_model(spec: str) -> CostModel:
    """A `GPU_TABLE` row name, or the path of a calibration JSON."""
    if spec in GPU_TABLE:
        return GPU_TABLE[spec]
    if Path(spec).exists():
        return CostModel.load(spec)
    raise ValueError(
        f"unknown cost model {spec!r}: a calibration JSON path or one of {sorted(GPU_TABLE)}"
    )
