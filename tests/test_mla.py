"""DeepSeek-V2/V3 MLA end to end: a paged latent cache (one ``[kv_c | k_pe]`` row per token,
``MLAAttentionSpec``), expanded prefill, absorbed decode and the DeepSeekMoE feed-forward.

Tiny random-weight configs are built here with transformers' own classes (float32, eager; the
router live, norms and the router's correction bias nonzero), saved with ``save_pretrained``
and loaded by ``LLM(model=dir)``. Greedy output over 64+ tokens is token-exact against
transformers and logprobs are within 1e-4, through chunked prefill, a prefix hit, preemption
and an n > 1 fork, for V3 (q LoRA, interleaved-pair or rotate-half RoPE, YaRN) and V2 (direct
q_proj, complex-pair RoPE, softmax router). The absorbed decode equals expanded attention on
random tensors (native kernel and torch path); the engine's page size is ``pagedkv plan``'s,
and the plan of DeepSeek-V3's published config matches the MLA formula (1,152 B/token/layer
in bf16, 70,272 B/token).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, random_prompts

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import MLAAttentionSpec
from pagedkv.entrypoints.cli import main
from pagedkv.models import deepseek_v2
from pagedkv.models.config import ModelConfig
from pagedkv.ops import mla_attention as mla_ops
from pagedkv.ops import native
from pagedkv.ops.metadata import AttentionMetadata

BLOCK = 4
VOCAB = 128
TOL = 1e-4
KV_LORA, ROPE, NOPE, V_DIM, HEADS = 16, 16, 32, 24, 4


def v3_config(**overrides: Any) -> Any:
    from transformers import DeepseekV3Config

    # The router is live: 2 of 8 experts in the best 1 of 2 groups, a nonzero score-correction
    # bias (set in build) and a dense first layer; untied head (a tied random one mostly repeats
    # its input token, a weak check).
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=KV_LORA,
        q_lora_rank=24,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=V_DIM,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return DeepseekV3Config(**(kw | overrides))


def v2_config(**overrides: Any) -> Any:
    from transformers import DeepseekV2Config

    # V2-Lite style: no q LoRA (a direct q_proj), complex-pair RoPE, softmax group-limited router.
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_group=3,
        topk_group=2,
        topk_method="group_limited_greedy",
        first_k_dense_replace=1,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return DeepseekV2Config(**(kw | overrides))


def build(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with (
        torch.no_grad()
    ):  # HF initialises norms to 1 and the correction bias to 0: make them matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
        for name, b in hf.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    return hf


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build(v3_config())
    out = tmp_path_factory.mktemp("tiny_deepseek_v3")
    hf.save_pretrained(out)
    return hf, out


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` (its own latent cache; 4x faster than a full forward per
    step, and the same tokens on these models); memoised per model for the parametrised cases."""
    memo = hf.__dict__.setdefault("_greedy_memo", {})
    key = (tuple(prompt), n)
    if key not in memo:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        memo[key] = out[0, len(prompt) :].tolist()
    return memo[key]


def prompts(seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    return random_prompts(VOCAB, seed, lens, shared)


def test_config_cache_and_weights(v3: tuple[Any, Path]) -> None:
    """The config reads as MLA (one latent "head" of kv_lora + rope, the DeepSeekMoE facts), every
    layer's spec is an ``MLAAttentionSpec``, the runner allocates exactly that (no V part), and
    ``num_params`` counts every tensor of the checkpoint."""
    from safetensors import safe_open

    hf, path = v3
    cfg = ModelConfig.from_hf_config(path)
    assert (cfg.architecture, cfg.num_kv_heads, cfg.head_dim) == ("deepseek_v3", 1, KV_LORA + ROPE)
    assert (
        cfg.mla is not None
        and cfg.mla.rope_style == "interleave"
        and cfg.mla.topk_method == "noaux_tc"
    )
    assert [cfg.mla.is_moe_layer(i) for i in range(3)] == [False, True, True]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert cfg.num_params == sum(f.get_tensor(k).numel() for k in f.keys())
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    specs = cfg.kv_cache_specs(BLOCK, torch_dtype="float32")
    assert set(map(type, specs.values())) == {MLAAttentionSpec}
    spec = next(iter(specs.values()))
    assert (spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.page_size_bytes) == (
        1,
        32,
        0,
        BLOCK * 32 * 4,
    )
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=40, max_model_len=64)
    k, v = llm.llm_engine.runner.kv_caches[0]
    assert tuple(k.shape) == (40, BLOCK, 1, KV_LORA + ROPE) and v.shape[-1] == 0
    attn = llm.llm_engine.model.model.layers[0].self_attn
    assert attn.scale == (NOPE + ROPE) ** -0.5


