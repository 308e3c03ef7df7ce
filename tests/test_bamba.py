"""Bamba (Mamba-2 + attention hybrid) end to end, with Mamba prefix caching through checkpoints.

A tiny random-weight ``BambaConfig`` (transformers' own class, float32, eager attention; 4
layers, attention at [1, 3], 16 Mamba heads, d_state 16, d_conv 4, SSD chunk 16) is saved with
``save_pretrained`` and loaded by ``LLM(model=dir)``. The engine raises the block size so an
attention page holds a Mamba state (16 -> 48 tokens here). Greedy output over 64+ tokens is
token-exact against transformers' full forward, and logprobs are within 1e-4, cold, with
chunked prefill, after a restored checkpoint (a second request sharing a prefix: its
``num_cached_tokens`` is a positive multiple of the block size), and under preemption. The
retention modes None / 0 / k keep exactly the checkpoints ``MambaManager`` documents, and a
plan from Bamba-9B's config.json matches the published state-size formula.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, greedy_by_forward, random_prompts

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import (
    FullAttentionSpec,
    MambaSpec,
    align_hybrid_block_size,
    get_kv_cache_groups,
)

VOCAB = 256
BLOCK = 48  # what the engine picks: 16 · cdiv(10112 B of Mamba state, 16 · 256 B per token)
TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """These models are tiny: one torch thread runs them fastest, and keeps a busy machine's
    thread oversubscription (several times slower) out of the test time."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_config(**overrides: Any) -> Any:
    from transformers import BambaConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1, 3],
        mamba_n_heads=16,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=16,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return BambaConfig(**(kw | overrides))


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import BambaForCausalLM

    torch.manual_seed(0)
    hf = BambaForCausalLM(tiny_config()).eval()
    with torch.no_grad():  # HF initialises these to constants: give them values that matter
        for layer in hf.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.D.normal_(0, 1)
                layer.mamba.dt_bias.normal_(0, 1)
                layer.mamba.norm.weight.normal_(1, 0.3)
    out = tmp_path_factory.mktemp("tiny_bamba")
    hf.save_pretrained(out)
    return hf, out


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy by transformers' full forward at every step (no HF cache: the oracle never runs
    its own recurrent step). Memoised on the model."""
    return greedy_by_forward(hf, hf_logits, prompt, n)


def logprob_error(hf: Any, prompt: list[int], out: Any) -> float:
    """Largest |logprob - transformers'| over the sampled tokens of ``out`` (logprobs=0)."""
    got = out.outputs[0].token_ids
    ref = torch.log_softmax(hf_logits(hf, prompt + got), dim=-1)[len(prompt) - 1 : -1]
    return max(
        abs(lp[t].logprob - float(ref[i, t]))
        for i, (t, lp) in enumerate(zip(got, out.outputs[0].logprobs))
    )


def prompts(seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    return random_prompts(VOCAB, seed, lens, shared)


def mamba_group(llm: LLM) -> int:
    groups = llm.llm_engine.kv_cache_config.kv_cache_groups
    return next(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec))


def cached_checkpoints(llm: LLM) -> int:
    """Blocks of the Mamba group registered in the prefix cache (checkpoints kept)."""
    suffix = mamba_group(llm).to_bytes(4, "big")
    pool = llm.llm_engine.kv_cache_manager.block_pool
    return sum(
        1 for b in pool.blocks if b.block_hash is not None and bytes(b.block_hash)[-4:] == suffix
    )


