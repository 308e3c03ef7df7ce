"""Gemma 4 (text) end to end: global layers with their own head size and KV heads (k = v),
q/k/v norms, attention scale 1, sliding layers at their own RoPE theta and full layers on
"proportional" partial RoPE, ``layer_scalar``, final logit soft cap; then per-layer embeddings
(PLE) and cross-layer KV sharing (with the double-wide MLP). Tiny random-weight models of
transformers' own ``Gemma4ForCausalLM`` (float32, eager) are saved with ``save_pretrained``:
first the model alone runs over a hand-built paged cache (prefill in chunks, then decode) and
every position's logits match transformers'; then ``LLM(model=dir)`` runs greedy 64+ tokens
token-exact through chunked prefill, prefix hits and preemption, with two KV cache groups of
different block sizes and the window's blocks freed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, greedy_by_forward, random_prompts

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import SlidingWindowSpec
from pagedkv.models.config import ModelConfig
from pagedkv.models.loader import get_model
from pagedkv.ops.metadata import AttentionMetadata

WINDOW = 16
BLOCK = 4
VOCAB = 256
TOL = 1e-4
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # 6 layers, 2 global


def tiny_config(**overrides: Any) -> Any:
    """Sliding layers: 2 KV heads of 16; global layers: 1 KV head of 64 (k = v), a quarter of it
    rotated. Their pages differ (32 vs 64 elements per token), so the groups' block sizes do."""
    from transformers import Gemma4TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1e6,
        },
    }
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=WINDOW,
        layer_types=TYPES,
        rope_parameters=rope,
        max_position_embeddings=256,
        final_logit_softcapping=3.0,
        hidden_size_per_layer_input=0,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return Gemma4TextConfig(**(kw | overrides))


def build(config: Any, seed: int = 0) -> Any:
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    hf = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises norms and layer scalars to 1: vary them
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.normal_(1.0, 0.3)
        for layer in hf.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return hf


def saved(tmp: Path, config: Any) -> tuple[Any, Path]:
    hf = build(config)
    hf.save_pretrained(tmp)
    return hf, tmp


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return saved(tmp_path_factory.mktemp("tiny_gemma4"), tiny_config())


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    # output_hidden_states: keeps transformers 5.24 from slicing the inputs of its KV-shared
    # layers, whose code path fails without PLE (per_layer_inputs None).
    with torch.inference_mode():
        return hf(torch.tensor([ids]), output_hidden_states=True).logits[0].float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy by transformers' full forward at every step (memoised per model)."""
    return greedy_by_forward(hf, hf_logits, prompt, n)


