"""`EngineArgs`: every engine option a user passes, declared once (vLLM's ``EngineArgs``).

Each field carries its CLI flag's help, accepted values and argparse type in its metadata; its
default is `EngineConfig`'s (read from that dataclass, so it is written once, there) and the
accepted values are the constants `EngineConfig` validates with. Everything that shows an
option (``--help``, the docs' generated CLI page) therefore shows what the engine enforces.

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))           # the usual set
    EngineArgs.add_cli_args(parser, include=("block_size", "max_num_seqs"))  # a subset
    config = EngineArgs.from_cli_args(parser.parse_args()).create_engine_config()

A subcommand picks the subset it needs (``include``, in the order shown by ``--help``) and may
override an argparse setting where its meaning differs (``overrides``: a benchmark's narrower
dtype choices, the simulator's own defaults). No torch import: ``--help`` starts instantly.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.hashing import HASH_FUNCTIONS
from pagedkv.core.specs import KV_CACHE_DTYPE_MODES, KV_CACHE_DTYPE_NOTES, KV_CACHE_DTYPE_SHORTCUTS
from pagedkv.core.units import format_size, parse_size
from pagedkv.engine.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DTYPES,
    GGUF_ACTIVATIONS,
    KV_CACHE_MEMORY_MODES,
    KV_OFFLOAD_CACHE_POLICIES,
    KV_ROTATION_CHOICES,
    PREEMPTION_MODES,
    EngineConfig,
)

__all__ = [
    "CACHE_ARGS",
    "KV_EVENTS_ARGS",
    "PARALLEL_ARGS",
    "SCHEDULER_ARGS",
    "EngineArgs",
    "kv_cache_dtype_help",
    "size_arg",
]

# The model and KV cache flags of generate, chat and serve (their "engine" group), in order.
CACHE_ARGS: tuple[str, ...] = (
    "model",
    "dtype",
    "gguf_activations",
    "block_size",
    "max_model_len",
    "num_kv_blocks",
    "kv_cache_memory",
    "kv_cache_layout",
    "kv_cache_memory_mode",
    "vmm_page_size",
    "kv_cache_dtype",
    "kv_rotation",
    "kv_scales_path",
    "kv_scales_calibration",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "kv_offload",
    "kv_transfer_config",
    "kv_side_channel_port",
    "preemption_mode",
    "kv_eviction",
    "encoder_cache_size",
    "ec_transfer_config",
)
# The scheduler's budgets, the engine seed and the structured-output backend (serve adds them
# to its engine group).
SCHEDULER_ARGS: tuple[str, ...] = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
    "structured_outputs_backend",
)
# Distribution: tensor and decode context parallelism (generate, chat and serve).
PARALLEL_ARGS: tuple[str, ...] = (
    "tensor_parallel_size",
    "decode_context_parallel_size",
    "cp_kv_cache_interleave_size",
    "distributed_executor_backend",
    "distributed_init_method",
    "distributed_timeout_s",
)
KV_EVENTS_ARGS: tuple[str, ...] = ("enable_kv_cache_events",)

# Metadata keys passed to ``add_argument`` as they are; the others are EngineArgs' own.
_ARGPARSE_KEYS = frozenset({"help", "type", "choices", "metavar", "action", "default"})
_CONFIG_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def size_arg(text: str) -> int:
    """`parse_size` as an argparse ``type``: a bad size is a usage error (exit 2) whose
    message says what a size looks like."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_cache_dtype_help() -> str:
    """``--kv-cache-dtype``'s help: every accepted value (core.specs), with its note."""

    def named(values: Sequence[str]) -> str:
        groups: list[tuple[list[str], str | None]] = []
        for v in values:
            note = KV_CACHE_DTYPE_NOTES.get(v)
            if groups and note is not None and groups[-1][1] == note:
                groups[-1][0].append(v)
            else:
                groups.append(([v], note))
        return ", ".join(" / ".join(vs) + (f" ({note})" if note else "") for vs, note in groups)

    return (
        f"KV cache storage (vLLM's names): {named(KV_CACHE_DTYPE_SHORTCUTS)}, or a mode: "
        f"{named(KV_CACHE_DTYPE_MODES)} (default %(default)s)"
    )


