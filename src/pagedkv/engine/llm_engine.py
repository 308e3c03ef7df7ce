"""`LLMEngine`: requests in, tokens out, one `step()` at a time.

``add_request`` validates and queues; ``step`` schedules one batch, runs the model, samples,
appends tokens (which hashes newly full blocks), applies stop conditions, frees finished
requests and returns the outputs of every request that progressed. ``abort_request`` frees a
request wherever it is. Invalid input raises ValueError and leaves the engine untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagedkv.core.hashing import get_hash_fn_by_name
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.planning import blocks_per_request, make_kv_cache_config
from pagedkv.core.request import RequestStatus, get_request_block_hasher
from pagedkv.core.specs import get_kv_cache_groups
from pagedkv.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig, check_kv_cache_fits
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.request import Request
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.kv_transfer.offloading_connector import OffloadingConnector
from pagedkv.models.loader import get_model
from pagedkv.models.tokenizer import DetokenizeState
from pagedkv.ops.kv_cache import allocate_kv_cache

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = get_model(config.model, config.dtype, config.device)
        self.model = loaded.model
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        self.device = torch.device(config.device)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        groups = get_kv_cache_groups(mc.kv_cache_specs(config.block_size, torch_dtype=str(self.dtype).split(".")[-1]))
        layer_groups, layer_slots = self._layer_placement(groups)
        if len(groups) > 1 and config.kv_offload:
            raise ValueError("kv_offload supports models with one KV cache group; this model's "
                             f"{len(groups)} groups (hybrid full + sliding-window attention) are not offloaded yet")
        kv_memory = self._kv_cache_memory()
        # vLLM's rule: refuse to start when one max_model_len request cannot fit (also with an
        # explicit num_kv_blocks, which would otherwise start and thrash later).
        check_kv_cache_fits(config, groups, self.max_model_len, kv_memory)
        self.kv_cache_config = make_kv_cache_config(
            groups, kv_memory, self.max_model_len, config.max_num_batched_tokens,
            num_blocks_override=config.num_kv_blocks, layout=config.kv_cache_layout)
        # One tensor per layer slot of the largest group: layer j of every group uses tensor j
        # (vLLM's sharing: a block id belongs to one group at a time, so groups never collide).
        self.kv_buffer, tensors = allocate_kv_cache(
            config.kv_cache_layout, max(layer_slots) + 1, self.kv_cache_config.num_blocks, config.block_size,
            mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        self.kv_caches = [tensors[j] for j in layer_slots]
        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_config, self.max_model_len, enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            # KV events report where the blocks live: host memory on a CPU engine, not "GPU".
            medium="CPU" if self.device.type == "cpu" else "GPU")
        self.connector = self._make_connector(loaded.source)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len, self.connector)
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, self.device, layer_groups)
        self.sampler = Sampler(config.seed)
        self.block_hasher = get_request_block_hasher(
            config.block_size, get_hash_fn_by_name(config.prefix_caching_hash_algo))
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else mc.eos_token_id
        self.samples: dict[str, list[Request]] = {}  # user request id -> its samples
        self.block_size = config.block_size
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), max_model_len %d",
                    self.kv_cache_config.num_blocks, config.block_size,
                    self.kv_buffer.numel() * self.kv_buffer.element_size() / 2**30, self.max_model_len)

    def _layer_placement(self, groups: list[Any]) -> tuple[list[int], list[int]]:
        """``(group of each layer, its slot in that group)``; the slot picks the KV tensor."""
        mc = self.model_config
        where = {name: (g, j) for g, grp in enumerate(groups) for j, name in enumerate(grp.layer_names)}
        missing = [mc.layer_name(i) for i in range(mc.num_layers) if mc.layer_name(i) not in where]
        if missing:
            raise ValueError(f"layers {missing[:4]} belong to no KV cache group")
        if len({g.kv_cache_spec.block_size for g in groups}) > 1:
            raise NotImplementedError("KV cache groups with different block sizes are not served yet: "
                                      f"{[g.kv_cache_spec.block_size for g in groups]}")
        placement = [where[mc.layer_name(i)] for i in range(mc.num_layers)]
        return [g for g, _ in placement], [j for _, j in placement]

    def _make_connector(self, model_path: Any) -> OffloadingConnector | None:
        c = self.config
        if not c.kv_offload:
            return None
        mc = self.model_config
        return OffloadingConnector.from_spec(
            c.kv_offload, model_path=model_path, dtype=self.dtype, block_size=c.block_size,
            layout=c.kv_cache_layout, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
            head_size=mc.head_dim, kv_buffer=self.kv_buffer, cache_policy=c.kv_offload_cache_policy,
            store_threshold=c.kv_offload_store_threshold, preemption_mode=c.preemption_mode)

    def _kv_cache_memory(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.gpu_memory_utilization)
        return DEFAULT_CPU_KV_CACHE_MEMORY

    # ---- requests -------------------------------------------------------------------------------

    @property
    def num_usable_kv_tokens(self) -> int:
        return (self.kv_cache_config.num_blocks - 1) * self.block_size

    def tokenize_prompt(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """``(token ids, prompt text or None)``. Thread-safe: it reads only the tokenizer, so a
        server tokenizes on a worker thread, never on the thread that steps the engine."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return list(prompt), None
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Validate and queue a request. ValueError (nothing queued) on bad input."""
        params = params or SamplingParams()
        if request_id in self.samples:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids, text = self.process_prompt(prompt)
        limit = self.max_model_len - len(token_ids)
        max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        req = self._new_request(request_id, token_ids, text, params, max(max_tokens, 1), 0,
                                arrival_time, cache_salt)
        req.fork_pending = params.n - 1
        self.samples[request_id] = [req]
        self.num_prompt_tokens += len(token_ids)
        self.scheduler.add_request(req)

    def process_prompt(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """Tokenize and validate ``prompt``: ``(token ids, text)``, or ValueError. Thread-safe
        (reads only the tokenizer and fixed configuration): `AsyncLLM` runs it on a worker
        thread first, so a huge prompt neither stalls the engine loop nor reaches it."""
        token_ids, text = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
        return token_ids, text

    def _validate_prompt(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n > self.max_model_len:
            raise ValueError(f"the prompt ({n} tokens) is longer than the maximum model length "
                             f"of {self.max_model_len} tokens")
        usable = self.kv_cache_config.num_usable_blocks
        need = blocks_per_request(self.kv_cache_config.kv_cache_groups, n, self.config.max_num_batched_tokens)
        if need > usable:
            raise ValueError(f"the prompt ({n} tokens) is longer than the whole KV cache "
                             f"({self.num_usable_kv_tokens} tokens in {usable} blocks; it needs {need})")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _new_request(self, rid: str, token_ids: list[int], text: str | None, params: SamplingParams,
                     max_tokens: int, index: int, arrival_time: float | None,
                     cache_salt: str | None) -> Request:
        ktp = params.kv_transfer_params or {}
        req = Request(request_id=rid if index == 0 else f"{rid}#{index}",
                      prompt_token_ids=token_ids, block_hasher=self.block_hasher,
                      cache_salt=cache_salt, sampling_params=params, prompt=text,
                      kv_transfer_params=params.kv_transfer_params,
                      skip_reading_prefix_cache=bool(ktp.get("skip_reading_prefix_cache")),
                      eos_token_id=self.eos_token_id, parent_id=rid, sample_index=index,
                      max_tokens=max_tokens)
        if arrival_time is not None:
            req.metrics.arrival_time = arrival_time
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed + index)
        if self.tokenizer is not None:
            req.detok_state = DetokenizeState(skip_special_tokens=params.skip_special_tokens)
        return req

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort user requests (all their samples) and free their blocks. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            samples = self.samples.pop(rid, [])
            self.scheduler.finish_requests([s.request_id for s in samples], RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.samples)

    def get_num_unfinished_requests(self) -> int:
        return len(self.samples)

    # ---- the step loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it and return the outputs of every request that progressed.

        An exception while running the batch (tier load, forward pass, sampler, stop checks)
        fails only the user requests in that batch: they finish with reason ``"error"`` and
        ``RequestOutput.error`` set, their blocks are freed, and the step returns normally, so
        the engine keeps serving. An exception from the scheduler itself propagates (the
        engine's state is then unknown). A non-``Exception`` (KeyboardInterrupt) fails the
        batch the same way and is re-raised.
        """
        so = self.scheduler.schedule()
        ended = self._cache_exhausted(so.finished)
        if so.is_empty:
            if self.scheduler.has_unfinished_requests() and not ended:
                time.sleep(0.0005)  # requests wait on tier I/O: yield the CPU to its threads
            return ended
        try:
            return ended + self._run_batch(so)
        except BaseException as e:
            logger.exception("engine step failed; failing the %d requests of its batch", len(so.scheduled))
            failed = self._fail_batch(so, e)
            if not isinstance(e, Exception):
                raise
            return ended + failed

    def _run_batch(self, so: SchedulerOutput) -> list[RequestOutput]:
        """Load external KV, run the forward pass, sample and append one token per sampling
        request; the outputs of the requests that got a token."""
        if self.connector is not None:
            self.connector.start_load_kv()
        logits = self.runner.execute_model(so)
        if self.connector is not None:
            self.connector.save_kv((s.request, s.block_ids[0], s.start + s.num_tokens) for s in so.scheduled)
        sampling = [s.request for s in so.scheduled if s.samples]
        if not sampling:  # only prefill chunks that do not reach the end of their prompts
            return []
        rows: list[int] = []
        reqs: list[Request] = []
        forks: list[tuple[Request, Request]] = []
        for j, req in enumerate(sampling):
            rows.append(j)
            reqs.append(req)
            if req.fork_pending and req.num_output_tokens == 0:
                for i in range(1, req.fork_pending + 1):
                    child = self._fork_child(req, i)
                    forks.append((req, child))
                    rows.append(j)
                    reqs.append(child)
                req.fork_pending = 0
        if rows != list(range(len(sampling))):
            logits = logits[torch.tensor(rows)]
        out = self.sampler(logits, reqs)
        for parent, child in forks:  # before any parent may finish and free its blocks
            self.scheduler.fork(parent, child)
        now = time.monotonic()
        touched: dict[str, None] = {}
        for req, token, lp, slp in zip(reqs, out.token_ids, out.logprobs, out.sampled_logprobs):
            self._append_token(req, token, lp, slp, now)
            touched[req.parent_id] = None
        return [self._make_output(rid) for rid in touched]

    def _fail_batch(self, so: SchedulerOutput, err: BaseException) -> list[RequestOutput]:
        """Finish every user request of the failed batch ``so`` with reason "error".

        Their blocks' prefix-cache hashes are dropped first: allocation registered the hashes
        of blocks this batch was to write (or load from a tier), so their KV may be missing or
        half written and must never be served as a cache hit. Dropping a hash only costs a
        future hit; blocks shared with surviving requests keep their references. Pending
        copy-on-write copies into the failed requests' blocks are dropped too (those blocks
        go back to the pool). Returns one finished output per failed user request.
        """
        message = f"{type(err).__name__}: {err}"
        kv = self.kv_cache_manager
        for s in so.scheduled:  # this batch's tokens were not computed
            s.request.num_computed_tokens = min(s.request.num_computed_tokens, s.start)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for rid in dict.fromkeys(s.request.parent_id for s in so.scheduled):
            samples = self.samples.get(rid)
            if samples is None:
                continue  # already finished and reported before the failure
            live = [r for r in samples if not r.is_finished]
            block_ids = {b for r in live for group in kv.get_block_ids(r.request_id) for b in group}
            kv.evict_blocks(sorted(block_ids))
            self.scheduler.pending_copies = [(src, dst) for src, dst in self.scheduler.pending_copies
                                             if dst not in block_ids]
            self.scheduler.finish_requests([r.request_id for r in live], RequestStatus.FINISHED_ABORTED)
            for r in live:
                r.finish_reason = "error"
                r.metrics.finished_time = now
            outputs.append(self._make_output(rid, error=message))
        return outputs

    def _cache_exhausted(self, reqs: list[Request]) -> list[RequestOutput]:
        """Outputs for requests the scheduler stopped because their sequence outgrew the whole
        KV cache (finish_reason "length", like reaching max_model_len; logged once each)."""
        now = time.monotonic()
        for req in reqs:
            logger.warning("request %s stopped at %d tokens: the whole KV cache (%d tokens) cannot "
                           "hold more", req.request_id, req.num_tokens, self.num_usable_kv_tokens)
            req.finish_reason = "length"
            self._close(req, now)
        return [self._make_output(rid) for rid in dict.fromkeys(r.parent_id for r in reqs)]

    def _fork_child(self, parent: Request, index: int) -> Request:
        child = self._new_request(parent.parent_id, parent.prompt_token_ids, parent.prompt,
                                  parent.sampling_params, parent.max_tokens, index, None,
                                  parent.cache_salt)
        child.metrics.arrival_time = parent.metrics.arrival_time
        self.samples[parent.parent_id].append(child)
        return child

    def _append_token(self, req: Request, token: int, lp: Any, sampled_lp: float | None, now: float) -> None:
        req.append_output_token_ids(token)
        self.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if lp is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(lp)
            req.cumulative_logprob += sampled_lp or 0.0
        if req.detok_state is not None:
            req.output_text += self.tokenizer.decode_incremental(req.detok_state, [token])
        status = self._check_stop(req, token)
        if status is not None:
            self._close(req, now)
            self.scheduler.finish(req, status)

    def _close(self, req: Request, now: float) -> None:
        """A request just finished: flush text held back for an incomplete character (not
        after a stop string: the text was cut there on purpose) and stamp the finish time."""
        if req.detok_state is not None and not isinstance(req.stop_reason, str):
            req.output_text += self.tokenizer.decode_incremental(req.detok_state, [], final=True)
        req.metrics.finished_time = now

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token == req.eos_token_id:
                req.finish_reason = "stop"
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", token
                return RequestStatus.FINISHED_STOPPED
            if p.stop_strings and self._truncate_at_stop(req):
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _truncate_at_stop(self, req: Request) -> bool:
        p = req.sampling_params
        text = req.output_text
        for stop in p.stop_strings:
            at = text.find(stop)
            if at >= 0:
                req.output_text = text[:at + len(stop)] if p.include_stop_str_in_output else text[:at]
                req.finish_reason, req.stop_reason = "stop", stop
                return True
        return False

    def _make_output(self, rid: str, error: str | None = None) -> RequestOutput:
        """The cumulative output of user request ``rid``; once finished (or failed with
        ``error``: finished whatever its samples) the request is forgotten."""
        samples = self.samples[rid]
        first = samples[0]
        n = first.sampling_params.n
        finished = error is not None or (len(samples) == n and all(s.is_finished for s in samples))
        outputs = [CompletionOutput(
            index=s.sample_index, text=s.output_text, token_ids=list(s.output_token_ids),
            finish_reason=s.finish_reason, stop_reason=s.stop_reason, logprobs=s.logprobs,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None)
            for s in samples]
        if finished:
            del self.samples[rid]
        return RequestOutput(request_id=rid, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=outputs,
                             finished=finished, num_cached_tokens=max(first.num_cached_tokens, 0),
                             metrics=first.metrics, error=error)

    # ---- introspection ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants()

    def stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        pc = kv.total_prefix_cache_stats
        return {
            "num_blocks": self.kv_cache_config.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": kv.num_free_blocks,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "external_cache_hits": pc.external_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generated_tokens,
            "offload": self.offload_stats(),
        }

    def offload_stats(self) -> dict[str, Any]:
        """Per-tier usage and hits (empty without tiers)."""
        if self.connector is None:
            return {}
        from dataclasses import asdict
        out: dict[str, Any] = {name: asdict(st) for name, st in self.connector.get_stats().items()}
        out["loaded_tokens"] = self.connector.num_loaded_tokens
        out["stored_blocks"] = self.connector.num_stored_blocks
        return out

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None
            self.scheduler.connector = None