def prompts(seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    return random_prompts(VOCAB, seed, lens, shared)


def paged_logits(path: Path, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """The model alone over a paged cache it owns: one sequence, prefilled in ``chunks`` (their
    sum may stop short of ``len(ids)``; the rest is decoded a token at a time). Each layer gets
    cache views of its own geometry; a KV-sharing layer its target's. Block ids are scattered."""
    loaded = get_model(path)
    model, cfg = loaded.model, loaded.config
    n_blocks = -(-len(ids) // BLOCK)
    blocks = list(range(2 * n_blocks, 0, -2))  # non-contiguous, reversed
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(cfg.num_layers):
        target = cfg.kv_sharing_target(i)
        if target is not None:
            caches.append(caches[target])
            continue
        shape = (2 * n_blocks + 1, BLOCK, cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
        caches.append((torch.zeros(shape), torch.zeros(shape)))
    steps = list(chunks) + [1] * (len(ids) - sum(chunks))
    out, done = [], 0
    for n in steps:
        pos = list(range(done, done + n))
        slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        md = AttentionMetadata(
            torch.tensor(slots),
            torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([done + n], dtype=torch.int32),
            torch.tensor([blocks], dtype=torch.int32),
            BLOCK,
            n,
            done + n,
            [0, n],
            [done + n],
        )
        hidden = model(torch.tensor(ids[done : done + n]), torch.tensor(pos), caches, md)
        out.append(model.compute_logits(hidden))
        done += n
    return torch.cat(out)


# ---- (1) dense: global geometry, k = v, v norm, proportional RoPE, layer scalar, soft cap ----


def test_config_read_as_transformers_builds_it(gemma: tuple[Any, Path]) -> None:
    hf, path = gemma
    cfg = ModelConfig.from_hf_config(path)
    assert cfg.architecture == "gemma4_text" and cfg.gemma4.attention_k_eq_v
    assert cfg.layer_head_dims == [16, 16, 64] * 2 and cfg.layer_num_kv_heads == [2, 2, 1] * 2
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.gemma4.partial_rotary_factor) == (
        1e6,
        1e4,
        0.25,
    )
    assert cfg.final_logit_softcapping == 3.0 and cfg.kv_sharing_targets is None
    # Every weight (and the layer scalars, buffers in transformers) counted from the shapes.
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()) + len(hf.model.layers)
    for i, layer in enumerate(hf.model.layers):  # the same geometry transformers built
        attn = layer.self_attn
        geometry = (attn.head_dim, attn.k_proj.out_features // attn.head_dim)
        assert geometry == (cfg.layer_head_dim(i), cfg.layer_kv_heads(i))
        assert (attn.v_proj is None) == (TYPES[i] == "full_attention")
    spec = cfg.kv_cache_specs(BLOCK, "float32")
    assert {(s.num_kv_heads, s.head_size, type(s).__name__) for s in spec.values()} == {
        (2, 16, "SlidingWindowSpec"),
        (1, 64, "FullAttentionSpec"),
    }


def test_oracle_depends_on_every_gemma4_feature(gemma: tuple[Any, Path]) -> None:
    """The features are not inert: changing the window, the soft cap, the partial rotary factor,
    the global theta or the layer scalars changes transformers' logits by far more than TOL."""
    hf, _ = gemma
    ids = prompts(9, [50])[0]
    ref = hf_logits(hf, ids)
    rope = dict(tiny_config().rope_parameters)
    full = rope["full_attention"]
    for change in [
        dict(sliding_window=4096),
        dict(final_logit_softcapping=None),
        dict(rope_parameters=rope | {"full_attention": full | {"partial_rotary_factor": 1.0}}),
        dict(rope_parameters=rope | {"full_attention": full | {"rope_theta": 1e2}}),
    ]:
        other = build(tiny_config(**change))
        assert (hf_logits(other, ids) - ref).abs().max() > 100 * TOL, change
    other = build(tiny_config())
    with torch.no_grad():
        other.model.layers[2].layer_scalar.fill_(1.0)
    assert (hf_logits(other, ids) - ref).abs().max() > 100 * TOL


def test_model_logits_match_transformers(gemma: tuple[Any, Path]) -> None:
    """Chunked prefill across the window, then decode past it: every position's logits."""
    hf, path = gemma
    ids = prompts(3, [60])[0]
    got = paged_logits(path, ids, [7, 13, 20])
    assert (got - hf_logits(hf, ids)).abs().max() < TOL


# ---- (2) per-layer embeddings, (3) KV sharing with the double-wide MLP, (4) MoE --------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB),
        dict(num_kv_shared_layers=3, use_double_wide_mlp=True),
        dict(
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=2,
            attention_k_eq_v=False,
        ),
        dict(enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=24),
    ],
    ids=["ple", "kv_shared", "ple_kv_shared_no_keqv", "moe"],
)
def test_ple_kv_sharing_moe_logits_match_transformers(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    hf, path = saved(tmp_path, tiny_config(**overrides))
    cfg = ModelConfig.from_hf_config(path)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()) + len(hf.model.layers)
    n_shared = overrides.get("num_kv_shared_layers", 0)
    if (
        n_shared
    ):  # each shared layer reads the last earlier owner of its type (transformers' "store")
        store = {t: max(i for i in range(6 - n_shared) if TYPES[i] == t) for t in set(TYPES)}
        assert cfg.kv_sharing_targets == [None] * (6 - n_shared) + [
            store[t] for t in TYPES[6 - n_shared :]
        ]
        assert len(cfg.kv_cache_specs(BLOCK, "float32")) == 6 - n_shared
    ids = prompts(4, [50])[0]
    got = paged_logits(path, ids, [9, 21])
    assert (got - hf_logits(hf, ids)).abs().max() < TOL


def test_unsupported_config_raises_naming_the_field() -> None:
    d = json.loads(tiny_config().to_json_string())
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(d | {"use_bidirectional_attention": "all"})
    with pytest.raises(NotImplementedError, match="sliding_window"):
        ModelConfig.from_hf_dict(d | {"per_layer_config": {"1": {"sliding_window": 8}}})
    from pagedkv.models.gemma4 import Gemma4ForCausalLM

    with pytest.raises(NotImplementedError, match="attention_bias"):
        Gemma4ForCausalLM(ModelConfig.from_hf_dict(d | {"attention_bias": True}))


def test_multimodal_wrapper_config_reads_its_text_config(tmp_path: Path) -> None:
    text = json.loads(tiny_config().to_json_string())
    cfg = ModelConfig.from_hf_dict(
        {"model_type": "gemma4", "text_config": text, "vision_config": {}}
    )
    assert cfg.architecture == "gemma4_text" and cfg.layer_head_dims == [16, 16, 64] * 2


# ---- the engine ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 7},
        {"num_kv_blocks": 40, "max_num_batched_tokens": 16, "max_model_len": 112},
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
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
    assert len(set(outs[0].outputs[0].token_ids)) > 10  # not a degenerate repetition
    if engine_kw.get("num_kv_blocks") == 40:
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    check_clean(llm)


@pytest.mark.slow
def test_logprobs_and_prefix_hit_match_transformers(gemma: tuple[Any, Path]) -> None:
    hf, path = gemma
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=200,
        max_model_len=192,
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
    assert (
        max(
            abs(plp[i][first[i]].logprob - float(ref[i - 1, first[i]]))
            for i in range(1, len(first))
        )
        < TOL
    )
    (out,) = llm.generate(
        {"prompt_token_ids": second},
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.num_cached_tokens >= 64
    assert out.outputs[0].token_ids == hf_greedy(hf, second, 64)
    check_clean(llm)


@pytest.mark.slow
def test_ple_and_kv_sharing_engine_matches_transformers(tmp_path: Path) -> None:
    """PLE plus two KV-sharing layers (one sliding, one full) in the engine: the sharing layers
    own no cache spec (4 of 6 layers do), read their targets' caches, and greedy output through
    chunked prefill and preemption is transformers'. (MoE touches no cache: checked at model level.)"""
    hf, path = saved(
        tmp_path,
        tiny_config(
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
        ),
    )
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=48,
        max_model_len=112,
        max_num_batched_tokens=16,
    )
    groups = llm.llm_engine.kv_cache_config.kv_cache_groups
    assert sum(len(g.layer_names) for g in groups) == 4
    batch = prompts(6, [5, 30, 12])
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
    check_clean(llm)


@pytest.mark.slow
def test_groups_of_different_block_sizes_and_window_freed(gemma: tuple[Any, Path]) -> None:
    """Two KV cache groups whose block sizes differ (the sliding layers' pages are half the
    global ones'); while a long request decodes, the sliding group holds only its window's
    blocks and the global group every block; the output is still transformers'."""
    hf, path = gemma
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=200, max_model_len=128)
    engine = llm.llm_engine
    groups = engine.kv_cache_config.kv_cache_groups
    assert len(groups) >= 2
    sizes = {type(g.kv_cache_spec).__name__: g.kv_cache_spec.block_size for g in groups}
    assert len(set(sizes.values())) == 2, sizes
    prompt = prompts(4, [40])[0]
    engine.add_request(
        "long",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
    )
    kv = engine.kv_cache_manager
    tokens: list[int] = []
    dropped = 0
    while engine.has_unfinished_requests():
        computed = len(prompt) + len(tokens) - 1 if tokens else 0
        new = 1 if tokens else len(prompt)
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
        for g, table in zip(groups, kv.get_block_ids("long"), strict=True):
            spec, live = g.kv_cache_spec, [b for b in table if b != 0]
            bs = spec.block_size
            end = -(-(computed + new) // bs)
            if isinstance(spec, SlidingWindowSpec):
                assert len(live) == end - max(0, computed - WINDOW + 1) // bs, (computed, len(live))
                dropped += len(live) < len(table)
            else:
                assert len(live) == end
    assert dropped > 20
    assert tokens == hf_greedy(hf, prompt, 70)
    check_clean(llm)


# ---- planning a released-size config ---------------------------------------------------------


def gemma4_31b_shaped() -> dict[str, Any]:
    """Shaped like google/gemma-4-31B's text config (sizes from memory, not copied: the test
    checks the per-group formula, not the published numbers)."""
    return dict(
        model_type="gemma4_text",
        vocab_size=262144,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=4,
        attention_k_eq_v=True,
        sliding_window=1024,
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        max_position_embeddings=262144,
        dtype="bfloat16",
    )


def test_plan_kv_bytes_per_group_equal_the_formula(tmp_path: Path) -> None:
    """Per token, a sliding layer holds ``2·16·256·2`` B (K+V, 16 KV heads of 256, bf16) and a
    full layer ``2·4·512·2``; the plan's groups (10 layers each: the planner groups layers of a
    type by the smallest count) carry those sums, the full group at twice the block size (its
    pages are half as big per token)."""
    from pagedkv.core import planning
    from pagedkv.entrypoints.cli.plan import group_rows

    (tmp_path / "config.json").write_text(json.dumps(gemma4_31b_shaped()))
    cfg = ModelConfig.from_hf_config(tmp_path)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == list(
        range(5, 60, 6)
    )
    per_layer = {"sliding_window": 2 * 16 * 256 * 2, "full_attention": 2 * 4 * 512 * 2}
    assert (
        cfg.kv_bytes_per_token()
        == 50 * per_layer["sliding_window"] + 10 * per_layer["full_attention"]
    )
    rows = group_rows(planning.as_groups(cfg.kv_cache_specs(16)), 8192, 2048)
    assert (
        sorted((r["kind"], r["num_layers"], r["block_size"]) for r in rows)
        == [("full_attention", 10, 32)] + [("sliding_window", 10, 16)] * 5
    )
    for r in rows:
        assert r["bytes_per_token"] == r["num_layers"] * per_layer[r["kind"]], r
        assert r["page_size_bytes"] == r["block_size"] * r["bytes_per_token"]


def test_plan_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.entrypoints.cli import main

    (tmp_path / "config.json").write_text(json.dumps(gemma4_31b_shaped()))
    assert (
        main(
            [
                "plan",
                "--model",
                str(tmp_path / "config.json"),
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
    )  # "auto" is float32 on CPU
    plan = json.loads(capsys.readouterr().out)
    assert plan["selected"]["bytes_per_token"] == 50 * 2 * 16 * 256 * 2 + 10 * 2 * 4 * 512 * 2
    # Per-token-head modes cannot put both geometries in one pool: listed as unsupported, with
    # the reason, while the modes that can are still planned.
    modes = {m["mode"]: m for m in plan["modes"]}
    assert (
        modes["auto"]["supported"]
        and modes["auto"]["bytes_per_token"] == plan["selected"]["bytes_per_token"]
    )
    bad = [m for m in modes.values() if not m["supported"]]
    assert bad and all(
        "per_token_head" in m["mode"] or "int4" in m["mode"] or "kivi" in m["mode"] for m in bad
    ), modes.keys()
    assert all(m["reason"] for m in bad)
    assert (
        main(
            [
                "plan",
                "--model",
                str(tmp_path / "config.json"),
                "--memory",
                "8GiB",
                "--context",
                "8192",
            ]
        )
        == 0
    )
    assert "unsupported:" in capsys.readouterr().out