def test_weights_load_from_per_expert_or_fused_tensors(v3: tuple[Any, Path]) -> None:
    """The checkpoint's per-expert tensors (what ``save_pretrained`` and released checkpoints
    write) and transformers' fused in-memory ones (``experts.gate_up_proj [E, 2I, H]``) load to
    the same parameters; a multi-token-prediction layer past ``num_layers`` is skipped and an
    expert the model lacks is refused."""
    from pagedkv.models.deepseek_v2 import DeepseekV2ForCausalLM
    from pagedkv.models.loader import get_model

    hf, path = v3
    loaded = get_model(str(path))
    assert any(".experts.gate_up_proj" in n for n in hf.state_dict())
    net = DeepseekV2ForCausalLM(loaded.config)
    mtp = ("model.layers.3.self_attn.kv_b_proj.weight", torch.zeros(1))
    assert net.load_weights([*hf.state_dict().items(), mtp]) == net.param_names()
    theirs = dict(loaded.model.named_parameters())
    for name, p in net.named_parameters():
        assert torch.equal(p, theirs[name]), name
    with pytest.raises(ValueError, match="experts.8.up_proj"):
        net.load_weights([("model.layers.1.mlp.experts.8.up_proj.weight", torch.zeros(16, 32))])


def test_oracle_depends_on_router_and_rope_convention(v3: tuple[Any, Path]) -> None:
    """The MoE and the RoPE pairing are not inert in this tiny model: zeroing the router's
    correction bias, routing to other experts or rotating halves instead of pairs changes
    transformers' logits by far more than TOL, so agreement below really checks them."""
    hf, _ = v3
    ids = prompts(9, [40])[0]
    ref = hf_logits(hf, ids)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for change in [dict(rope_interleave=False), dict(num_experts_per_tok=3), dict(topk_group=2)]:
        other = build(v3_config(**change))
        other.load_state_dict(state)
        assert (hf_logits(other, ids) - ref).abs().max() > 100 * TOL, change
    bias = [b for n, b in hf.named_buffers() if "e_score_correction_bias" in n]
    saved = [b.clone() for b in bias]
    try:
        for b in bias:
            b.zero_()
        assert (hf_logits(hf, ids) - ref).abs().max() > 100 * TOL
    finally:
        for b, s in zip(bias, saved, strict=True):
            b.copy_(s)


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},  # whole prompts in one step
        {
            "max_num_batched_tokens": 7
        },  # every prefill chunked: expanded attention over cached latents
        {
            "num_kv_blocks": 36,
            "max_num_batched_tokens": 16,
            "max_model_len": 112,
        },  # preempted and recomputed
    ],
    ids=["plain", "chunked", "preempting"],
)
@pytest.mark.slow
def test_greedy_matches_transformers(
    v3: tuple[Any, Path], engine_kw: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    hf, path = v3
    seen = {"context_prefill": 0, "mixed_step": 0}  # the paths this case must exercise
    prefill, decode_md = mla_ops._prefill, deepseek_v2.mla_decode_metadata

    def spy_prefill(
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        row: int,
        *args: Any,
    ) -> None:
        q_len = md.query_start_loc_cpu[row + 1] - md.query_start_loc_cpu[row]
        seen["context_prefill"] += md.seq_lens_cpu[row] > q_len
        prefill(q_nope, q_pe, kv_cache, md, row, *args)

    def spy_decode_md(md: AttentionMetadata) -> AttentionMetadata | None:
        out = decode_md(md)
        seen["mixed_step"] += out is not None and out is not md
        return out

    monkeypatch.setattr(mla_ops, "_prefill", spy_prefill)
    monkeypatch.setattr(deepseek_v2, "mla_decode_metadata", spy_decode_md)
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        **({"num_kv_blocks": 200, "max_model_len": 128} | engine_kw),
    )
    batch = prompts(1, [5, 23, 40]) + prompts(2, [6, 11], shared=30)
    out_lens = [66, 20, 64, 14, 18]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, n, o in zip(batch, out_lens, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
    assert len(set(outs[0].outputs[0].token_ids)) > 10  # not a degenerate repetition
    if engine_kw.get("num_kv_blocks") == 36:
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    if (
        engine_kw
    ):  # chunks (and recomputed prompts) attend over cached latents; decodes share steps with them
        assert seen["context_prefill"] > 0 and seen["mixed_step"] > 0
    check_clean(llm)


def test_parallel_samples_fork_the_latent_cache(
    v3: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """n > 1: three greedy samples share the prompt's blocks (its last one partial, so the fork
    copies it) and each still equals transformers' greedy continuation."""
    from pagedkv.engine import model_runner

    copied: list[int] = []
    copy_blocks = model_runner.copy_blocks
    monkeypatch.setattr(
        model_runner,
        "copy_blocks",
        lambda caches, pairs: (copied.append(len(pairs)), copy_blocks(caches, pairs))[1],
    )
    hf, path = v3
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=100, max_model_len=128)
    prompt = prompts(6, [41])[0]
    (out,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    assert [c.token_ids for c in out.outputs] == [hf_greedy(hf, prompt, 20)] * 3
    assert sum(copied) == 2  # each child's copy of the partial block
    check_clean(llm)


def test_cpu_offload_tier_round_trip_is_exact(v3: tuple[Any, Path]) -> None:
    """Latent blocks evicted from a tiny device cache come back from the CPU tier (no recompute)
    and the greedy tokens are still transformers'."""
    hf, path = v3
    batch = prompts(11, [36] * 4)  # 36 blocks of prompts, 24 usable device blocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=25,
        max_model_len=64,
        max_num_seqs=2,
        kv_offload="cpu:64MiB",
    )
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in batch]
    stats = llm.stats()
    assert stats["external_cache_hits"] > 0 and stats["offload"]["loaded_tokens"] > 0
    check_clean(llm)


