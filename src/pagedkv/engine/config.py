"""`EngineConfig`: every engine option in one validated place (the `LLM(...)` keywords)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pagedkv.core.hashing import HASH_FUNCTIONS
from pagedkv.core.specs import KV_CACHE_DTYPES, KV_ROTATIONS
from pagedkv.core.units import GiB
from pagedkv.kv_transfer.config import (
    OFFLOADING_CONNECTOR,
    KVTransferConfig,
    offloading_transfer_config,
    resolve_offload_config,
)

# On CPU the "device" KV cache is host memory: 1 GiB holds ~23k tokens of SmolLM2-135M in
# float32 (45 KiB/token), plenty for 8k-token contexts at high concurrency.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 * GiB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The scheduler's defaults (vLLM's CPU-friendly ones); the simulator's replicas share them.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_ENCODER_CACHE_SIZE = 8192  # tokens: 14 LLaVA-1.5 images of 576

# Accepted values, written once: EngineConfig's checks, the CLI's choices (engine/arg_utils.py)
# and the docs all read these.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = (*FLOAT_DTYPES, "auto")  # "auto": the checkpoint's dtype
KV_ROTATION_CHOICES = (*KV_ROTATIONS, "none")
KV_OFFLOAD_CACHE_POLICIES = ("lru", "arc")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_MEMORY_MODES = ("paged", "vmm")
# A vmm page: 64 KiB holds 128 tokens of one SmolLM2 KV head in float32 (K+V 512 B a token).
DEFAULT_VMM_PAGE_SIZE = 64 * 1024
GGUF_ACTIVATIONS = ("float32", "q8")  # gguf_activations: see EngineConfig


def one_of(values: tuple[str, ...], quote: bool = False) -> str:
    """``a, b or c`` (``'a', 'b' or 'c'`` with ``quote``): a choice in an error message."""
    names = [f"'{v}'" if quote else v for v in values]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


@dataclass(slots=True)
class EngineConfig:
    """Engine options (vLLM's names where they exist).

    KV cache size: exactly ``num_kv_blocks`` blocks (the null block included) if given; else
    ``kv_cache_memory`` bytes if given; else, on CPU, 1 GiB, and on CUDA
    ``gpu_memory_utilization`` of the free device memory after the weights are loaded.

    KV connector: ``kv_transfer_config`` (a `KVTransferConfig` or its dict), or ``kv_offload``,
    the short form of the offloading connector's (with ``kv_offload_cache_policy``,
    ``kv_offload_store_threshold`` and ``preemption_mode``). After construction
    ``kv_transfer_config`` is the typed config the engine builds its connector from (None: no
    connector); the offload spec has been parsed, once, into its `OffloadConfig`.
    """

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str = "float32"
    # GGUF models' small-batch GEMVs: "float32" multiplies the exact dequantized weights in
    # float32 (token-exact with transformers); "q8" quantizes each linear's input to 8-bit
    # blocks and takes integer dot products, llama.cpp's arithmetic (faster where FMA is the
    # limit; ops/csrc/gemv_q8.c).
    gguf_activations: str = "float32"
    device: str = "cpu"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_layout: str = "LBNHC"
    # How the device cache is addressed: "paged" (block tables) or "vmm" (vAttention: one
    # contiguous virtual range per request, physical pages of vmm_page_size bytes per KV head
    # mapped in as it grows; the scheduler's block is one page: ops/vmm.py).
    kv_cache_memory_mode: str = "paged"
    vmm_page_size: int = DEFAULT_VMM_PAGE_SIZE
    kv_cache_dtype: str = "auto"  # KV storage: one of core.specs.KV_CACHE_DTYPES (vLLM's names)
    kv_rotation: str | None = None  # "hadamard" / "none"; None: what kv_cache_dtype implies
    # fp8 per-tensor scales: a JSON file to load them from (and to save calibrated ones to),
    # and prompts to calibrate them with (a list, or a text file with one prompt per line).
    kv_scales_path: str | None = None
    kv_scales_calibration: str | list[str] | None = None
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Vision-language models: encoder outputs kept for reuse, in tokens (`engine.multimodal`),
    # and encoder-cache transfer between instances (EPD: `engine.ec_transfer`, vLLM's
    # ECTransferConfig as a dict: {"ec_role": "ec_producer" | "ec_consumer" | "ec_both", ...}).
    encoder_cache_size: int = DEFAULT_ENCODER_CACHE_SIZE
    ec_transfer_config: dict[str, Any] | None = None
    enable_prefix_caching: bool = True
    # Mamba checkpoints kept for prefix caching (vLLM's name): None every block boundary, 0 the
    # end of each step only (vLLM's align mode), k every k tokens (a multiple of the block size).
    prefix_cache_retention_interval: int | None = None
    prefix_caching_hash_algo: str = "sha256_cbor"
    enable_kv_cache_events: bool = False
    # Token eviction for every request that does not set its own (`core.token_eviction`):
    # {"policy": "streaming" | "snapkv", "budget_tokens": ..., ...}; None: keep every token.
    kv_eviction: dict[str, Any] | None = None
    seed: int = 0
    # Structured outputs' grammar library: "auto", "xgrammar" or "guidance" (llguidance).
    structured_outputs_backend: str = "auto"
    # KV offloading tiers, e.g. "cpu:4GiB,disk:/var/cache/pagedkv:20GiB,redis://127.0.0.1:6379".
    kv_offload: str | None = None
    kv_offload_cache_policy: str = "lru"  # CPU tier eviction: "lru" or "arc"
    kv_offload_store_threshold: int = 0  # admit a block to the tiers after this many offers
    preemption_mode: str = "recompute"  # "swap": a preempted request's KV goes to the CPU tier
    kv_transfer_config: KVTransferConfig | dict[str, Any] | None = None
    # Distribution (docs/features/distributed.md): tensor parallel ranks, decode context
    # parallel ranks among them (DCP must divide TP), tokens per DCP rank in turn, how ranks
    # run ("uni": one process, "mp": local processes, "ray": Ray actors; None: "uni" at TP=1,
    # else "mp"), their rendezvous (tcp://HOST:PORT; None: a free 127.0.0.1 port) and how long
    # a collective or the rendezvous may wait.
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_init_method: str | None = None
    distributed_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid engine option {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise bad("block_size", "must be a positive integer")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise bad("num_kv_blocks", "must be an integer >= 2 (block 0 is the null block)")
        if self.kv_cache_memory is not None and (
            not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory <= 0
        ):
            raise bad("kv_cache_memory", "must be a positive number of bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise bad("max_model_len", "must be a positive integer")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be a positive integer")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be a positive integer")
        if not isinstance(self.encoder_cache_size, int) or self.encoder_cache_size < 0:
            raise bad("encoder_cache_size", "must be a number of tokens >= 0")
        if self.ec_transfer_config is not None:
            from pagedkv.engine.ec_transfer import ECTransferConfig

            try:
                ECTransferConfig.from_value(self.ec_transfer_config)
            except ValueError as e:
                raise bad("ec_transfer_config", str(e)) from None
        r = self.prefix_cache_retention_interval
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise bad(
                "prefix_cache_retention_interval", "must be None, 0 or a positive number of tokens"
            )
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise bad("gguf_activations", f"choose {one_of(GGUF_ACTIVATIONS, quote=True)}")
        if self.structured_outputs_backend not in ("auto", "xgrammar", "guidance"):
            raise bad("structured_outputs_backend", "choose one of auto, xgrammar, guidance")
        if self.prefix_caching_hash_algo not in HASH_FUNCTIONS:
            raise bad("prefix_caching_hash_algo", f"choose one of {sorted(HASH_FUNCTIONS)}")
        if self.kv_offload_cache_policy not in KV_OFFLOAD_CACHE_POLICIES:
            policies = one_of(KV_OFFLOAD_CACHE_POLICIES, quote=True)
            raise bad("kv_offload_cache_policy", f"choose {policies}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise bad("preemption_mode", f"choose {one_of(PREEMPTION_MODES, quote=True)}")
        self._check_layout(bad)
        self._check_kv_cache_dtype(bad)
        self._check_memory_mode(bad)
        if self.kv_eviction is not None:
            from pagedkv.core.token_eviction import KVEvictionConfig, KVEvictionError

            try:
                KVEvictionConfig.from_value(self.kv_eviction)
            except (KVEvictionError, TypeError) as e:
                raise bad("kv_eviction", str(e)) from None
        self._resolve_kv_transfer_config()
        if self.dtype not in DTYPES:
            raise bad("dtype", f"choose {one_of(DTYPES)}")
        self._check_parallel(bad)

    def _check_parallel(self, bad: Any) -> None:
        """TP/DCP sizes and the executor backend (the model-dependent checks, heads that do
        not split, come when the model config is read: `core.parallel.check_parallel_sizes`)."""
        from pagedkv.core.parallel import EXECUTOR_BACKENDS

        for name in (
            "tensor_parallel_size",
            "decode_context_parallel_size",
            "cp_kv_cache_interleave_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "must be a positive integer")
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp % dcp:
            raise bad("decode_context_parallel_size", f"must divide tensor_parallel_size={tp}")
        if self.block_size % self.cp_kv_cache_interleave_size:
            raise bad("cp_kv_cache_interleave_size", f"must divide block_size={self.block_size}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if tp == 1 else "mp"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise bad("distributed_executor_backend", f"choose {one_of(EXECUTOR_BACKENDS)}")
        if self.distributed_executor_backend == "uni" and tp > 1:
            raise bad(
                "distributed_executor_backend",
                f"'uni' runs one rank; tensor_parallel_size={tp} needs 'mp' or 'ray'",
            )
        if self.distributed_init_method is not None:
            from pagedkv.distributed.parallel_state import parse_init_method

            try:
                parse_init_method(self.distributed_init_method)
            except ValueError as e:
                raise bad("distributed_init_method", str(e)) from None
        if not self.distributed_timeout_s > 0:
            raise bad("distributed_timeout_s", "must be a positive number of seconds")
        if tp > 1 and self.kv_transfer_config is not None:
            self._check_parallel_connector(tp)
        if dcp > 1 and self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise bad(
                "kv_cache_dtype",
                "decode_context_parallel_size > 1 needs an unquantized KV cache",
            )

    def _check_parallel_connector(self, tp: int) -> None:
        """Under TP the offload tiers (cpu, disk, redis: `offload.sharded`) and the NixlConnector
        (on CPU) are rank-aware; ValueError naming the field for another connector or a p2p
        tier."""
        from pagedkv.kv_transfer.config import resolve_offload_config

        ktc = self.kv_transfer_config
        if ktc.kv_connector == "NixlConnector":  # type: ignore[union-attr]
            if self.device != "cpu":
                raise ValueError(
                    f"tensor_parallel_size={tp} with the NixlConnector needs device='cpu' (the "
                    "driver maps every rank's KV buffer; GPU ranks would need an agent each)"
                )
            return
        offload = resolve_offload_config(ktc)  # type: ignore[arg-type]
        if offload is None:
            raise ValueError(
                f"tensor_parallel_size={tp} with kv_transfer_config.kv_connector="
                f"{ktc.kv_connector!r} is not supported: under TP only the offload tiers "  # type: ignore[union-attr]
                "(kv_offload cpu/disk/redis) and the NixlConnector are rank-aware"
            )
        if offload.p2p is not None:
            raise ValueError(
                f"tensor_parallel_size={tp} with a p2p tier in kv_offload is not supported: "
                "peers exchange one rank's chunks; use cpu/disk/redis tiers"
            )

    def _check_memory_mode(self, bad: Any) -> None:
        """``kv_cache_memory_mode`` and what the vmm mode cannot combine with (the model's own
        limits, e.g. sliding-window layers, are checked when its specs are planned)."""
        if self.kv_cache_memory_mode not in KV_CACHE_MEMORY_MODES:
            raise bad("kv_cache_memory_mode", f"choose {one_of(KV_CACHE_MEMORY_MODES, quote=True)}")
        v = self.vmm_page_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 4096 or v % 4096:
            raise bad("vmm_page_size", "must be a positive multiple of 4096 bytes")
        if self.kv_cache_memory_mode != "vmm":
            return
        from pagedkv.ops.vmm import supported

        why = supported()
        if why is not None:
            raise bad("kv_cache_memory_mode", why)
        if self.device != "cpu":
            raise bad("kv_cache_memory_mode", "'vmm' runs on CPU (CUDA's VMM API is not built)")
        if self.kv_cache_dtype not in ("auto", *FLOAT_DTYPES) or self.kv_rotation not in (
            None,
            "none",
        ):
            raise bad("kv_cache_memory_mode", "'vmm' needs an unquantized, unrotated KV cache")
        if self.tensor_parallel_size > 1 or self.decode_context_parallel_size > 1:
            raise bad("kv_cache_memory_mode", "'vmm' runs one rank (no TP/DCP)")
        if self.kv_eviction is not None:
            raise bad("kv_cache_memory_mode", "'vmm' rows are append-only: no token eviction")
        if self.block_size != DEFAULT_BLOCK_SIZE:
            raise bad(
                "block_size",
                "in 'vmm' mode a block is one page: set vmm_page_size, not block_size",
            )

    def _check_kv_cache_dtype(self, bad: Any) -> None:
        """``kv_cache_dtype``/``kv_rotation`` name a known storage format (clear error early)."""
        from pagedkv.core.specs import resolve_kv_cache_dtype, resolve_kv_rotation

        try:
            resolve_kv_cache_dtype(self.kv_cache_dtype, "float32")
        except ValueError as e:
            raise bad("kv_cache_dtype", f"{e}; choose {one_of(KV_CACHE_DTYPES)}") from e
        try:
            resolve_kv_rotation(self.kv_cache_dtype, self.kv_rotation)
        except ValueError as e:
            raise bad("kv_rotation", str(e)) from e

    def _check_layout(self, bad: Any) -> None:
        """The layout is a kernel-usable permutation of L, B, H, N, C (C innermost)."""
        from pagedkv.core.layout import KERNEL_USABLE_LAYOUTS

        names = sorted(m.value for m in KERNEL_USABLE_LAYOUTS)
        if str(getattr(self.kv_cache_layout, "value", self.kv_cache_layout)) not in names:
            raise bad(
                "kv_cache_layout",
                "use a permutation of L, B, H, N with C last, e.g. LBNHC (the "
                "default), LBHNC, or BLNHC / BLHNC (each block one range)",
            )

    def _resolve_kv_transfer_config(self) -> None:
        """``kv_offload`` / ``kv_transfer_config`` → one typed `KVTransferConfig` (or None)."""
        kvt = self.kv_transfer_config
        if kvt is not None and self.kv_offload is not None:
            raise ValueError(
                "give either kv_offload (--kv-offload) or kv_transfer_config "
                "(--kv-transfer-config), not both"
            )
        if isinstance(kvt, dict):
            kvt = KVTransferConfig.from_dict(kvt)
        elif isinstance(kvt, KVTransferConfig):  # a copy: the caller's object stays as given
            kvt = replace(kvt, kv_connector_extra_config=dict(kvt.kv_connector_extra_config))
        elif kvt is not None and not isinstance(kvt, KVTransferConfig):
            raise ValueError(
                f"invalid engine option kv_transfer_config: expected a KVTransferConfig or a "
                f"dict, got {type(kvt).__name__}"
            )
        if self.kv_offload is not None:
            try:
                kvt = offloading_transfer_config(
                    self.kv_offload,
                    cache_policy=self.kv_offload_cache_policy,
                    store_threshold=self.kv_offload_store_threshold,
                    preemption_mode=self.preemption_mode,
                )
            except ValueError as e:
                raise ValueError(
                    f"invalid engine option kv_offload={self.kv_offload!r}: {e}"
                ) from None
        elif kvt is not None and kvt.kv_connector == OFFLOADING_CONNECTOR:
            try:
                resolve_offload_config(kvt)
            except ValueError as e:
                raise ValueError(f"invalid engine option kv_transfer_config: {e}") from None
            extra = kvt.kv_connector_extra_config
            extra.setdefault("cache_policy", self.kv_offload_cache_policy)
            extra.setdefault("store_threshold", self.kv_offload_store_threshold)
            extra.setdefault("preemption_mode", self.preemption_mode)
        offloading = kvt is not None and kvt.kv_connector == OFFLOADING_CONNECTOR
        if self.preemption_mode == "swap" and not offloading:
            raise ValueError(
                f"invalid engine option preemption_mode={self.preemption_mode!r}: "
                "'swap' needs a CPU tier (kv_offload)"
            )
        self.kv_transfer_config = kvt if kvt is not None and kvt.kv_connector is not None else None


_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def resolve_dtype_name(dtype: str, checkpoint_dtype: str | None) -> str:
    """The dtype name the engine computes (and stores KV) in: ``"auto"`` is the checkpoint's
    declared dtype, else float32 (GGUF weights are dequantized to it); the loader's rule."""
    if dtype == "auto":
        return _DTYPE_ALIASES.get(checkpoint_dtype or "float32", "float32")
    return dtype


