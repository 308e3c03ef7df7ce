"""Gemma 2 end to end: interleaved sliding-window (even) and global (odd) layers, attention and
final logit soft caps, ``query_pre_attn_scalar``, (1 + w) RMSNorms and scaled embeddings. A tiny
random-weight config built here (transformers' own class, float32, eager attention) is saved
with ``save_pretrained`` and loaded by ``LLM(model=dir)``; greedy output over 64+ tokens is
token-exact against transformers' forward, and every position's logprob is within 1e-4, through
chunked prefill, a prefix hit and preemption. The sliding-window group holds only the blocks the
planner's formula says while a long request runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, greedy_by_forward, random_prompts

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import SlidingWindowSpec

WINDOW = 16
BLOCK = 4
VOCAB = 256
TOL = 1e-4


def tiny_config(**overrides: Any) -> Any:
    from transformers import Gemma2Config

    # Untied head: with a tied one a random model mostly repeats its input token (the scaled
    # embedding dominates the residual), which would make greedy agreement a weak check.
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return Gemma2Config(**(kw | overrides))


def build(config: Any) -> Any:
    from transformers import Gemma2ForCausalLM

    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-initialises the (1 + w) norms: give them weights to load
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return hf


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build(tiny_config())
    out = tmp_path_factory.mktemp("tiny_gemma2")
    hf.save_pretrained(out)
    return hf, out


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy by transformers' full forward at every step (as in test_hybrid_engine: its
    ``generate`` is not the oracle for mixed sliding/full layers past the window). Memoised:
    the parametrised engine cases share their reference."""
    return greedy_by_forward(hf, hf_logits, prompt, n)


def prompts(seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    return random_prompts(VOCAB, seed, lens, shared)


def test_config_and_model_shape(gemma: tuple[Any, Path]) -> None:
    _, path = gemma
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=80, max_model_len=128)
    cfg, model = llm.llm_engine.model_config, llm.llm_engine.model
    groups = llm.llm_engine.kv_cache_config.kv_cache_groups
    assert len(groups) == 2
    windows = sorted((getattr(g.kv_cache_spec, "sliding_window", None) or 0) for g in groups)
    assert windows == [0, WINDOW]
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [WINDOW, None, WINDOW, None]
    assert all(a.scale == 24**-0.5 and a.soft_cap == 5.0 for a in attn)
    assert (cfg.architecture, cfg.final_logit_softcapping) == ("gemma2", 3.0)


def test_oracle_depends_on_every_gemma_feature(gemma: tuple[Any, Path]) -> None:
    """The features are not inert in this tiny model: dropping the window, either soft cap or
    the query scalar changes transformers' logits by far more than TOL, so agreement with the
    reference below really checks them."""
    hf, _ = gemma
    ids = prompts(9, [70])[0]
    ref = hf_logits(hf, ids)
    for change in [
        dict(sliding_window=4096),
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=16),
    ]:
        other = build(tiny_config(**change))
        assert (hf_logits(other, ids) - ref).abs().max() > 100 * TOL, change


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},  # whole prompts in one step
        {"max_num_batched_tokens": 7},  # every prefill chunked; chunk edges cross the window
        # Few blocks: requests are preempted and recomputed (the small token budget bounds the
        # sliding group's prefill peak, which holds a whole chunk before the window trims it).
        {"num_kv_blocks": 56, "max_num_batched_tokens": 16, "max_model_len": 112},
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_greedy_matches_transformers(gemma: tuple[Any, Path], engine_kw: dict[str, int]) -> None:
    hf, path = gemma
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        **({"num_kv_blocks": 200, "max_model_len": 128} | engine_kw),
    )
    batch = prompts(1, [5, 23, 40, 9]) + prompts(2, [6, 11], shared=30)
    out_lens = [66, 20, 64, 9, 14, 18]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, n, o in zip(batch, out_lens, outs, strict=True):
        got = o.outputs[0].token_ids
        assert got == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
    assert len(set(outs[0].outputs[0].token_ids)) > 10  # not a degenerate repetition
    if engine_kw.get("num_kv_blocks") == 56:
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    check_clean(llm)