def _opt(name: str, help: str, **cli: Any) -> Any:
    """A field whose default is `EngineConfig`'s field ``name``; ``cli``: argparse settings
    (``type``, ``choices``, ``metavar``, ``action``) and EngineArgs' own keys: ``flags`` (the
    option strings, default ``--name-with-dashes``), ``dest`` and ``negate`` (a store_true flag
    that turns the option off)."""
    return field(default=_CONFIG_DEFAULTS[name], metadata=dict(help=help, **cli))


@dataclass(slots=True)
class EngineArgs:
    """The engine options as users pass them (CLI flags, ``LLM(...)`` keywords).

    Contract: every field but ``kv_side_channel_port`` is an `EngineConfig` field of the same
    name and default; ``kv_transfer_config`` and ``kv_eviction`` may also be the CLI's JSON text, and
    ``kv_side_channel_port`` is folded into it (``kv_connector_extra_config``) by
    `config_kwargs`. Validation is `EngineConfig`'s (`create_engine_config` raises its
    ValueError naming the option).
    """

    model: str | None = _opt(
        "model", "a .gguf file or HF model directory (default: SmolLM2-135M-Instruct)"
    )
    dtype: str = _opt("dtype", "model and KV cache dtype (default %(default)s)", choices=DTYPES)
    gguf_activations: str = _opt(
        "gguf_activations",
        "GGUF models' decode GEMVs: float32 (exact weights, float32 math: token-exact with "
        "transformers) or q8 (inputs quantized to 8-bit blocks, integer dot products: "
        "llama.cpp's arithmetic, faster on CPUs without wide FMA units) (default %(default)s)",
        choices=GGUF_ACTIVATIONS,
    )
    device: str = _opt("device", "cpu or cuda[:N] (default %(default)s)")
    block_size: int = _opt("block_size", "tokens per KV block (default %(default)s)", type=int)
    max_model_len: int | None = _opt(
        "max_model_len", "context length cap (default: the model's context length)", type=int
    )
    num_kv_blocks: int | None = _opt(
        "num_kv_blocks",
        "exact KV pool size in blocks, the null block included (default: from memory)",
        type=int,
    )
    kv_cache_memory: int | None = _opt(
        "kv_cache_memory",
        f"KV pool size, e.g. 512MiB (default {format_size(DEFAULT_CPU_KV_CACHE_MEMORY)} on CPU)",
        type=size_arg,
    )
    gpu_memory_utilization: float = _opt(
        "gpu_memory_utilization",
        "on CUDA, the fraction of free device memory the KV cache may "
        "take after the weights load (default %(default)s)",
        type=float,
    )
    kv_cache_layout: str = _opt(
        "kv_cache_layout",
        "stride order of the KV buffer over L(ayer) B(lock) H(ead) N(token) C(ontent), C "
        "last: LBNHC (default), LBHNC, or BLNHC / BLHNC, which make each block one "
        "contiguous range across layers (larger KV transfer descriptors)",
        metavar="LAYOUT",
    )
    kv_cache_memory_mode: str = _opt(
        "kv_cache_memory_mode",
        "paged: block tables (default); vmm: vAttention-style, one contiguous virtual range "
        "per request with physical pages mapped in as it grows",
        choices=KV_CACHE_MEMORY_MODES,
    )
    vmm_page_size: int = _opt(
        "vmm_page_size",
        "vmm mode: bytes of one KV head's physical page, a multiple of 4 KiB holding whole "
        "tokens (default 64KiB); the scheduler's block is one page",
        type=size_arg,
    )
    kv_cache_dtype: str = _opt("kv_cache_dtype", kv_cache_dtype_help(), metavar="DTYPE")
    kv_rotation: str | None = _opt(
        "kv_rotation",
        "rotate K/V (and Q) before quantizing (default: hadamard for int8 and int4, else none)",
        choices=KV_ROTATION_CHOICES,
    )
    kv_scales_path: str | None = _opt(
        "kv_scales_path",
        "fp8 per-tensor KV scales: load from this file if it exists, else save calibrated "
        "ones to it",
        metavar="JSON",
    )
    kv_scales_calibration: str | list[str] | None = _opt(
        "kv_scales_calibration",
        "calibrate fp8 per-tensor KV scales (amax/448) over these prompts, one per line",
        metavar="PROMPTS.txt",
    )
    max_num_seqs: int = _opt(
        "max_num_seqs", "max running sequences (default %(default)s)", type=int
    )
    max_num_batched_tokens: int = _opt(
        "max_num_batched_tokens", "token budget per step (default %(default)s)", type=int
    )
    encoder_cache_size: int = _opt(
        "encoder_cache_size",
        "vision-language models: encoder outputs kept for reuse, in tokens (default %(default)s)",
        type=int,
    )
    enable_prefix_caching: bool = _opt(
        "enable_prefix_caching",
        "disable prefix caching",
        flags=("--no-prefix-caching", "--no-enable-prefix-caching"),
        dest="no_prefix_caching",
        negate=True,
    )
    prefix_cache_retention_interval: int | None = _opt(
        "prefix_cache_retention_interval",
        "Mamba checkpoints kept for prefix caching: every block boundary (default), 0 the end "
        "of each step only, k every k tokens (a multiple of the block size)",
        type=int,
    )
    prefix_caching_hash_algo: str = _opt(
        "prefix_caching_hash_algo",
        "block hash function (default %(default)s)",
        choices=tuple(sorted(HASH_FUNCTIONS)),
    )
    enable_kv_cache_events: bool = _opt(
        "enable_kv_cache_events",
        "publish BlockStored / BlockRemoved / AllBlocksCleared events",
        action="store_true",
    )
    seed: int = _opt("seed", "engine seed (requests without a seed)", type=int)
    structured_outputs_backend: str = _opt(
        "structured_outputs_backend",
        "grammar library of structured outputs: auto (xgrammar, llguidance for Lark grammars "
        "and what xgrammar refuses), xgrammar or guidance (default %(default)s)",
        choices=("auto", "xgrammar", "guidance"),
    )
    kv_offload: str | None = _opt(
        "kv_offload",
        "KV tiers, e.g. cpu:4GiB,disk:/var/cache/pagedkv:20GiB,redis://127.0.0.1:6379 "
        "(short form of --kv-transfer-config for the OffloadingConnector)",
        metavar="SPEC",
    )
    kv_offload_cache_policy: str = _opt(
        "kv_offload_cache_policy",
        "CPU tier eviction policy (default %(default)s)",
        choices=KV_OFFLOAD_CACHE_POLICIES,
    )
    kv_offload_store_threshold: int = _opt(
        "kv_offload_store_threshold",
        "admit a block to the tiers after this many offers (default %(default)s)",
        type=int,
    )
    preemption_mode: str = _opt(
        "preemption_mode",
        "how a preempted request comes back: recompute its KV, or swap it to the CPU tier "
        "(default %(default)s)",
        choices=PREEMPTION_MODES,
    )
    kv_transfer_config: Any = _opt(
        "kv_transfer_config",
        "the KV connector as vLLM's KVTransferConfig JSON, e.g. "
        '\'{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
        '"kv_connector_extra_config":{"kv_offload":"cpu:4GiB"}}\'',
        metavar="JSON",
    )
    kv_eviction: Any = _opt(
        "kv_eviction",
        "token eviction for every request that sets none (lossy), as JSON, e.g. "
        '\'{"policy":"streaming","budget_tokens":512}\' or '
        '\'{"policy":"snapkv","budget_tokens":1024}\'',
        metavar="JSON",
    )
    ec_transfer_config: Any = _opt(
        "ec_transfer_config",
        "encoder-cache transfer (EPD) for vision-language models, as JSON, e.g. "
        '\'{"ec_role":"ec_producer","ec_connector_extra_config":{"ec_port":5800}}\' on an '
        'encoder instance, \'{"ec_role":"ec_consumer"}\' on a prefill instance',
        metavar="JSON",
    )
    tensor_parallel_size: int = _opt(
        "tensor_parallel_size",
        "tensor-parallel ranks: heads, MLP rows and vocabulary split across them (default "
        "%(default)s)",
        type=int,
        flags=("--tensor-parallel-size", "-tp"),
    )
    decode_context_parallel_size: int = _opt(
        "decode_context_parallel_size",
        "decode-context-parallel ranks (divides --tensor-parallel-size): the KV cache's tokens "
        "are split across ranks holding the same KV heads (default %(default)s)",
        type=int,
        flags=("--decode-context-parallel-size", "-dcp"),
    )
    cp_kv_cache_interleave_size: int = _opt(
        "cp_kv_cache_interleave_size",
        "tokens each DCP rank stores in turn (divides --block-size; default %(default)s)",
        type=int,
    )
    distributed_executor_backend: str | None = _opt(
        "distributed_executor_backend",
        "how ranks run: uni (one process), mp (local processes) or ray (Ray actors); default: "
        "uni at TP 1, else mp",
        choices=("uni", "mp", "ray"),
    )
    distributed_init_method: str | None = _opt(
        "distributed_init_method",
        "the ranks' torch.distributed rendezvous, tcp://HOST:PORT (default: a free 127.0.0.1 port)",
        metavar="URL",
    )
    distributed_timeout_s: float = _opt(
        "distributed_timeout_s",
        "seconds a collective or the ranks' rendezvous may wait before the engine fails "
        "(default %(default)s)",
        type=float,
    )
    # CLI-only: where a NixlConnector listens, folded into kv_transfer_config's extra config.
    kv_side_channel_port: int | None = field(
        default=None,
        metadata=dict(
            help="where a NixlConnector listens for KV handshakes (sets "
            "kv_connector_extra_config.side_channel_port)",
            type=int,
            metavar="PORT",
        ),
    )

    @classmethod
    def add_cli_args(
        cls,
        parser: Any,
        *,
        include: Sequence[str] = CACHE_ARGS,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Any:
        """Add the flags of the fields ``include`` names (in that order) to ``parser`` (a parser
        or an argument group); returns it. ``overrides[name]`` replaces argparse settings of
        one flag (``default``, ``choices``, ``type``, ``help``...; ``choices=None`` drops the
        check). KeyError for a name that is not a field."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in include:
            f = fields[name]
            meta = {**f.metadata, **(overrides or {}).get(name, {})}
            flags = meta.get("flags") or ("--" + name.replace("_", "-"),)
            kwargs = {k: v for k, v in meta.items() if k in _ARGPARSE_KEYS}
            if meta.get("negate"):
                kwargs.update(action="store_true", dest=meta["dest"])
            else:
                kwargs.setdefault("default", f.default)
                if "dest" in meta:
                    kwargs["dest"] = meta["dest"]
            parser.add_argument(*flags, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options ``args`` holds: every field whose flag's ``dest`` is in the namespace; the
        rest keep their defaults. A None value keeps a field's non-None default (``generate``'s
        ``--seed`` is a sampling seed that is None when unset; the engine's stays 0)."""
        given = vars(args)
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            dest = f.metadata.get("dest", f.name)
            if dest not in given:
                continue
            value = given[dest]
            if f.metadata.get("negate"):
                value = not value
            elif value is None and f.default is not None:
                continue
            kw[f.name] = value
        return cls(**kw)

    @classmethod
    def describe(cls) -> list[dict[str, str]]:
        """Rows ``{name, flag, default, choices, help}`` for every option (the docs' table of
        engine options / ``LLM(...)`` keywords), ``%(default)s`` filled in."""
        rows = []
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = ", ".join(meta.get("flags") or ("--" + f.name.replace("_", "-"),))
            choices = meta.get("choices")
            rows.append(
                dict(
                    name=f.name,
                    flag=flag,
                    default=repr(f.default),
                    choices=", ".join(choices) if choices else "",
                    help=meta["help"] % {"default": f.default},
                )
            )
        return rows

    def config_kwargs(self) -> dict[str, Any]:
        """The `EngineConfig` (and ``LLM(...)``) keywords, ``model`` included: JSON text in
        ``kv_transfer_config`` parsed, ``kv_side_channel_port`` folded into it. ValueError
        (TypeError for a JSON field of the wrong type) names the bad option."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        port = kw.pop("kv_side_channel_port")
        kvt = kw["kv_transfer_config"]
        if isinstance(kvt, str):
            from pagedkv.kv_transfer.config import KVTransferConfig

            kvt = KVTransferConfig.from_cli(kvt)
        if port is not None:
            if kvt is None:
                raise ValueError(
                    "--kv-side-channel-port needs --kv-transfer-config naming a NixlConnector"
                )
            extra = (
                kvt.setdefault("kv_connector_extra_config", {})
                if isinstance(kvt, dict)
                else kvt.kv_connector_extra_config
            )
            extra["side_channel_port"] = port
        kw["kv_transfer_config"] = kvt
        for name in ("kv_eviction", "ec_transfer_config"):
            if isinstance(kw[name], str):
                import json

                try:
                    kw[name] = json.loads(kw[name])
                except json.JSONDecodeError as e:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"{flag} is not valid JSON: {e}") from None
        return kw

    def create_engine_config(self) -> EngineConfig:
        """The validated `EngineConfig` (its ValueError names a bad option)."""
        return EngineConfig(**self.config_kwargs())