def default_kv_cache_memory(config: EngineConfig) -> int | None:
    """KV bytes the engine sizes its pool from without looking at a device: ``kv_cache_memory``,
    else 1 GiB on CPU; None on CUDA (there it depends on the free device memory)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    return None if config.device.startswith("cuda") else DEFAULT_CPU_KV_CACHE_MEMORY


def check_kv_cache_fits(
    config: EngineConfig, groups: list[Any], max_model_len: int, kv_cache_memory: int
) -> None:
    """vLLM's start-up rule: one request of ``max_model_len`` tokens must fit in the KV cache.

    The cache is ``config.num_kv_blocks`` blocks when set, else ``kv_cache_memory`` bytes.
    Raises ValueError naming the blocks needed, the largest length that fits
    (`estimate_max_model_len`) and the option (and CLI flag) to change. No torch: the CLI runs
    it before loading weights, the engine again once the model is loaded.
    """
    from pagedkv.core import planning

    bpb = planning.bytes_per_block(groups)
    blocks = (
        config.num_kv_blocks
        if config.num_kv_blocks is not None
        else planning.num_blocks_from_memory(kv_cache_memory, groups)
    )
    need = planning.blocks_per_request(groups, max_model_len, config.max_num_batched_tokens)
    if need <= blocks - 1:
        return
    fits = planning.estimate_max_model_len(
        groups, blocks * bpb, max_model_len, config.max_num_batched_tokens
    )
    if config.num_kv_blocks is not None:
        have, knob = (
            f"num_kv_blocks={config.num_kv_blocks} ({blocks - 1} usable)",
            "num_kv_blocks (--num-kv-blocks)",
        )
    else:
        have = f"{kv_cache_memory / GiB:.2f} GiB of KV cache memory ({max(blocks - 1, 0)} usable blocks)"
        knob = (
            "gpu_memory_utilization"
            if config.device.startswith("cuda") and config.kv_cache_memory is None
            else "kv_cache_memory (--kv-cache-memory)"
        )
    raise ValueError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), {need} KV "
        f"blocks are needed, more than {have}. Based on the available KV cache, the estimated "
        f"maximum model length is {fits}. Try decreasing max_model_len (--max-model-len) to at "
        f"most {fits} or increasing {knob}."
    )