def test_bfloat16_model_runs_close_to_float32(v3: tuple[Any, Path]) -> None:
    """A bf16 model (bf16 latent cache, float32 router) runs the same paths; its prompt logprobs
    stay within bf16 noise of transformers' float32 ones (a wrong path is off by nats)."""
    hf, path = v3
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=100,
        max_model_len=128,
        dtype="bfloat16",
        max_num_batched_tokens=16,
    )
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    ids = prompts(5, [40])[0]
    ref = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    (out,) = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    err = max(
        abs(out.prompt_logprobs[i][ids[i]].logprob - float(ref[i - 1, ids[i]]))
        for i in range(1, len(ids))
    )
    assert err < 0.25


def test_logprobs_and_prefix_hit_match_transformers(v3: tuple[Any, Path]) -> None:
    """Every prompt position's logprob (chunked prefill: expanded attention over the cached
    latent, merged by log-sum-exp) is within TOL of transformers'; a second request sharing 84
    tokens hits the prefix cache, and its absorbed decode's tokens and logprobs still agree."""
    hf, path = v3
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
        SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.num_cached_tokens >= 80
    got = out.outputs[0].token_ids
    assert got == hf_greedy(hf, second, 24)
    ref = torch.log_softmax(hf_logits(hf, second + got), dim=-1)[len(second) - 1 : -1]
    for i, (t, lp) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
        assert abs(lp[t].logprob - float(ref[i, t])) < TOL, i
    check_clean(llm)


def test_deepseek_v2_without_q_lora_matches_transformers(tmp_path: Path) -> None:
    """DeepSeek-V2 (``q_lora_rank=None``: a direct q_proj; complex-pair RoPE; softmax
    group-limited router with two shared experts): greedy token-exact over 64 tokens through
    chunked prefill and a prefix hit."""
    hf = build(v2_config())
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf_config(tmp_path)
    assert cfg.mla is not None and cfg.mla.q_lora_rank is None and cfg.mla.rope_style == "complex"
    llm = LLM(
        model=str(tmp_path),
        block_size=BLOCK,
        num_kv_blocks=120,
        max_model_len=128,
        max_num_batched_tokens=9,
    )
    outs = [
        llm.generate(
            {"prompt_token_ids": p},
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
            use_tqdm=False,
        )[0]
        for p, n in zip(prompts(3, [7, 20], shared=12), (64, 16), strict=True)
    ]
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(
            hf, o.prompt_token_ids, len(o.outputs[0].token_ids)
        )
    assert outs[1].num_cached_tokens == 12
    check_clean(llm)


