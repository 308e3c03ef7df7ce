"""Llama 4 (text) end to end: chunked local attention on RoPE layers, a NoPE global layer with
the attention temperature, L2 q/k norm, Meta's complex-pair RoPE, routed + shared-expert MoE
and dense MLP layers. A tiny random-weight ``Llama4ForCausalLM`` (transformers' own class,
float32, eager attention) is saved with ``save_pretrained`` and loaded by ``LLM(model=dir)``;
greedy output over 64+ tokens crossing several chunks is token-exact against transformers'
forward, and every position's logprob is within 1e-4, through chunked prefill, a prefix hit and
preemption. The chunked groups hold only the blocks of the current chunk while a long request
runs. The paged attention op's chunk mask is checked against a dense reference on its native
and torch paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, greedy_by_forward, random_prompts
from ref_attention import make_paged_batch

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec
from pagedkv.ops import native
from pagedkv.ops.attention import paged_attention

CHUNK = 16
BLOCK = 4
VOCAB = 256
TOL = 1e-4


# ---- the op: chunk mask on the native and torch paths -------------------------------------


def ref_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int
) -> torch.Tensor:
    """One sequence, float64: query ``i`` at position ``p = L - Lq + i`` sees key ``j`` iff
    ``j <= p`` and ``j // chunk == p // chunk``."""
    lq, hq, _ = q.shape
    n, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    p = torch.arange(n - lq, n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    s = s.masked_fill(~((j <= p) & (j // chunk == p // chunk)), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)


@pytest.mark.parametrize("chunk,block_size", [(8, 4), (16, 16), (6, 4), (1, 4)])
@pytest.mark.parametrize("use_native", [True, False])
def test_chunked_attention_matches_dense_reference(
    chunk: int, block_size: int, use_native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows at and past chunk edges, a whole prompt and prefill chunks after cached
    context (crossing chunk edges) in one step. With chunks of whole blocks the native decode
    kernel runs (its block tables shifted to each row's chunk); otherwise the torch path."""
    calls: list[int] = []
    if use_native:
        real = native.paged_decode
        monkeypatch.setattr(
            native, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k)
        )
    else:
        monkeypatch.setattr(native, "lib", lambda: None)
    seq_lens = [1, chunk, chunk + 1, 3 * chunk - 1, 41, 37, 50, 2 * chunk + 3]
    query_lens = [1, 1, 1, 1, 1, 37, 19, chunk + 2]
    batch = make_paged_batch(
        seq_lens,
        query_lens,
        block_size=block_size,
        num_kv_heads=2,
        group=2,
        head_size=16,
        dtype=torch.float32,
        layout="LBNHC",
        shared_prefix=False,
        seed=chunk,
    )
    scale = 0.25
    out = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.md, scale, attention_chunk_size=chunk
    )
    qsl = batch.md.query_start_loc_cpu
    ref = torch.cat(
        [
            ref_chunked(
                batch.query[qsl[i] : qsl[i + 1]], batch.keys[i], batch.values[i], scale, chunk
            )
            for i in range(len(seq_lens))
        ]
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    if use_native and native.lib() is not None:
        assert bool(calls) == (chunk % block_size == 0)
    # The mask is real: plain causal attention differs.
    full = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.md, scale)
    assert (full - out).abs().max() > 1e-2


def test_chunked_attention_rejects_bad_arguments() -> None:
    batch = make_paged_batch(
        [5],
        [5],
        block_size=4,
        num_kv_heads=1,
        group=1,
        head_size=8,
        dtype=torch.float32,
        layout=None,
        shared_prefix=False,
        seed=0,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.md, 1.0)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        paged_attention(*args, attention_chunk_size=0)
    with pytest.raises(ValueError, match="exclusive"):
        paged_attention(*args, sliding_window=4, attention_chunk_size=8)


# ---- the tiny model -------------------------------------------------------------------------


def tiny_config(**overrides: Any) -> Any:
    from transformers import Llama4TextConfig

    # 4 layers: RoPE/chunked 0-2, NoPE global 3 (no_rope_layer_interval 4); MoE on 1 and 3 and
    # dense MLPs on 0 and 2; floor_scale 4 so the temperature changes every few positions.
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=CHUNK,
        floor_scale=4,
        attn_scale=0.1,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return Llama4TextConfig(**(kw | overrides))


def build(config: Any) -> Any:
    from transformers import Llama4ForCausalLM

    torch.manual_seed(0)
    hf = Llama4ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1: give them weights worth loading
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
    return hf


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build(tiny_config())
    out = tmp_path_factory.mktemp("tiny_llama4")
    hf.save_pretrained(out)
    return hf, out


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy by transformers' full forward at every step (its chunked mask applies to the
    whole sequence; memoised: the parametrised engine cases share their reference)."""
    return greedy_by_forward(hf, hf_logits, prompt, n)


def prompts(seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    return random_prompts(VOCAB, seed, lens, shared)


def test_config_and_model_shape(llama4: tuple[Any, Path]) -> None:
    _, path = llama4
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=200, max_model_len=128)
    cfg, model = llm.llm_engine.model_config, llm.llm_engine.model
    assert (cfg.architecture, cfg.attention_chunk_size) == ("llama4_text", CHUNK)
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert cfg.llama4.moe_layers == [1, 3] and cfg.llama4.no_rope_layers == [1, 1, 1, 0]
    groups = llm.llm_engine.kv_cache_config.kv_cache_groups
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in groups)
    assert kinds == ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"]
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.attention_chunk_size for a in attn] == [CHUNK] * 3 + [None]
    assert [a.use_rope for a in attn] == [True] * 3 + [False]
    assert [a.qk_norm_eps is not None for a in attn] == [True] * 3 + [False]
    assert [a.temperature for a in attn] == [None] * 3 + [(4.0, 0.1)]
    assert [type(layer.feed_forward).__name__ for layer in model.model.layers] == [
        "Llama4MLP",
        "Llama4MoE",
        "Llama4MLP",
        "Llama4MoE",
    ]
    # The parameter count matches transformers' own.
    hf, _ = llama4
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


def test_oracle_depends_on_every_llama4_feature(llama4: tuple[Any, Path]) -> None:
    """The features are not inert in this tiny model: a longer chunk, no temperature, no q/k
    norm, all-dense layers or top-2 routing each change transformers' logits by far more than
    TOL, so agreement with the reference below really checks them."""
    hf, _ = llama4
    ids = prompts(9, [70])[0]
    ref = hf_logits(hf, ids)
    for change in [
        dict(attention_chunk_size=4096),
        dict(attn_temperature_tuning=False),
        dict(use_qk_norm=False),
        dict(num_experts_per_tok=2),
    ]:
        other = build(tiny_config(**change))
        assert (hf_logits(other, ids) - ref).abs().max() > 100 * TOL, change


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},  # whole prompts in one step
        {"max_num_batched_tokens": 7},  # every prefill chunked; step edges cross chunk edges
        # Few blocks: requests are preempted and recomputed.
        {"num_kv_blocks": 60, "max_num_batched_tokens": 16, "max_model_len": 112},
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_greedy_matches_transformers(llama4: tuple[Any, Path], engine_kw: dict[str, int]) -> None:
    hf, path = llama4
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        **({"num_kv_blocks": 240, "max_model_len": 128} | engine_kw),
    )
    batch = prompts(1, [5, 23, 40, 9]) + prompts(2, [6, 11], shared=30)
    out_lens = [66, 20, 64, 9, 14, 18]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, n, o in zip(batch, out_lens, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
    assert len(set(outs[0].outputs[0].token_ids)) > 10  # not a degenerate repetition
    if engine_kw.get("num_kv_blocks") == 60:
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    check_clean(llm)


@pytest.mark.slow
def test_logprobs_and_prefix_hit_match_transformers(llama4: tuple[Any, Path]) -> None:
    """Every position's logprob of a 90-token prompt (prompt logprobs through the paged,
    chunked path) is within TOL of transformers'; a second request sharing 84 of its tokens hits
    the prefix cache (the chunked groups' hit starts at the current chunk, earlier blocks null)
    and its sampled tokens and their logprobs still agree."""
    hf, path = llama4
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=240,
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
def test_blocks_before_the_current_chunk_are_released(llama4: tuple[Any, Path]) -> None:
    """While a long request decodes, each chunked group holds exactly the blocks from its
    current chunk's start (the chunk of the step's first new token) to the step's last token,
    never more than ``ChunkedLocalAttentionSpec``'s bound; the global group holds every block,
    and pool usage is the sum. The output is still transformers'."""
    hf, path = llama4
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=200, max_model_len=128)
    engine = llm.llm_engine
    prompt = prompts(1, [5, 23, 40, 9])[2]  # as in test_greedy_matches_transformers: one oracle run
    engine.add_request(
        "long",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    )
    groups = engine.kv_cache_config.kv_cache_groups
    kv = engine.kv_cache_manager
    tokens: list[int] = []
    released = 0
    while engine.has_unfinished_requests():
        computed = len(prompt) + len(tokens) - 1 if tokens else 0
        new = 1 if tokens else len(prompt)
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
        live_total = 0
        end = -(-(computed + new) // BLOCK)  # blocks up to the step's last token
        for g, table in zip(groups, kv.get_block_ids("long"), strict=True):
            live = [b for b in table if b != 0]
            live_total += len(live)
            spec = g.kv_cache_spec
            if isinstance(spec, ChunkedLocalAttentionSpec):
                assert len(live) <= spec.max_memory_usage_bytes(128, new) // spec.page_size_bytes
                assert len(live) == end - computed // CHUNK * CHUNK // BLOCK, (computed, len(live))
                assert table[: computed // CHUNK * CHUNK // BLOCK] == [0] * (
                    computed // CHUNK * CHUNK // BLOCK
                )
                released += len(live) < len(table)
            else:
                assert isinstance(spec, FullAttentionSpec) and len(live) == end
        assert kv.block_pool.num_gpu_blocks - 1 - kv.num_free_blocks == live_total
    assert released > 50  # chunks really dropped blocks on most steps
    assert tokens == hf_greedy(hf, prompt, 64)
    check_clean(llm)