@pytest.mark.slow
def test_logprobs_and_prefix_hit_match_transformers(gemma: tuple[Any, Path]) -> None:
    """Every position's logprob of a 90-token prompt (prompt logprobs, so each position's full
    distribution went through the paged, chunked, windowed path) is within TOL of transformers';
    a second request sharing 84 of its tokens hits the prefix cache in both groups and its
    sampled tokens and their logprobs still agree."""
    hf, path = gemma
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=200,
        max_model_len=128,
        max_num_batched_tokens=24,
    )
    first, second = prompts(5, [6, 8], shared=84)
    ref = torch.log_softmax(hf_logits(hf, first), dim=-1)
    (out,) = llm.generate(
        {"prompt_token_ids": first},
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(first)
    err = max(
        abs(plp[i][first[i]].logprob - float(ref[i - 1, first[i]])) for i in range(1, len(first))
    )
    assert err < TOL
    assert out.outputs[0].token_ids == [int(ref[-1].argmax())]

    (out,) = llm.generate(
        {"prompt_token_ids": second},
        SamplingParams(temperature=0, max_tokens=20, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.num_cached_tokens >= 80
    got = out.outputs[0].token_ids
    assert got == hf_greedy(hf, second, 20)
    ref = torch.log_softmax(hf_logits(hf, second + got), dim=-1)[len(second) - 1 : -1]
    for i, (t, lp) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
        assert abs(lp[t].logprob - float(ref[i, t])) < TOL, i
    check_clean(llm)


@pytest.mark.slow
def test_window_blocks_freed_as_planned(gemma: tuple[Any, Path]) -> None:
    """While a long request decodes, its sliding-window group holds no more blocks than
    ``SlidingWindowSpec``'s formula allows, the global group holds every block, and pool usage
    matches the sum; the output is still transformers'."""
    hf, path = gemma
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=200, max_model_len=128)
    engine = llm.llm_engine
    prompt = prompts(4, [40])[0]
    engine.add_request(
        "long",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
    )
    groups = engine.kv_cache_config.kv_cache_groups
    kv = engine.kv_cache_manager
    tokens: list[int] = []
    checked = 0
    while engine.has_unfinished_requests():
        # Tokens whose K/V exist before the step, and the step's new ones (the whole prompt, then
        # the last sampled token).
        computed = len(prompt) + len(tokens) - 1 if tokens else 0
        new = 1 if tokens else len(prompt)
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
        live_total = 0
        for g, table in zip(groups, kv.get_block_ids("long"), strict=True):
            live = [b for b in table if b != 0]
            live_total += len(live)
            spec = g.kv_cache_spec
            end = -(-(computed + new) // BLOCK)  # blocks up to the step's last token
            if isinstance(spec, SlidingWindowSpec):
                # The planner's per-request bound for a step of ``new`` tokens ...
                bound = spec.max_memory_usage_bytes(128, new) // spec.page_size_bytes
                assert len(live) <= bound, (computed, len(live))
                # ... and exactly the blocks from the one holding the oldest key the step's
                # first query sees (position computed - w + 1) to the step's last token.
                assert len(live) == end - max(0, computed - WINDOW + 1) // BLOCK, (
                    computed,
                    len(live),
                )
                checked += len(live) < len(table)
            else:
                assert len(live) == end
        assert kv.block_pool.num_gpu_blocks - 1 - kv.num_free_blocks == live_total
    assert checked > 30  # the window really dropped blocks on most steps
    assert tokens == hf_greedy(hf, prompt, 70)
    check_clean(llm)


def test_tied_head_logprobs_match_transformers(tmp_path: Path) -> None:
    """Real Gemma 2 checkpoints tie the head to the (unscaled) embedding table: the model shares
    the table, and prompt logprobs still equal transformers'."""
    hf = build(tiny_config(tie_word_embeddings=True))
    hf.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=80, max_model_len=64)
    model = llm.llm_engine.model
    assert model.lm_head is model.model.embed_tokens
    ids = prompts(7, [40])[0]
    ref = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    (out,) = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    plp = out.prompt_logprobs
    assert (
        max(abs(plp[i][ids[i]].logprob - float(ref[i - 1, ids[i]])) for i in range(1, len(ids)))
        < TOL
    )


# ---- Gemma 3 (text): q/k norms, local RoPE theta, five sliding layers to one global -------


def gemma3_config(**overrides: Any) -> Any:
    from transformers import Gemma3TextConfig

    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        query_pre_attn_scalar=24,
        initializer_range=0.3,
        tie_word_embeddings=False,
        rope_parameters=rope,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return Gemma3TextConfig(**(kw | overrides))


def build3(config: Any) -> Any:
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return hf


@pytest.mark.slow
def test_gemma3_matches_transformers(tmp_path: Path) -> None:
    """A tiny Gemma3ForCausalLM: config read as such, greedy 66 tokens token-exact through
    chunked prefill in a pool small enough to preempt, prompt logprobs within TOL; the q/k norm weights
    and the local RoPE theta each change transformers' logits, so they are really checked."""
    hf = build3(gemma3_config())
    hf.save_pretrained(tmp_path)
    ids = prompts(8, [70])[0]
    ref_logits = hf_logits(hf, ids)
    local = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
    }
    for other in [build3(gemma3_config(rope_parameters=local)), build3(gemma3_config())]:
        if (
            other.config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
        ):  # other q/k norm weights
            for layer in other.model.layers:
                layer.self_attn.q_norm.weight.data.zero_()
                layer.self_attn.k_norm.weight.data.zero_()
        assert (hf_logits(other, ids) - ref_logits).abs().max() > 100 * TOL

    llm = LLM(
        model=str(tmp_path),
        block_size=BLOCK,
        num_kv_blocks=72,
        max_num_batched_tokens=8,
        max_model_len=112,
    )
    cfg, model = llm.llm_engine.model_config, llm.llm_engine.model
    assert (cfg.architecture, cfg.qk_norm, cfg.rope_theta, cfg.rope_local_theta) == (
        "gemma3_text",
        True,
        1e6,
        1e4,
    )
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [WINDOW] * 5 + [None]
    batch = prompts(1, [5, 30, 12])
    out_lens = [66, 40, 20]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens],
        use_tqdm=False,
    )
    for p, n, o in zip(batch, out_lens, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
    assert len(set(outs[0].outputs[0].token_ids)) > 10
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    (out,) = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    ref = torch.log_softmax(ref_logits, dim=-1)
    plp = out.prompt_logprobs
    assert (
        max(abs(plp[i][ids[i]].logprob - float(ref[i - 1, ids[i]])) for i in range(1, len(ids)))
        < TOL
    )
    check_clean(llm)


def test_released_config_layouts() -> None:
    """config.json files of the released checkpoints predate ``layer_types`` (and Gemma 3's
    ``rope_parameters``): the layer pattern and the local theta are derived as transformers does."""
    from pagedkv.models.config import ModelConfig

    common = dict(
        hidden_size=2304,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=9216,
        vocab_size=256000,
        sliding_window=4096,
        query_pre_attn_scalar=256,
    )
    g2 = ModelConfig.from_hf_dict(
        dict(
            common,
            model_type="gemma2",
            num_hidden_layers=26,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 13
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.qk_norm) == (
        50.0,
        30.0,
        False,
    )
    g3 = ModelConfig.from_hf_dict(
        dict(
            common,
            model_type="gemma3_text",
            num_hidden_layers=12,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            sliding_window_pattern=6,
        )
    )
    assert [i for i, t in enumerate(g3.layer_types) if t == "full_attention"] == [5, 11]
    assert (g3.rope_theta, g3.rope_local_theta, g3.qk_norm) == (1e6, 1e4, True)
    from transformers import Gemma3TextConfig  # the same pattern transformers derives

    assert Gemma3TextConfig(num_hidden_layers=12).layer_types == g3.layer_types