@pytest.mark.parametrize("rope_interleave", [True, False], ids=["pairs", "halves"])
def test_yarn_rope_matches_transformers(tmp_path: Path, rope_interleave: bool) -> None:
    """DeepSeek-V3's YaRN (here: factor 4 over 64 original positions, mscale != mscale_all_dim):
    scaled frequencies, the cos/sin attention factor and the mscale² softmax scale; prompt
    logprobs over 100 tokens (most past the original length) are within TOL of transformers',
    with interleaved-pair RoPE and with rotate-half (``rope_interleave=False``)."""
    yarn = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=0.5,
        beta_fast=32,
        beta_slow=1,
    )
    hf = build(v3_config(rope_parameters=yarn, rope_interleave=rope_interleave))
    hf.save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path),
        block_size=BLOCK,
        num_kv_blocks=80,
        max_model_len=128,
        max_num_batched_tokens=32,
    )
    attn = llm.llm_engine.model.model.layers[0].self_attn
    assert attn.scale == pytest.approx(
        (NOPE + ROPE) ** -0.5 * (0.1 * 0.5 * math.log(4) + 1) ** 2, rel=1e-12
    )
    ids = prompts(8, [100])[0]
    ref = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    (out,) = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    err = max(
        abs(out.prompt_logprobs[i][ids[i]].logprob - float(ref[i - 1, ids[i]]))
        for i in range(1, len(ids))
    )
    assert err < TOL
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)