@pytest.mark.slow
def test_block_size_specs_and_state_views(
    bamba: tuple[Any, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, path = bamba
    with caplog.at_level(logging.INFO, logger="pagedkv.engine.llm_engine"):
        llm = LLM(model=str(path), block_size=16, num_kv_blocks=40, max_model_len=256)
    assert "block size 16 -> 48" in caplog.text
    engine = llm.llm_engine
    assert engine.block_size == BLOCK and engine.config.block_size == BLOCK
    groups = engine.kv_cache_config.kv_cache_groups
    kinds = sorted((type(g.kv_cache_spec).__name__, g.layer_names[0].split(".")[2]) for g in groups)
    assert kinds == [("FullAttentionSpec", "1"), ("MambaSpec", "0")]
    attn = next(g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, FullAttentionSpec))
    mamba = groups[mamba_group(llm)].kv_cache_spec
    # conv (160, 3) + ssm (16, 8, 16), float32; padded to the attention page of 48 tokens
    assert (
        mamba.shapes == ((160, 3), (16, 8, 16))
        and mamba.real_page_size_bytes == 160 * 3 * 4 + 16 * 8 * 16 * 4
    )
    assert mamba.page_size_bytes == attn.page_size_bytes == BLOCK * 2 * 16 * 2 * 4
    # The mixer layers' states are views of their layer slot's pages inside the one KV buffer.
    buf = engine.kv_buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    conv, ssm = engine.kv_caches[0]
    assert conv.shape == (40, 160, 3) and ssm.shape == (40, 16, 8, 16)
    assert lo <= conv.data_ptr() and ssm[-1, -1, -1, -1].data_ptr() < hi
    assert conv.data_ptr() == engine.kv_caches[1][0].data_ptr()  # slot 0: layer 0 and layer 1
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        LLM(
            model=str(path), num_kv_blocks=40, max_model_len=256, prefix_cache_retention_interval=50
        )
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        LLM(
            model=str(path), num_kv_blocks=40, max_model_len=256, prefix_cache_retention_interval=-1
        )


BAMBA_9B = {  # ibm-ai-platform/Bamba-9B config.json: the keys that shape the cache
    "architectures": ["BambaForCausalLM"],
    "model_type": "bamba",
    "attn_layer_indices": [9, 18, 27],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_bamba_9b_plan_matches_formula(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bamba-9B: 32 layers, attention at [9, 18, 27] with 8 KV heads of 128, 128 Mamba heads of
    64, d_state 128, one group, d_conv 4, bf16. The state per Mamba layer follows the published
    formula, the block size is vLLM's hybrid alignment, and ``pagedkv plan`` reports the same."""
    import json

    from pagedkv.entrypoints.cli import main
    from pagedkv.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(BAMBA_9B)
    specs = cfg.kv_cache_specs(16)
    conv_dim = 2 * 4096 + 2 * 1 * 128
    state = conv_dim * (4 - 1) * 4 + 128 * 64 * 128 * 4  # fp32 conv + SSM state per Mamba layer
    mamba = [s for s in specs.values() if isinstance(s, MambaSpec)]
    assert len(mamba) == 29 and {s.real_page_size_bytes for s in mamba} == {state} == {4_295_680}
    attn_per_token = 8 * 128 * 2 * 2  # bf16 K and V
    block = align_hybrid_block_size(specs, 16)
    assert block == 16 * -(-state // (16 * attn_per_token)) == 1056
    groups = get_kv_cache_groups(cfg.kv_cache_specs(block))
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {block * attn_per_token}
    assert sum(len(g.layer_names) for g in groups) == 32
    assert cfg.num_params > 9e9
    (tmp_path / "config.json").write_text(json.dumps(BAMBA_9B))
    assert (
        main(
            [
                "plan",
                "--model",
                str(tmp_path),
                "--memory",
                "8GiB",
                "--context",
                "8192",
                "--dtype",
                "bfloat16",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_size"] == 1056 and plan["selected"]["bytes_per_token"] == 3 * attn_per_token
    rows = plan["selected"]["groups"]
    assert sum(r["num_layers"] for r in rows if r["kind"] == "mamba") == 29
    assert all(r["page_size_bytes"] == r["num_layers"] * 1056 * attn_per_token for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_kw, hit",
    [
        ({}, 96),  # whole prompts in one step
        ({"max_num_batched_tokens": 20}, 48),  # chunks that start and end inside blocks
        ({"enable_prefix_caching": False, "max_num_batched_tokens": 64}, 0),
        # few blocks: requests are preempted and recomputed
        ({"num_kv_blocks": 9, "max_num_batched_tokens": 64, "max_model_len": 192}, 96),
    ],
    ids=["plain", "chunked", "no-caching", "preempting"],
)
def test_greedy_matches_transformers(
    bamba: tuple[Any, Path], engine_kw: dict[str, Any], hit: int
) -> None:
    hf, path = bamba
    llm = LLM(model=str(path), **({"num_kv_blocks": 40, "max_model_len": 256} | engine_kw))
    batch = prompts(1, [5, 61, 100]) + prompts(2, [3, 20], shared=97)
    out_lens = [66, 20, 64, 30, 12]
    params = [
        SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True) for n in out_lens
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, n, o in zip(batch, out_lens, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
        assert logprob_error(hf, p, o) < TOL, f"prompt of {len(p)} tokens"
    assert len(set(outs[0].outputs[0].token_ids)) > 10  # not a degenerate repetition
    # The last request shares 97 tokens with the one before it: a prefix hit on whole blocks. In
    # "plain" both prefill in the same step, so it reads the attention blocks and the Mamba
    # checkpoint that request writes earlier in the same forward pass (same-step reuse is safe:
    # the mixer runs the sequences in batch order).
    assert outs[4].num_cached_tokens == hit
    if engine_kw.get("num_kv_blocks") == 9:
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    check_clean(llm)


@pytest.mark.slow
def test_restored_checkpoint_is_exact(bamba: tuple[Any, Path]) -> None:
    """A request sharing 110 tokens with an earlier one resumes from the Mamba checkpoint at
    96 (and the attention blocks before it): its tokens and their logprobs are transformers'."""
    hf, path = bamba
    llm = LLM(model=str(path), num_kv_blocks=40, max_model_len=256, max_num_batched_tokens=64)
    first, second = prompts(5, [25, 9], shared=110)
    (out,) = llm.generate(
        {"prompt_token_ids": first},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == hf_greedy(hf, first, 8)
    (out,) = llm.generate(
        {"prompt_token_ids": second},
        SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.num_cached_tokens == 2 * BLOCK
    assert out.outputs[0].token_ids == hf_greedy(hf, second, 24)
    assert logprob_error(hf, second, out) < TOL
    check_clean(llm)


@pytest.mark.slow
@pytest.mark.parametrize(
    "retention, kept, hit",
    [
        (None, 3, 96),  # dense: checkpoints at 48, 96, 144
        (
            0,
            1,
            0,
        ),  # the step end only: the chunk stops at 144 (the replay boundary), past the shared prefix
        (96, 1, 96),  # every 96 tokens
    ],
)
def test_retention_interval(
    bamba: tuple[Any, Path], retention: int | None, kept: int, hit: int
) -> None:
    """A 150-token prompt in one step leaves the checkpoints ``prefix_cache_retention_interval``
    says; a request sharing its first 120 tokens then hits the last kept one at or below 120
    (attention included: the hybrid hit is the minimum over groups). With 0 the only
    checkpoint lies past the shared prefix, so the hit is 0 (vLLM issue 45238's drop)."""
    hf, path = bamba
    llm = LLM(
        model=str(path),
        num_kv_blocks=40,
        max_model_len=256,
        prefix_cache_retention_interval=retention,
    )
    first, second = prompts(7, [30, 10], shared=120)
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": first}, greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, first, 1)
    assert cached_checkpoints(llm) == kept
    (out,) = llm.generate(
        {"prompt_token_ids": second},
        SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.num_cached_tokens == hit
    assert out.outputs[0].token_ids == hf_greedy(hf, second, 16)
    assert logprob_error(hf, second, out) < TOL
    check_clean(llm)


# ---------------------------------------------------------------- GraniteMoeHybrid (same mixer)


def tiny_granite(tmp: Path, **overrides: Any) -> tuple[Any, Path]:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=16,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=16,
        max_position_embeddings=512,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=3.0,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(1)
    hf = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**(kw | overrides))).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            if layer.mamba is not None:
                layer.mamba.D.normal_(0, 1)
                layer.mamba.dt_bias.normal_(0, 1)
    hf.save_pretrained(tmp)
    return hf, tmp


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        dict(position_embedding_type="rope", num_local_experts=4, num_experts_per_tok=2),
        dict(position_embedding_type=None, num_local_experts=0),
    ],
    ids=["rope-moe", "nope-dense"],
)
def test_granitemoehybrid_matches_transformers(tmp_path: Path, variant: dict[str, Any]) -> None:
    """The second Mamba-2 family: Granite's multipliers, NoPE or RoPE attention, shared MLP and
    MoE around the same mixer; token-exact with logprobs within TOL, cold and from a restored
    checkpoint (chunked prefill)."""
    hf, path = tiny_granite(tmp_path, **variant)
    llm = LLM(model=str(path), num_kv_blocks=40, max_model_len=256, max_num_batched_tokens=40)
    model = llm.llm_engine.model
    assert (
        type(model).__name__ == "GraniteMoeHybridForCausalLM" and llm.llm_engine.block_size == BLOCK
    )
    assert (model.model.layers[1].self_attn.rotary_dim > 0) == (
        variant["position_embedding_type"] == "rope"
    )
    first, second = prompts(11, [12, 7], shared=100)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0, ignore_eos=True)
    for prompt, cached in [(first, 0), (second, 2 * BLOCK)]:
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert out.num_cached_tokens == cached
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
        assert logprob_error(hf, prompt, out) < TOL
    check_clean(llm)
