"""Token eviction: a request keeps only part of its tokens' KV (seed §8.2; OpenVINO GenAI's
``CacheEvictionConfig``). Torch-free: the policy, its arithmetic and the block ceilings that
`KVCacheManager`, the scheduler and ``pagedkv plan`` share.

Unlike page eviction (which only costs recomputation), dropping tokens changes what the model
can ever see again, so every policy is opt-in (per request, ``SamplingParams.kv_eviction``, or
per engine, ``EngineConfig.kv_eviction``) and measured by ``benchmarks/bench_lossy_kv.py``.

Policies (vLLM-style names; the papers' defaults):

* ``"streaming"`` (StreamingLLM): the first ``sink_tokens`` tokens (attention sinks, kept as
  whole blocks: ``cdiv(sink_tokens, bs)`` of them) and a rolling window of at least
  ``recent_tokens`` tokens. Before each step the oldest non-sink block is released while the
  window would still hold ``recent_tokens`` tokens without it, exactly as a sliding-window
  group releases blocks, but from the middle of the table. A prefill is cut into chunks of at
  most :meth:`KVEvictionConfig.chunk_tokens` that end on block boundaries (but the last), so
  every token reads the sinks and between ``recent_tokens`` and
  ``recent_tokens + block_size + chunk - 1`` tokens before it.
  ``positions="original"`` keeps each token's position in the text (RoPE is applied once, at
  write time); ``"cache"`` is the paper's choice, positions within the cache: queries take
  their index in the cache, and the window's keys are re-rotated back by a block each time a
  block leaves (what storing keys before RoPE and rotating at read time amounts to).
* ``"snapkv"`` (SnapKV; H2O's accumulated scores over an observation window): when the
  compression point is computed (the end of the prompt, or ``compress_at`` prompt tokens),
  each layer and KV head keeps the sinks, the last ``recent_tokens`` tokens (the observation
  window) and the earlier tokens the window's queries attend to most (softmax scores summed
  over the window, averaged over the query heads of the KV head, average-pooled over
  ``pool_kernel`` neighbours), ``budget_tokens`` in all. The kept tokens are compacted into
  fresh blocks (the block table and slot mapping stay the only indirection, so the attention
  kernels read them unchanged; a KV head's slot ``j`` holds that head's ``j``-th kept token).
  Positions stay the original ones.
* ``"pyramidkv"`` (PyramidKV): SnapKV with per-layer budgets that shrink linearly with depth
  (the compressible part, ``budget - sink - recent``, goes from ``2c - c/20`` at the first
  layer to ``c/20`` at the last; their mean is ``budget_tokens``). A block holds every
  layer's KV for its tokens, so the request's table is sized for the first (largest) layer;
  each deeper layer fills only the first ``budget_l`` cache indices of its kept part and then
  writes its later tokens ``budget_0 - budget_l`` indices earlier (a per-layer shift of the
  slot mapping and ``seq_lens``). It re-spends SnapKV's accuracy between layers; it saves no
  memory over SnapKV at the first layer's budget.

The KV of a token is indexed by its *cache index* ``position - num_evicted_tokens``; slot
mappings and ``seq_lens`` are in cache indices, RoPE positions are not (``"cache"`` positions
aside). Blocks computed before the request's first eviction (its ``onset``) hold exactly what
an uncompressed request computes: they are cached under their ordinary hashes, so prefix hits
inside the uncompressed prefix still work. Later blocks carry the policy in their hashes'
extra keys and are never registered (their bytes depend on the step schedule), so they are
never served to anyone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.core.units import cdiv

POLICIES = ("streaming", "snapkv", "pyramidkv")
# The widest score pooling a request may ask for (SnapKV uses 7; wider costs O(tokens x width)).
MAX_POOL_KERNEL = 255
# PyramidKV's beta: the top layer keeps 1/beta of the compressible budget (the paper's 20).
PYRAMID_BETA = 20
POSITIONS = ("original", "cache")
# Keys a kv_eviction dict may carry (vLLM users pass it as JSON).
FIELDS = (
    "policy",
    "sink_tokens",
    "recent_tokens",
    "budget_tokens",
    "compress_at",
    "pool_kernel",
    "positions",
)


class KVEvictionError(ValueError):
    """A kv_eviction setting that cannot work (raised before anything is scheduled)."""


@dataclass(frozen=True, slots=True)
class KVEvictionConfig:
    """One token-eviction policy (module docstring).

    ``budget_tokens``: streaming: the cache tokens a request keeps, ``sink + recent`` by
    default (``recent_tokens`` defaults to ``budget_tokens - sink_tokens``); snapkv: the tokens
    kept per layer and KV head at compression (required). ``compress_at`` (snapkv): compress
    once this many prompt tokens are computed instead of at the prompt's end (a long document
    compressed before the question; the rest of the prompt then reads the compressed cache).
    """

    policy: str
    sink_tokens: int = 4
    recent_tokens: int | None = None
    budget_tokens: int | None = None
    compress_at: int | None = None
    pool_kernel: int = 7
    positions: str = "original"
    # The attention layers holding KV (set by the engine; PyramidKV's budgets depend on it).
    num_layers: int = 1

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> KVEvictionError:
            return KVEvictionError(f"kv_eviction.{name}={getattr(self, name)!r}: {why}")

        if self.policy not in POLICIES:
            raise bad("policy", f"must be one of {', '.join(POLICIES)}")
        for name in ("sink_tokens", "pool_kernel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(name, "must be an integer >= 0")
        if self.pool_kernel % 2 == 0 or self.pool_kernel > MAX_POOL_KERNEL:
            raise bad(
                "pool_kernel", f"must be odd (a centred window) and at most {MAX_POOL_KERNEL}"
            )
        for name in ("recent_tokens", "budget_tokens", "compress_at"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise bad(name, "must be an integer >= 1")
        if self.positions not in POSITIONS:
            raise bad("positions", f"must be one of {', '.join(POSITIONS)}")
        if self.policy == "streaming":
            if self.recent_tokens is None and self.budget_tokens is None:
                raise bad("budget_tokens", "streaming needs budget_tokens or recent_tokens")
            if self.recent_tokens is None:
                if self.budget_tokens <= self.sink_tokens:  # type: ignore[operator]
                    raise bad("budget_tokens", "must exceed sink_tokens")
                object.__setattr__(self, "recent_tokens", self.budget_tokens - self.sink_tokens)
            if self.budget_tokens is None:
                object.__setattr__(self, "budget_tokens", self.sink_tokens + self.recent_tokens)
            if self.sink_tokens + self.recent_tokens > self.budget_tokens:  # type: ignore[operator]
                raise bad("budget_tokens", "must be >= sink_tokens + recent_tokens")
            if self.compress_at is not None:
                raise bad("compress_at", "is a snapkv setting")
        else:
            if self.budget_tokens is None:
                raise bad("budget_tokens", f"{self.policy} needs budget_tokens")
            if self.recent_tokens is None:
                object.__setattr__(self, "recent_tokens", 32)  # SnapKV's observation window
            if self.positions != "original":
                raise bad("positions", f"{self.policy} keeps original positions")
            if self.sink_tokens + self.recent_tokens > self.budget_tokens:  # type: ignore[operator]
                raise bad("budget_tokens", "must be >= sink_tokens + recent_tokens")

    @classmethod
    def from_value(cls, value: Any) -> KVEvictionConfig | None:
        """A config from a dict (``{"policy": "streaming", "budget_tokens": 512}``), a config,
        or None. Unknown keys are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise KVEvictionError(f"kv_eviction must be a dict or None, got {type(value).__name__}")
        unknown = set(value) - set(FIELDS)
        if unknown:
            raise KVEvictionError(
                f"kv_eviction: unknown keys {sorted(unknown)} (known: {', '.join(FIELDS)})"
            )
        if "policy" not in value:
            raise KVEvictionError(f"kv_eviction needs a policy ({', '.join(POLICIES)})")
        return cls(**value)

    @property
    def key(self) -> tuple[Any, ...]:
        """What enters the block hashes' extra keys of the blocks after the onset."""
        return (
            self.policy,
            self.sink_tokens,
            self.recent_tokens,
            self.budget_tokens,
            self.compress_at,
            self.pool_kernel,
            self.positions,
            self.num_layers if self.policy == "pyramidkv" else 1,
        )

    # ---- streaming arithmetic ----------------------------------------------------------------

    def sink_blocks(self, block_size: int) -> int:
        return cdiv(self.sink_tokens, block_size)

    def chunk_tokens(self, block_size: int) -> int | None:
        """The longest prefill chunk a streaming request runs (whole blocks, at least one):
        a quarter of the window; the scheduler also ends every chunk but the last on a block
        boundary. None (no cap) for snapkv and pyramidkv."""
        if self.policy != "streaming":
            return None
        assert self.recent_tokens is not None
        return max(block_size, self.recent_tokens // 4 // block_size * block_size)

    def num_blocks_to_evict(self, kv_tokens: int, block_size: int) -> int:
        """Streaming: how many of the oldest non-sink blocks to release before a step, given
        the request's ``kv_tokens`` computed tokens in the cache: as many as leave at least
        ``recent_tokens`` non-sink tokens."""
        if self.policy != "streaming":
            return 0
        assert self.recent_tokens is not None
        window = kv_tokens - self.sink_blocks(block_size) * block_size
        return max(0, (window - self.recent_tokens) // block_size)

    def onset(self, block_size: int, num_prompt_tokens: int) -> int:
        """Whole blocks before this position are computed with no eviction before them
        (exact, so cacheable): streaming: sinks + window + one block; snapkv: the compression
        point; rounded down to a block boundary."""
        if self.policy == "streaming":
            assert self.recent_tokens is not None
            end = self.sink_blocks(block_size) * block_size + self.recent_tokens + block_size
        else:
            end = self.compression_point(num_prompt_tokens)
        return end // block_size * block_size

    def max_prefix_hit(self, block_size: int, num_prompt_tokens: int) -> int:
        """The longest prefix-cache hit a new request may adopt: a streaming request never
        holds more than its sinks and window at admission."""
        if self.policy == "streaming":
            assert self.recent_tokens is not None
            return self.sink_blocks(block_size) * block_size + self.recent_tokens
        return self.compression_point(num_prompt_tokens)

    # ---- snapkv / pyramidkv arithmetic ---------------------------------------------------------

    @property
    def compacts(self) -> bool:
        """Whether the policy compresses once (snapkv, pyramidkv) rather than rolling."""
        return self.policy != "streaming"

    def layer_budgets(self) -> list[int]:
        """Tokens each of the ``num_layers`` attention layers keeps at compression (before
        capping at the tokens there are): all ``budget_tokens`` for snapkv; PyramidKV's
        linear schedule, largest first, for pyramidkv."""
        assert self.budget_tokens is not None and self.recent_tokens is not None
        n = self.num_layers
        if self.policy != "pyramidkv" or n == 1:
            return [self.budget_tokens] * n
        fixed = self.sink_tokens + self.recent_tokens
        c = self.budget_tokens - fixed
        lo = c // PYRAMID_BETA
        hi = 2 * c - lo
        return [fixed + round(hi - (hi - lo) * i / (n - 1)) for i in range(n)]

    def kept_tokens(self, num_tokens: int) -> list[int]:
        """Per layer, the tokens kept when ``num_tokens`` are compressed."""
        return [min(b, num_tokens) for b in self.layer_budgets()]

    def compression_point(self, num_prompt_tokens: int) -> int:
        """snapkv: the number of computed tokens at which the cache is compressed."""
        if self.compress_at is None:
            return num_prompt_tokens
        return min(self.compress_at, num_prompt_tokens)

    def compresses(self, num_prompt_tokens: int) -> bool:
        """Whether compression drops anything (a prompt within every budget is kept)."""
        if not self.compacts:
            return False
        point = self.compression_point(num_prompt_tokens)
        return min(self.layer_budgets()) < point

    # ---- capacity ----------------------------------------------------------------------------

    def max_blocks_per_request(
        self, block_size: int, num_prompt_tokens: int, max_new_tokens: int
    ) -> int:
        """The most blocks one request holds at any step (what ``pagedkv plan`` reports and
        the engine's block tables never exceed): streaming: sinks + window + one block + the
        longest chunk, whatever the length; snapkv: the prompt up to the compression point plus
        the compacted copy (both are held during the compressing step), or the compacted cache
        plus what follows it, whichever is larger."""
        bs = block_size
        total = num_prompt_tokens + max_new_tokens
        if self.policy == "streaming":
            assert self.recent_tokens is not None
            chunk = self.chunk_tokens(bs)
            assert chunk is not None
            sinks = self.sink_blocks(bs)
            # A prefill chunk starts on a block boundary with at most cdiv(recent) window
            # blocks before it; a decode token follows at most recent + bs - 1 window tokens.
            prefill = sinks + cdiv(self.recent_tokens, bs) + chunk // bs
            decode = cdiv(sinks * bs + self.recent_tokens + bs, bs)
            return min(max(prefill, decode), cdiv(total, bs))
        point = self.compression_point(num_prompt_tokens)
        if not self.compresses(num_prompt_tokens):
            return cdiv(total, bs)
        kept = max(self.kept_tokens(point))
        during = cdiv(point, bs) + cdiv(kept, bs)
        after = cdiv(kept + total - point, bs)
        return max(during, after)
