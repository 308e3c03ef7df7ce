"""`LLMEngine`: requests in, tokens out, one `step()` at a time.

``add_request`` validates and queues; ``step`` reads one way through the modules that own
each part of it::

    Scheduler.schedule()            -> SchedulerOutput     which tokens run (scheduler)
    ModelRunner + Sampler           -> ModelRunnerOutput   one token per sampling row
    Scheduler.update_from_output()  -> EngineCoreOutputs   appends, token stops, forks, frees
    OutputProcessor.process_outputs -> RequestOutputs      text, stop strings, outputs

``abort_request`` frees a request wherever it is. Invalid input raises ValueError and leaves
the engine untouched.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pagedkv.core.hashing import get_hash_fn_by_name, resolve_none_hash_seed
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.parallel import check_parallel_sizes
from pagedkv.core.planning import (
    blocks_per_request,
    kivi_residual_bytes,
    kivi_sink_store_bytes,
    kivi_unsupported,
    make_kv_cache_config,
)
from pagedkv.core.request import RequestStatus, get_request_block_hasher
from pagedkv.core.specs import KVCacheConfig, VMMReservation, get_kv_cache_groups
from pagedkv.core.units import format_size
from pagedkv.engine import kv_eviction
from pagedkv.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig, check_kv_cache_fits
from pagedkv.engine.ec_transfer import ECConnector, ECTransferConfig
from pagedkv.engine.executor import Executor, MultiprocExecutor, UniProcExecutor, WorkerDiedError
from pagedkv.engine.kv_scales import resolve_kv_scales
from pagedkv.engine.model_runner import PromptLogprobsOutput
from pagedkv.engine.multimodal import MultiModalProcessor, images_of
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.rank_planning import hybrid_block_size, scheduler_kv_cache_specs
from pagedkv.engine.request import Request
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.sampling_params import SamplingParamError, SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedkv.engine.stats import KVConnectorStats, SchedulerStats
from pagedkv.engine.structured_output import StructuredOutputManager
from pagedkv.engine.vmm import VMM_LAYOUT, vmm_block_size
from pagedkv.engine.vmm import describe as describe_vmm
from pagedkv.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedkv.kv_transfer.config import resolve_offload_config
from pagedkv.kv_transfer.factory import KVConnectorFactory
from pagedkv.models.config import load_model_config
from pagedkv.models.loader import model_identity
from pagedkv.ops import native

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    """Construction reads one way: load the model (its attention layers built with their KV
    cache formats) → plan the KV cache (`KVCacheConfig`) → the KV connector (if configured) →
    the runner, which allocates the KV cache and registers it with the connector → the
    scheduler, which builds its own `KVCacheManager`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Set once a rank died: every later step or new request raises it again.
        self.dead: WorkerDiedError | None = None
        self._check_parallel_model(config)
        # One Worker per rank (`engine/executor.py`); rank 0's lives here and holds the model.
        self.executor = _make_executor(config)
        try:
            self._init(config)
        except BaseException:
            self.executor.shutdown()
            raise

    @staticmethod
    def _check_parallel_model(config: EngineConfig) -> None:
        """Refuse TP/DCP sizes this model's heads cannot split, before any process starts."""
        if config.tensor_parallel_size == 1:
            return
        mc = load_model_config(config.model)
        check_parallel_sizes(
            config.tensor_parallel_size,
            config.decode_context_parallel_size,
            mc.num_attention_heads,
            mc.num_kv_heads,
            config.cp_kv_cache_interleave_size,
        )
        if config.decode_context_parallel_size > 1 and (
            mc.sliding_window or mc.attention_chunk_size or mc.mamba is not None
        ):
            raise ValueError(
                "decode_context_parallel_size > 1 supports full-attention models only (this "
                "model has sliding-window, chunked or Mamba layers)"
            )

    def _init(self, config: EngineConfig) -> None:
        loaded = self.executor.driver.loaded
        self.model = loaded.model
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and not native.cpu_has_half_matmul(self.dtype):
            logger.warning(
                "dtype %s on a CPU without %s matmuls (no AVX-512 or AMX for it): linear layers "
                "compute in float32 and round to %s (torch would emulate the %s matmul, several "
                "times slower); other ops stay %s, so dtype='float32' is as fast and exact",
                *[str(self.dtype).split(".")[-1]] * 5,
            )
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            # The rotary tables stop there: a longer request would fail mid-prefill (vLLM
            # refuses it too, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN, which pagedkv does not offer).
            raise ValueError(
                f"invalid engine option max_model_len={config.max_model_len}: greater than the "
                f"model's context length (max_position_embeddings={mc.max_position_embeddings})"
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.config = config = self._vmm_block_size(self._align_hybrid_block_size(config))
        # The scheduler's tokens per block (with DCP: a virtual block spread over the ranks).
        self.block_size = config.block_size * config.decode_context_parallel_size
        self.kv_cache_config = self._plan_kv_cache()
        self.mm_processor = self._multimodal_processor(loaded)
        self.ec = self._ec_connector(loaded)
        self.connector = self._make_connector(model_identity(loaded.source))
        self._warn_small_cpu_tier()
        self.executor.initialize_kv_cache(self.kv_cache_config, self.connector)
        self.runner = self.executor.driver.runner
        self.runner.encoder_cache.budget = config.encoder_cache_size
        self.kv_scales, self.kv_scales_source = resolve_kv_scales(self, loaded.kv_scales)
        self.scheduler = Scheduler(
            self.kv_cache_config,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.connector,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            # KV events report where the blocks live: host memory on a CPU engine, not "GPU".
            kv_cache_medium="CPU" if self.device.type == "cpu" else "GPU",
        )
        self.sampler = Sampler(config.seed)
        # Groups of different block sizes hash at the gcd of them (vLLM's hash_block_size).
        self.block_hasher = get_request_block_hasher(
            self.scheduler.kv_cache_manager.hash_block_size,
            get_hash_fn_by_name(config.prefix_caching_hash_algo),
        )
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else mc.eos_token_id
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, config.structured_outputs_backend
        )
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        kv_buffer = self.runner.kv_buffer
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB), max_model_len %d",
            self.kv_cache_config.num_blocks,
            config.block_size,
            kv_buffer.numel() * kv_buffer.element_size() / 2**30,
            self.max_model_len,
        )

    def _align_hybrid_block_size(self, config: EngineConfig) -> EngineConfig:
        """A Mamba hybrid needs attention pages that hold a Mamba state: raise the block size
        as vLLM does (`align_hybrid_block_size`), and say so."""
        block_size = hybrid_block_size(
            config, self.model_config, str(self.dtype).split(".")[-1], config.block_size
        )
        if block_size == config.block_size:
            return config
        logger.info(
            "hybrid Mamba model: block size %d -> %d tokens, so that one attention page holds "
            "one Mamba state (prefix hits and Mamba checkpoints fall on multiples of it)",
            config.block_size,
            block_size,
        )
        config = copy.copy(config)  # not replace(): that would validate (and resolve) it twice
        config.block_size = block_size
        return config

    def _multimodal_processor(self, loaded: Any) -> MultiModalProcessor | None:
        """The image processor of a vision-language model (None: the model takes text only)."""
        model = self.model
        if not hasattr(model, "encode_images"):
            return None
        if self.config.tensor_parallel_size > 1:
            raise ValueError(f"{type(model).__name__} runs one rank (no tensor parallelism)")
        source = Path(loaded.source)
        return MultiModalProcessor(
            source if source.is_dir() else None,
            model.image_token_id,
            model.image_seq_length,
            model.image_size,
        )

    def _ec_connector(self, loaded: Any) -> ECConnector | None:
        """EPD (`engine.ec_transfer`): this instance's encoder-cache connector, or None."""
        cfg = ECTransferConfig.from_value(self.config.ec_transfer_config)
        if cfg is None:
            return None
        if self.mm_processor is None:
            raise ValueError(
                f"ec_transfer_config needs a vision-language model; {type(self.model).__name__} "
                "takes no images"
            )
        return ECConnector(
            cfg,
            model_identity(loaded.source),
            self.mm_processor.image_seq_length,
            self.model_config.hidden_size,
            self.dtype,
        )

    def encode_images(self, items: list[Any]) -> dict[str, Any]:
        """EPD producer: encode each image (`ImageItem`) not already in the encoder cache,
        publish the outputs and return the ``ec_transfer_params`` a consumer reads them with.
        Runs on the engine thread (it uses the model). ValueError unless this engine is an
        ``ec_producer``."""
        if self.ec is None or self.ec.producer is None:
            raise ValueError("this instance is not an encoder (ec_role ec_producer / ec_both)")
        cache = self.runner.encoder_cache
        outputs = {}
        for item in items:
            ident = item.feature.identifier
            if ident not in outputs:
                outputs[ident] = cache.get(
                    ident,
                    "ec-producer",
                    lambda px=item.pixel_values: self.model.encode_images(px[None])[0],
                )
        cache.release("ec-producer")
        return self.ec.publish(outputs)

    def process_images(
        self, prompt: PromptType, token_ids: list[int]
    ) -> tuple[list[int], list[Any]]:
        """``(token ids with placeholder runs, ImageItems)`` of a prompt with images (the ids
        unchanged and no items without). ValueError for images a text model is given, a
        mismatch of placeholders and images, or a bad image (`multimodal.ImageError`).
        Thread-safe, like `process_prompt` (AsyncLLM runs it off the engine thread)."""
        if isinstance(prompt, dict) and "mm_items" in prompt:  # processed by AsyncLLM already
            return token_ids, list(prompt["mm_items"])
        images = images_of(prompt)
        if not images:
            return token_ids, []
        if self.mm_processor is None:
            raise ValueError(f"{type(self.model).__name__} takes no images")
        token_ids, items = self.mm_processor.process(token_ids, images)
        self._validate_prompt(token_ids)
        params = prompt.get("ec_transfer_params") if isinstance(prompt, dict) else None
        if params and self.ec is not None and self.ec.config.is_consumer:
            # EPD: the encoder instance's outputs, read now (off the engine thread under
            # AsyncLLM); what cannot be read is encoded locally when a chunk needs it.
            fetched = self.ec.fetch(params, [i.feature.identifier for i in items])
            for ident, value in fetched.items():
                self.runner.encoder_cache.offer(ident, value)
        return token_ids, items

    def _vmm_block_size(self, config: EngineConfig) -> EngineConfig:
        """vmm mode (`engine.vmm`): the block is one physical page, so the block size is the
        page's tokens and the layout the physical pages' (ValueError for a model the mode
        does not run)."""
        if config.kv_cache_memory_mode != "vmm":
            return config
        specs = scheduler_kv_cache_specs(
            config, self.model_config, str(self.dtype).split(".")[-1], config.block_size
        )
        block_size = vmm_block_size(get_kv_cache_groups(specs), config.vmm_page_size)
        config = copy.copy(config)  # not replace(): see _align_hybrid_block_size
        config.block_size, config.kv_cache_layout = block_size, VMM_LAYOUT
        return config

    def _plan_kv_cache(self) -> KVCacheConfig:
        """The model's KV cache specs → groups → a pool sized from the configured memory.
        Refuses (ValueError) when one ``max_model_len`` request cannot fit (vLLM's rule, also
        with an explicit ``num_kv_blocks``, which would otherwise start and thrash later)."""
        config = self.config
        dcp = config.decode_context_parallel_size
        specs = scheduler_kv_cache_specs(
            config, self.model_config, str(self.dtype).split(".")[-1], config.block_size
        )
        groups = get_kv_cache_groups(specs)
        if config.kv_transfer_config is not None:  # a connector's limits come before sizing
            KVConnectorFactory.get_connector_class(config.kv_transfer_config).check_kv_cache_groups(
                groups
            )
        # Per rank; with DCP each rank's memory holds 1/dcp of every (virtual) block.
        kv_memory = self._kv_cache_memory() * dcp
        residual = kivi_residual_bytes(groups)  # KIVI: a residual row per max_num_seqs
        why = kivi_unsupported(groups)
        if residual and (dcp > 1 or config.kv_cache_memory_mode == "vmm"):
            why = "a KIVI cache cannot be combined with decode context parallelism or vmm"
        if why is not None:
            raise ValueError(why)
        kv_memory -= config.max_num_seqs * residual + kivi_sink_store_bytes(groups)
        check_kv_cache_fits(config, groups, self.max_model_len, kv_memory)
        kv_cache_config = make_kv_cache_config(
            groups,
            kv_memory,
            self.max_model_len,
            config.max_num_batched_tokens,
            num_blocks_override=config.num_kv_blocks,
            layout=config.kv_cache_layout,
        )
        kv_cache_config.prefix_cache_retention_interval = config.prefix_cache_retention_interval
        kv_cache_config.kivi_rows = config.max_num_seqs if residual else 0
        if config.kv_cache_memory_mode == "vmm":
            # A row holds a max_model_len request; the step never has more than max_num_seqs.
            blocks = -(-self.max_model_len // config.block_size)
            kv_cache_config.vmm = VMMReservation(config.max_num_seqs, blocks)
            logger.info("%s", describe_vmm(kv_cache_config))
        return kv_cache_config

    def _warn_small_cpu_tier(self) -> None:
        """Loads from the disk, Redis and P2P tiers pass through the CPU tier: a prefix longer
        than the CPU tier holds never comes back from them. Say so at start-up."""
        kvt = self.config.kv_transfer_config
        offload = resolve_offload_config(kvt) if kvt is not None else None
        if offload is None or not (offload.disk or offload.redis or offload.p2p):
            return
        per_token = self.kv_cache_config.bytes_per_block / max(self.block_size, 1)
        tokens = int(offload.cpu.capacity_bytes / per_token)
        if tokens < self.max_model_len:
            logger.warning(
                "the CPU tier holds %d tokens of KV (%s), fewer than max_model_len %d: prefixes "
                "longer than that are never loaded back from the tiers behind it (disk, Redis, "
                "P2P), whose loads pass through the CPU tier; give it at least %s",
                tokens,
                format_size(offload.cpu.capacity_bytes),
                self.max_model_len,
                format_size(int(per_token * self.max_model_len)),
            )

    def _make_connector(self, identity: str) -> KVConnectorBase | None:
        kvt = self.config.kv_transfer_config
        if kvt is None:
            return None
        algo = self.config.prefix_caching_hash_algo
        seed = f"{algo}:{resolve_none_hash_seed(get_hash_fn_by_name(algo))}"
        return KVConnectorFactory.create_connector(
            kvt,
            KVConnectorRole.SCHEDULER,
            self.kv_cache_config,
            model_identity=identity,
            hash_seed=seed,
        )

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.runner.kv_buffer

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.runner.kv_caches

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

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request. ValueError (nothing queued) on bad input;
        `WorkerDiedError` once a rank of the engine died."""
        if self.dead is not None:
            raise WorkerDiedError(f"the engine is dead: {self.dead}")
        params = params or SamplingParams()
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids, text = self.process_prompt(prompt)
        token_ids, images = self.process_images(prompt, token_ids)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids or []):  # the sampler indexes by them
            raise SamplingParamError(
                "stop_token_ids",
                params.stop_token_ids,
                f"token ids must be < {vocab} (the vocabulary size)",
            )
        limit = self.max_model_len - len(token_ids)
        max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        req = self._new_request(
            request_id,
            token_ids,
            text,
            params,
            max(max_tokens, 1),
            arrival_time,
            cache_salt,
            images,
        )
        if params.structured_outputs is not None:
            req.grammar = self.structured_output_manager.grammar_for(params.structured_outputs)
        req.fork_pending = params.n - 1
        self.output_processor.add_request(req)
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
            raise ValueError(
                f"the prompt ({n} tokens) is longer than the maximum model length "
                f"of {self.max_model_len} tokens"
            )
        usable = self.kv_cache_config.num_usable_blocks
        need = blocks_per_request(
            self.kv_cache_config.kv_cache_groups, n, self.config.max_num_batched_tokens
        )
        if need > usable:
            raise ValueError(
                f"the prompt ({n} tokens) is longer than the whole KV cache "
                f"({self.num_usable_kv_tokens} tokens in {usable} blocks; it needs {need})"
            )
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _new_request(
        self,
        rid: str,
        token_ids: list[int],
        text: str | None,
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None,
        cache_salt: str | None,
        images: list[Any] | None = None,
    ) -> Request:
        """Sample 0 of a user request; the scheduler forks the others (`Request.make_child`).

        A request with ``prompt_logprobs`` never reads the prefix cache (vLLM's rule, its
        ``skip_reading_prefix_cache`` defaults to ``prompt_logprobs is not None``): a cached
        position is not computed, so it would have no logits to score its prompt token. Its
        blocks are still cached for later requests."""
        ktp = params.kv_transfer_params or {}
        skip_cache = (
            bool(ktp.get("skip_reading_prefix_cache")) or params.prompt_logprobs is not None
        )
        ev = kv_eviction.resolve(self, params)
        req = Request(
            request_id=rid,
            prompt_token_ids=token_ids,
            block_hasher=self.block_hasher,
            kv_eviction=ev,
            kv_eviction_onset=ev.onset(self.block_size, len(token_ids)) if ev else 0,
            cache_salt=cache_salt,
            sampling_params=params,
            prompt=text,
            kv_transfer_params=params.kv_transfer_params,
            skip_reading_prefix_cache=skip_cache,
            eos_token_id=self.eos_token_id,
            parent_id=rid,
            sample_index=0,
            max_tokens=max_tokens,
            seed=params.seed,
            mm_features=[i.feature for i in images or []],
            mm_inputs=[i.pixel_values for i in images or []],
        )
        if arrival_time is not None:
            req.metrics.arrival_time = arrival_time
        return req

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort user requests (all their samples) and free their blocks. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.scheduler.finish_requests(
                self.output_processor.abort_requests([rid]), RequestStatus.FINISHED_ABORTED
            )

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def has_work(self) -> bool:
        """Unfinished requests, or KV transfers whose completion the connector must still hear
        of (blocks held for a consumer, loads in flight): the serving loop steps while true."""
        return (
            self.output_processor.has_unfinished_requests()
            or self.scheduler.has_pending_kv_transfers()
        )

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    @property
    def samples(self) -> dict[str, Any]:
        """The unfinished user requests, by id (values: their samples' output states)."""
        return self.output_processor.parent_requests

    # ---- the step loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule → execute (runner + sampler) → scheduler.update_from_output →
        output_processor.process_outputs. Returns the outputs of every request that progressed.

        An exception while running the batch (tier load, forward pass, sampler, stop checks)
        fails only the user requests in that batch: they finish with reason ``"error"`` and
        ``RequestOutput.error`` set, their blocks are freed, and the step returns normally, so
        the engine keeps serving. An exception from ``schedule()`` itself propagates (the
        engine's state is then unknown). A non-``Exception`` (KeyboardInterrupt) fails the
        batch the same way and is re-raised.
        """
        if self.dead is not None:
            raise WorkerDiedError(f"the engine is dead: {self.dead}")
        if self.connector is not None and not self.config.enable_kv_cache_events:
            self.connector.take_events()  # nobody reads them: drained so they cannot pile up
        so = self.scheduler.schedule()
        if so.finished_req_ids:
            self.sampler.remove_requests(so.finished_req_ids)
        if so.is_empty:
            if self.scheduler.has_unfinished_requests() and not so.finished:
                time.sleep(0.0005)  # requests wait on tier I/O: yield the CPU to its threads
            if self.connector is None:
                return self._update(so, EMPTY_MODEL_RUNNER_OUTPUT)
        try:
            mro, prompt_lps = self._execute(so)
            return self._update(so, mro, prompt_lps)
        except BaseException as e:
            logger.exception(
                "engine step failed; failing the %d requests of its batch", len(so.scheduled)
            )
            failed = self._fail_batch(so, e)
            if isinstance(e, WorkerDiedError):
                self.dead = e  # a dead rank: the engine cannot step again (all ranks stopped)
                self.abort_request(list(self.samples))
            if not isinstance(e, Exception) or isinstance(e, WorkerDiedError):
                raise
            # Requests schedule() stopped (not in the failed batch) are still reported.
            return failed + self._update(so, EMPTY_MODEL_RUNNER_OUTPUT)

    def _execute(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, PromptLogprobsOutput]:
        """Run the forward pass (the runner drives the KV connector around it) and sample one
        token per sampling request (and per child forked from it this step, from the parent's
        logits row). Also returns the prompt logprobs the runner scored this step."""
        logits, kv_connector_output, prompt_lps = self.executor.execute_model(so)
        reqs = [s.request for s in so.scheduled if s.samples]
        if not reqs:  # only prefill chunks that do not reach the end of their prompts
            if kv_connector_output is None or kv_connector_output.is_empty:
                return EMPTY_MODEL_RUNNER_OUTPUT, prompt_lps
            return ModelRunnerOutput(kv_connector_output=kv_connector_output), prompt_lps
        if so.forks:
            logits, reqs = self._fork_rows(logits, reqs, so.forks)
        out = self.sampler(logits, reqs, self.structured_output_manager.grammar_bitmask(reqs))
        return ModelRunnerOutput(
            [r.request_id for r in reqs],
            out.token_ids,
            out.logprobs,
            out.sampled_logprobs,
            kv_connector_output,
        ), prompt_lps

    @staticmethod
    def _fork_rows(
        logits: torch.Tensor, reqs: list[Request], forks: list[tuple[Request, Request]]
    ) -> tuple[torch.Tensor, list[Request]]:
        """Each child sampled right after its parent, from the parent's logits row."""
        children: dict[str, list[Request]] = {}
        for parent, child in forks:
            children.setdefault(parent.request_id, []).append(child)
        rows: list[int] = []
        rows_reqs: list[Request] = []
        for j, req in enumerate(reqs):
            rows.append(j)
            rows_reqs.append(req)
            for child in children.get(req.request_id, ()):
                rows.append(j)
                rows_reqs.append(child)
        return logits[torch.tensor(rows)], rows_reqs

    def _update(
        self,
        so: SchedulerOutput,
        mro: ModelRunnerOutput,
        prompt_lps: PromptLogprobsOutput | None = None,
    ) -> list[RequestOutput]:
        """The scheduler applies the sampled tokens; the output processor turns them into
        outputs (keeping the prompt logprobs scored this step, also of prefill chunks that
        sample nothing), and requests it stopped on a stop string are finished in the scheduler."""
        eco = self.scheduler.update_from_output(so, mro)
        self.num_generated_tokens += len(mro.sampled_token_ids)
        if prompt_lps:
            self.output_processor.add_prompt_logprobs(prompt_lps)
        if not eco.outputs and not eco.forked:
            return []
        processed = self.output_processor.process_outputs(eco, time.monotonic())
        if processed.reqs_to_abort:
            self.scheduler.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs

    def _fail_batch(self, so: SchedulerOutput, err: BaseException) -> list[RequestOutput]:
        """Finish every user request of the failed batch ``so`` with reason "error": the
        scheduler frees their requests (dropping the prefix-cache hashes of blocks the batch
        never wrote, see `Scheduler.fail_requests`); one finished output per user request."""
        message = f"{type(err).__name__}: {err}"
        op = self.output_processor
        # Already finished and reported before the failure: nothing to fail.
        parents = [
            p for p in dict.fromkeys(s.request.parent_id for s in so.scheduled) if op.has_request(p)
        ]
        self.scheduler.fail_requests(so, parents)
        return op.fail_requests(parents, message, time.monotonic())

    # ---- introspection ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants()

    def take_kv_events(self) -> list[Any]:
        """KV events since the last call: the device pool's, then the connector's own media
        (offload tiers: CPU, STORAGE, REMOTE, P2P; PD transfer records: REMOTE)."""
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        tp = self.config.tensor_parallel_size
        if tp > 1:  # the device pool's blocks (and transfers') are on every rank
            for ev in events:
                if getattr(ev, "tp_ranks", 0) is None:
                    ev.tp_ranks = list(range(tp))
        return events

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the engine's counters (vLLM's ``Scheduler.make_stats``); it shares no
        mutable state with the engine, so other threads may read it. Call on the engine thread."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_blocks=self.kv_cache_config.num_blocks,
            block_size=self.block_size,
            num_free_blocks=kv.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generated_tokens,
            prefix_cache_stats=replace(kv.total_prefix_cache_stats),
            kv_connector_stats=self._kv_connector_stats(),
        )

    def _kv_connector_stats(self) -> KVConnectorStats | None:
        """The connector's counters (`KVConnectorBase.get_kv_connector_stats`); None without one."""
        return None if self.connector is None else self.connector.get_kv_connector_stats()

    def stats(self) -> dict[str, Any]:
        """`make_stats` as a dict (`SchedulerStats.to_dict`): what `LLM.stats()` returns."""
        return self.make_stats().to_dict()

    def shutdown(self) -> None:
        """Stop the worker processes (TP) and the connector's threads; idempotent."""
        self.executor.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None
            self.scheduler.connector = None
        if getattr(self, "ec", None) is not None:
            self.ec.shutdown()
            self.ec = None


def _make_executor(config: EngineConfig) -> Executor:
    """The executor ``config.distributed_executor_backend`` names (`engine/executor.py`)."""
    backend = config.distributed_executor_backend
    if backend == "mp":
        return MultiprocExecutor(config)
    if backend == "ray":
        from pagedkv.engine.ray_executor import RayExecutor

        return RayExecutor(config)
    return UniProcExecutor(config)