def _random_mla_step(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A paged latent cache with shuffled blocks and one step of 3 decode rows and 2 prefill
    chunks (one after 13 cached tokens); random weights."""
    gen = torch.Generator().manual_seed(seed)
    lens_q, lens_kv = [1, 5, 1, 9, 1], [7, 5, 30, 22, 12]  # query / total tokens per sequence
    nb = sum(-(-n // BLOCK) for n in lens_kv) + 1
    cache = torch.randn(nb, BLOCK, 1, KV_LORA + ROPE, generator=gen).to(dtype)
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens_q), max(-(-n // BLOCK) for n in lens_kv), dtype=torch.int32)
    for i, n in enumerate(lens_kv):
        for j in range(-(-n // BLOCK)):
            table[i, j] = perm.pop()
    t = sum(lens_q)
    qsl = [0]
    for n in lens_q:
        qsl.append(qsl[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.full((t,), -1),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens_kv, dtype=torch.int32),
        block_table=table,
        block_size=BLOCK,
        max_query_len=max(lens_q),
        max_seq_len=max(lens_kv),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens_kv,
    )
    return dict(
        q_nope=torch.randn(t, HEADS, NOPE, generator=gen).to(dtype),
        q_pe=torch.randn(t, HEADS, ROPE, generator=gen).to(dtype),
        cache=cache,
        md=md,
        w=(torch.randn(HEADS * (NOPE + V_DIM), KV_LORA, generator=gen) * 0.3).to(dtype),
    )


def _expanded_reference(s: dict[str, Any], scale: float) -> torch.Tensor:
    """Plain causal attention over per-head K/V expanded from the latent, in float64."""
    md, w = s["md"], s["w"].double().view(HEADS, NOPE + V_DIM, KV_LORA)
    out = []
    for i, n in enumerate(md.seq_lens_cpu):
        t0, t1 = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        rows = torch.stack(
            [s["cache"][md.block_table[i, p // BLOCK], p % BLOCK, 0] for p in range(n)]
        ).double()
        k = torch.cat(
            [
                torch.einsum("nl,hpl->nhp", rows[:, :KV_LORA], w[:, :NOPE]),
                rows[:, None, KV_LORA:].expand(n, HEADS, ROPE),
            ],
            dim=-1,
        )
        v = torch.einsum("nl,hvl->nhv", rows[:, :KV_LORA], w[:, NOPE:])
        q = torch.cat([s["q_nope"][t0:t1], s["q_pe"][t0:t1]], dim=-1).double()
        scores = torch.einsum("thd,nhd->htn", q, k) * scale
        pos = torch.arange(n - (t1 - t0), n)
        scores.masked_fill_(torch.arange(n)[None, None, :] > pos[None, :, None], float("-inf"))
        out.append(torch.einsum("htn,nhv->thv", scores.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize("num_kv_splits", [None, 1], ids=["native-or-auto", "torch"])
def test_absorbed_decode_equals_expanded_attention(
    monkeypatch: pytest.MonkeyPatch, num_kv_splits: int | None
) -> None:
    """Random latents in shuffled blocks: the absorbed decode rows (MQA over ``[kv_c | k_pe]``
    with value ``kv_c``, then W_UV) and the expanded prefill rows (context in 4-token chunks,
    LSE-merged) both equal expanded attention computed densely in float64."""
    monkeypatch.setattr(mla_ops, "MLA_CONTEXT_CHUNK_TOKENS", 4)  # several context chunks to merge
    s = _random_mla_step(0)
    scale = (NOPE + ROPE) ** -0.5
    got = mla_ops.mla_attention(
        s["q_nope"], s["q_pe"], s["cache"], s["md"], s["w"], scale, num_kv_splits=num_kv_splits
    )
    ref = _expanded_reference(s, scale)
    assert got.shape == ref.shape == (17, HEADS, V_DIM)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_native_decode_kernel_reads_the_latent_in_place() -> None:
    """The native decode kernel takes the latent cache as K (one head of L + R) and its first L
    columns as V (a strided view, no copy): its output equals the torch path's."""
    if native.lib() is None:
        pytest.skip("native kernels not built (no C compiler)")
    s = _random_mla_step(1)
    md = s["md"]
    rows = md.rows()
    q = torch.randn(len(rows.decode), HEADS, KV_LORA + ROPE)
    res = native.paged_decode(
        q, s["cache"], s["cache"][..., :KV_LORA], rows.block_table, rows.seq_lens, 0.3
    )
    assert res is not None
    dmd = mla_ops.mla_decode_metadata(md)
    from pagedkv.ops.attention import paged_attention

    ref = paged_attention(q, s["cache"], s["cache"][..., :KV_LORA], dmd, 0.3, num_kv_splits=1)
    torch.testing.assert_close(res[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8_per_token_head"])
def test_quantized_latent_cache_is_refused(v3: tuple[Any, Path], kv_cache_dtype: str) -> None:
    """A quantized latent cache is not implemented: a clear error at start, not wrong tokens."""
    with pytest.raises(ValueError, match="kv_cache_dtype: the MLA latent cache is not quantized"):
        LLM(
            model=str(v3[1]),
            block_size=BLOCK,
            num_kv_blocks=40,
            max_model_len=64,
            kv_cache_dtype=kv_cache_dtype,
        )


def test_engine_page_size_is_the_plans(
    v3: tuple[Any, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`pagedkv plan` on the checkpoint's config.json and the engine size the latent cache alike."""
    _, path = v3
    memory = 1 << 20
    assert (
        main(
            [
                "plan",
                "--model",
                str(path / "config.json"),
                "--memory",
                str(memory),
                "--block-size",
                str(BLOCK),
                "--dtype",
                "float32",
                "--context",
                "64",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)["selected"]
    assert plan["bytes_per_token"] == 3 * (KV_LORA + ROPE) * 4  # 3 layers x one latent row, fp32
    assert plan["num_groups"] == 1
    engine = LLM(
        model=str(path), kv_cache_memory=memory, block_size=BLOCK, dtype="float32", max_model_len=64
    ).llm_engine
    cfg = engine.kv_cache_config
    assert isinstance(cfg.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec)
    assert (cfg.bytes_per_block, cfg.num_blocks) == (plan["bytes_per_block"], plan["num_blocks"])
    assert engine.kv_buffer.numel() * 4 == cfg.num_blocks * cfg.bytes_per_block


DEEPSEEK_V3_CONFIG = {  # deepseek-ai/DeepSeek-V3 config.json as published (the fields we read)
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_plan_of_deepseek_v3_published_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DeepSeek-V3: 61 layers x one row of (512 latent + 64 rope) x 2 B = 1,152 B/token/layer in
    bf16, 70,272 B/token (576 B/layer in fp8, + 8 B of inline scales per token-head); 671B
    parameters (the MTP layer aside); the YaRN softmax scale is 192^-0.5 x mscale(40, 1)^2."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    assert (
        main(
            [
                "plan",
                "--model",
                str(p),
                "--memory",
                str(64 << 30),
                "--dtype",
                "bfloat16",
                "--context",
                "32768",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    sel, modes = plan["selected"], {m["mode"]: m for m in plan["modes"]}
    assert sel["bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272
    assert sel["bytes_per_block"] == 16 * 70_272 and sel["num_groups"] == 1
    assert modes["fp8_per_tensor"]["bytes_per_token"] == 61 * 576
    assert modes["fp8_per_token_head"]["bytes_per_token"] == 61 * (576 + 8)
    assert (plan["model"]["num_kv_heads"], plan["model"]["head_dim"]) == (1, 576)
    assert abs(plan["model"]["num_params"] / 671e9 - 1) < 0.001
    cfg = ModelConfig.from_hf_config(p)
    spec = cfg.kv_cache_specs(16, "auto")["model.layers.60.self_attn"]
    assert isinstance(spec, MLAAttentionSpec) and spec.page_size_bytes == 16 * 1152
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert cfg.mla.softmax_scale(cfg.rope_scaling) == pytest.approx(
        192**-0.5 * mscale**2, rel=1e-12
    )
