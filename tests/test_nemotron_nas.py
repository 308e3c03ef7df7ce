"""DeciLM / Nemotron-NAS (``DeciLMForCausalLM``, model_type "nemotron-nas") end to end.

The reference: transformers has no DeciLM class (the checkpoints ship it as remote code), so it
is built from transformers' own Llama modules. A ``LlamaForCausalLM`` whose layer ``i`` has
``self_attn`` = a ``LlamaAttention`` built from a config copy with that layer's
``num_key_value_heads`` (``num_attention_heads // n_heads_in_group``), ``mlp`` = a ``LlamaMLP``
of that layer's width (``_ffn_mult_to_intermediate_size``); a ``replace_with_linear`` sub-block
is a module holding one bias-free ``Linear(hidden, hidden)`` named ``linear_attn`` /
``linear_mlp`` (the checkpoint names); a ``no_op`` sub-block is a zero module and its norm an
identity, so ``residual + 0`` leaves the stream exactly as DeciLM's skipped block does. That is
DeciLM's forward (modeling_decilm.py / vLLM's nemotron_nas.py) operation for operation, and the
saved state dict has exactly DeciLM's tensor names (no norm for a no-op sub-block). The weights
are saved with ``save_pretrained`` under a nemotron-nas ``config.json`` and loaded by
``LLM(model=dir)``. The reference recomputes the whole sequence every step (no HF cache).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, greedy_by_forward, random_prompts
from torch import nn

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import FullAttentionSpec, UniformTypeKVCacheSpecs
from pagedkv.entrypoints.cli import main
from pagedkv.models.config import ModelConfig
from pagedkv.models.deci_config import ffn_mult_to_intermediate_size

VOCAB, HIDDEN, HEADS = 256, 64, 4
HEAD_DIM = HIDDEN // HEADS


def block(
    group: int | None = None, ffn_mult: float | None = 1.0, attn: str = "", ffn: str = ""
) -> dict[str, Any]:
    """One ``block_configs`` entry as released configs write it; ``attn`` / ``ffn`` "no_op" or "linear"."""
    return {
        "attention": {
            "n_heads_in_group": None if attn else group,
            "no_op": attn == "no_op",
            "replace_with_linear": attn == "linear",
            "num_sink_tokens": None,
            "sparsify": None,
            "unshifted_sink": False,
            "use_prefill_window_in_sink_attention": False,
            "window_length": None,
        },
        "ffn": {
            "ffn_mult": None if ffn else ffn_mult,
            "no_op": ffn == "no_op",
            "replace_with_linear": ffn == "linear",
            "sparsify": None,
        },
    }


# KV heads 4, 2, -, 1, -, 2; MLP widths 256, 512, 256, -, linear, 256.
BLOCKS = [
    block(1, 1.0),
    block(2, 7.0),
    block(attn="no_op", ffn_mult=1.0),
    block(4, ffn="no_op"),
    block(attn="linear", ffn="linear"),
    block(2, 3.5),
]
KV_HEADS = [4, 2, 0, 1, 0, 2]
WIDTHS = [256, 512, 256, 0, 0, 256]
ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def deci_config_json() -> dict[str, Any]:
    """The tiny model's ``config.json``, keyed as the released nemotron-nas ones (null
    ``intermediate_size`` / ``num_key_value_heads``: the block configs hold them)."""
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": None,
        "max_position_embeddings": 256,
        "mlp_bias": False,
        "num_attention_heads": HEADS,
        "num_hidden_layers": len(BLOCKS),
        "num_key_value_heads": None,
        "rms_norm_eps": 1e-5,
        "rope_scaling": ROPE,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": VOCAB,
        "block_configs": BLOCKS,
        "bos_token_id": None,
        "eos_token_id": None,
    }


class _Zero(nn.Module):
    """A no-op sub-block: adds nothing to the residual stream."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = torch.zeros_like(hidden_states)
        return (
            (out, None) if kwargs else out
        )  # attention is called with keywords and returns a pair


class _LinearAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return self.linear_attn(hidden_states), None


class _LinearMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_mlp(x)


def build_reference(blocks: list[dict[str, Any]] = BLOCKS, seed: int = 0) -> Any:
    """transformers' Llama with each layer's sub-blocks swapped for DeciLM's (module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=len(blocks),
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, **ROPE},
        tie_word_embeddings=False,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = LlamaForCausalLM(cfg)
    for i, (layer, b) in enumerate(zip(hf.model.layers, blocks, strict=True)):
        a, f = b["attention"], b["ffn"]
        if a["no_op"]:
            layer.input_layernorm, layer.self_attn = nn.Identity(), _Zero()
        elif a["replace_with_linear"]:
            layer.self_attn = _LinearAttention()
        else:
            c = copy.deepcopy(cfg)
            c.num_key_value_heads = HEADS // a["n_heads_in_group"]
            layer.self_attn = LlamaAttention(c, i)
        if f["no_op"]:
            layer.post_attention_layernorm, layer.mlp = nn.Identity(), _Zero()
        elif f["replace_with_linear"]:
            layer.mlp = _LinearMLP()
        else:
            c = copy.deepcopy(cfg)
            c.intermediate_size = ffn_mult_to_intermediate_size(f["ffn_mult"], HIDDEN)
            layer.mlp = LlamaMLP(c)
    torch.manual_seed(seed)
    with torch.no_grad():  # a random model whose every weight (norms too) shapes the output
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return hf.eval()


@pytest.fixture(scope="module")
def deci(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build_reference()
    out = tmp_path_factory.mktemp("tiny_deci")
    hf.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(deci_config_json()))
    return hf, out


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy by the full forward at every step (no cache), memoised per model."""
    return greedy_by_forward(hf, hf_logits, prompt, n)


# ---- config ------------------------------------------------------------------------------


def test_ffn_mult_to_intermediate_size() -> None:
    """``int(2·ffn_mult·hidden/3)`` rounded up to 256: Super-49B's 5.25 gives Llama-3.3-70B's
    28672, 2.625 half of it; a non-multiple rounds up."""
    assert ffn_mult_to_intermediate_size(5.25, 8192) == 28672
    assert ffn_mult_to_intermediate_size(2.625, 8192) == 14336
    assert ffn_mult_to_intermediate_size(1.0, 8192) == 5632  # int(5461.33) = 5461 -> 5632
    assert [ffn_mult_to_intermediate_size(m, HIDDEN) for m in (1.0, 3.5, 7.0)] == [256, 256, 512]


def test_config_from_block_configs(deci: tuple[Any, Path]) -> None:
    hf, path = deci
    cfg = ModelConfig.from_hf_config(path)
    assert cfg.architecture == "nemotron-nas" and cfg.layer_num_kv_heads == KV_HEADS
    assert cfg.deci.attention == [
        "attention",
        "attention",
        "no_op",
        "attention",
        "linear",
        "attention",
    ]
    assert cfg.deci.ffn == ["mlp", "mlp", "mlp", "no_op", "linear", "mlp"]
    assert cfg.deci.intermediate_sizes == WIDTHS
    assert (cfg.num_kv_heads, cfg.intermediate_size, cfg.head_dim) == (4, 512, HEAD_DIM)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 10000.0
    assert [cfg.owns_kv_cache(i) for i in range(6)] == [h > 0 for h in KV_HEADS]
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # round trip (what GGUF headers go through)
    with pytest.raises(ValueError, match="n_heads_in_group"):
        ModelConfig.from_hf_dict(deci_config_json() | {"block_configs": [block(3)] + BLOCKS[1:]})
    with pytest.raises(NotImplementedError, match="window_length"):
        bad = block(2)
        bad["attention"]["window_length"] = 8
        ModelConfig.from_hf_dict(deci_config_json() | {"block_configs": [bad] + BLOCKS[1:]})
    with pytest.raises(ValueError, match="block_configs"):
        ModelConfig.from_hf_dict(deci_config_json() | {"block_configs": BLOCKS[:5]})


def test_kv_cache_is_one_uniform_type_group(deci: tuple[Any, Path]) -> None:
    """Four attention layers of 4, 2, 1 and 2 KV heads: one group whose spec is a
    ``UniformTypeKVCacheSpecs`` with each layer's own spec, its page the sum of theirs; the
    attention-free layers have no spec, and the model built them without attention."""
    _, path = deci
    llm = LLM(model=str(path), block_size=16, num_kv_blocks=40, max_model_len=128)
    groups = llm.llm_engine.kv_cache_config.kv_cache_groups
    assert len(groups) == 1
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    names = [f"model.layers.{i}.self_attn" for i in range(6) if KV_HEADS[i]]
    assert sorted(spec.kv_cache_specs) == sorted(names) == sorted(groups[0].layer_names)
    for name, s in spec.kv_cache_specs.items():
        heads = KV_HEADS[int(name.split(".")[2])]
        assert isinstance(s, FullAttentionSpec) and (s.num_kv_heads, s.head_size) == (
            heads,
            HEAD_DIM,
        )
        assert s.page_size_bytes == 2 * 16 * heads * HEAD_DIM * 4  # K and V, float32
    assert spec.page_size_bytes == sum(2 * 16 * h * HEAD_DIM * 4 for h in KV_HEADS)
    layers = llm.llm_engine.model.model.layers
    assert not hasattr(layers[2], "self_attn") and not hasattr(layers[2], "input_layernorm")
    assert not hasattr(layers[3], "mlp") and not hasattr(layers[3], "post_attention_layernorm")


def test_reference_depends_on_every_sub_block(deci: tuple[Any, Path]) -> None:
    """The oracle is not inert: zeroing any sub-block (an attention of each KV head count, the
    linear attention and MLP, an MLP of each width) changes its logits a lot, so agreement below
    checks every kind of layer."""
    hf, _ = deci
    ids = random_prompts(VOCAB, 3, [24])[0]
    ref = hf_logits(hf, ids)
    for i, part in [
        (0, "self_attn"),
        (1, "self_attn"),
        (3, "self_attn"),
        (5, "self_attn"),
        (4, "self_attn"),
        (4, "mlp"),
        (1, "mlp"),
        (2, "mlp"),
    ]:
        other = build_reference()
        with torch.no_grad():
            for p in getattr(other.model.layers[i], part).parameters():
                p.zero_()
        assert (hf_logits(other, ids) - ref).abs().max() > 1e-2, (i, part)


# ---- engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},  # whole prompts in one step
        {"max_num_batched_tokens": 7},  # every prefill chunked
        {"num_kv_blocks": 0, "max_num_batched_tokens": 16},  # few blocks: preemption (sized below)
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_greedy_matches_reference(
    deci: tuple[Any, Path], block_size: int, engine_kw: dict[str, int]
) -> None:
    hf, path = deci
    kw = {"num_kv_blocks": 400 // block_size, "max_model_len": 96} | engine_kw
    if kw["num_kv_blocks"] == 0:
        kw["num_kv_blocks"] = 120 // block_size + 1  # two or three requests' worth of blocks
    llm = LLM(model=str(path), block_size=block_size, **kw)
    batch = random_prompts(VOCAB, 1, [5, 23, 40, 9])
    out_lens = [40, 24, 32, 30]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, n, o in zip(batch, out_lens, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
    assert len(set(outs[0].outputs[0].token_ids)) > 8  # not a degenerate repetition
    if engine_kw.get("num_kv_blocks") == 0:
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    check_clean(llm)


@pytest.mark.parametrize("block_size", [16, 4])
def test_prefix_hit_matches_reference(deci: tuple[Any, Path], block_size: int) -> None:
    """A second prompt sharing 36 tokens with the first hits the prefix cache (every attention
    layer's pages of the shared blocks are reused) and still decodes the reference's tokens."""
    hf, path = deci
    llm = LLM(
        model=str(path), block_size=block_size, num_kv_blocks=400 // block_size, max_model_len=96
    )
    first, second = random_prompts(VOCAB, 5, [4, 7], shared=36)
    sp = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    (a,) = llm.generate({"prompt_token_ids": first}, sp, use_tqdm=False)
    (b,) = llm.generate({"prompt_token_ids": second}, sp, use_tqdm=False)
    assert b.num_cached_tokens >= 36 // block_size * block_size > 0
    assert a.outputs[0].token_ids == hf_greedy(hf, first, 28)
    assert b.outputs[0].token_ids == hf_greedy(hf, second, 28)
    check_clean(llm)


def test_logprobs_match_reference(deci: tuple[Any, Path]) -> None:
    """Every position's logprob of a 70-token prompt, prefilled in chunks of 9 (prompt logprobs:
    each position's whole distribution went through the paged path), is within 1e-4 of the
    reference's, and so are the sampled tokens' logprobs: a check finer than greedy agreement."""
    hf, path = deci
    llm = LLM(
        model=str(path),
        block_size=16,
        num_kv_blocks=30,
        max_model_len=128,
        max_num_batched_tokens=9,
    )
    ids = random_prompts(VOCAB, 7, [70])[0]
    (out,) = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(
            temperature=0, max_tokens=12, prompt_logprobs=0, logprobs=0, ignore_eos=True
        ),
        use_tqdm=False,
    )
    got = out.outputs[0].token_ids
    assert got == hf_greedy(hf, ids, 12)
    ref = torch.log_softmax(hf_logits(hf, ids + got), dim=-1)
    plp = out.prompt_logprobs
    assert (
        max(abs(plp[i][ids[i]].logprob - float(ref[i - 1, ids[i]])) for i in range(1, len(ids)))
        < 1e-4
    )
    for i, (t, lp) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
        assert abs(lp[t].logprob - float(ref[len(ids) - 1 + i, t])) < 1e-4, i
    check_clean(llm)


# ---- published configs: plan and parameter counts -----------------------------------------

# Llama-3.3-Nemotron-Super-49B-v1 and Llama-3.1-Nemotron-Ultra-253B-v1 ``block_configs``, run-length
# encoded as (n_heads_in_group or 0 for a no-op attention, ffn_mult or 0 for a no-op FFN, layers),
# from the copies of their HF config.json in NVIDIA's Megatron-Bridge
# (megatron/bridge/models/llama_nemotron/llama_nemotron_config.py). Neither uses replace_with_linear.
SUPER_49B_RUNS = [
    (8, 2.625, 1),
    (8, 5.25, 5),
    (0, 2.625, 2),
    (8, 5.25, 3),
    (0, 3.28125, 1),
    (8, 5.25, 30),
    (0, 1.3125, 1),
    (0, 2.625, 2),
    (0, 1.3125, 1),
    (0, 5.25, 1),
    (0, 1.3125, 1),
    (0, 2.625, 1),
    (0, 1.3125, 3),
    (8, 5.25, 1),
    (0, 1.3125, 1),
    (0, 1.0, 2),
    (0, 1.3125, 1),
    (0, 1.0, 3),
    (0, 1.3125, 2),
    (0, 0.5, 2),
    (0, 1.0, 2),
    (0, 0.5, 2),
    (0, 1.0, 1),
    (0, 0.5, 2),
    (8, 5.25, 9),
]
ULTRA_253B_RUNS = [
    (16, 0.4875, 1),
    (16, 0.975, 1),
    (16, 1.4625, 6),
    (16, 1.95, 1),
    (0, 0, 4),
    (16, 1.95, 3),
    (16, 4.875, 2),
    (0, 0, 6),
    (16, 4.875, 3),
    (0, 0, 5),
    (16, 4.875, 3),
    (16, 2.4375, 1),
    (0, 0, 3),
    (16, 1.95, 3),
    (0, 1.95, 1),
    (16, 4.875, 1),
    (0, 4.875, 1),
    (0, 0, 5),
    (16, 4.875, 4),
    (0, 0, 5),
    (16, 4.875, 4),
    (0, 0, 5),
    (16, 4.875, 4),
    (0, 0, 5),
    (16, 4.875, 4),
    (0, 0, 5),
    (16, 4.875, 1),
    (16, 3.4125, 3),
    (0, 0, 2),
    (16, 2.925, 1),
    (16, 2.4375, 3),
    (0, 2.4375, 2),
    (16, 2.4375, 1),
    (0, 0, 1),
    (0, 2.4375, 7),
    (16, 2.4375, 1),
    (0, 0, 5),
    (16, 2.925, 1),
    (16, 4.875, 1),
    (0, 4.875, 1),
    (16, 4.875, 1),
    (0, 0, 8),
    (0, 36.5625, 1),
    (0, 0, 8),
    (0, 39.0, 1),
    (0, 0, 8),
    (0, 31.40625, 1),
    (0, 0, 5),
    (0, 27.5625, 1),
    (0, 1.95, 1),
    (16, 1.95, 1),
    (16, 2.4375, 1),
    (0, 0, 1),
    (16, 2.4375, 2),
    (16, 3.4125, 1),
    (16, 4.875, 4),
    (16, 2.4375, 1),
]


def published_config(
    runs: list[tuple[int, float, int]], hidden: int, heads: int, factor: float
) -> dict[str, Any]:
    """The released config.json's keys (hidden, heads, vocabulary, Llama-3.1 RoPE, null sizes)."""
    blocks = [
        block(g or None, m or None, attn="" if g else "no_op", ffn="" if m else "no_op")
        for g, m, n in runs
        for _ in range(n)
    ]
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "attention_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": None,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": heads,
        "num_hidden_layers": len(blocks),
        "num_key_value_heads": None,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
        "block_configs": blocks,
        "rope_scaling": {
            "factor": factor,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }


def test_published_parameter_counts() -> None:
    """The per-layer shapes add up to the published sizes: Super "49B" (49.9B on its model
    card) with 49 attention layers of 80, Ultra "253B" with 64 of 162 (and 81 no-op FFNs)."""
    sup = ModelConfig.from_hf_dict(published_config(SUPER_49B_RUNS, 8192, 64, 8.0))
    ultra = ModelConfig.from_hf_dict(published_config(ULTRA_253B_RUNS, 16384, 128, 16.0))
    assert (sup.num_layers, sum(map(sup.owns_kv_cache, range(80)))) == (80, 49)
    assert (ultra.num_layers, sum(map(ultra.owns_kv_cache, range(162)))) == (162, 64)
    assert 49.5e9 < sup.num_params < 50.0e9 and 253.0e9 < ultra.num_params < 254.0e9


@pytest.mark.parametrize(
    "name, runs, hidden, heads, factor, kv_heads",
    [
        ("super-49b", SUPER_49B_RUNS, 8192, 64, 8.0, 8),
        ("ultra-253b", ULTRA_253B_RUNS, 16384, 128, 16.0, 8),
    ],
)
def test_plan_published_kv_bytes_per_token(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    name: str,
    runs: list[tuple[int, float, int]],
    hidden: int,
    heads: int,
    factor: float,
    kv_heads: int,
) -> None:
    """``pagedkv plan`` counts only the attention layers: Σ 2·kv_heads·head_dim·2 B over them
    (Super: 49 × 2·8·128·2 = 200,704 B per token, not 80 layers' 327,680)."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(published_config(runs, hidden, heads, factor)))
    assert (
        main(
            [
                "plan",
                "--model",
                str(p),
                "--memory",
                "80GiB",
                "--block-size",
                "16",
                "--context",
                "8192",
                "--dtype",
                "auto",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    attn_layers = sum(n for g, _, n in runs if g)
    assert heads // next(g for g, _, _ in runs if g) == kv_heads
    assert plan["selected"]["bytes_per_token"] == attn_layers * 2 * kv_heads * 128 * 2
    assert sum(g["num_layers"] for g in plan["selected"]["groups"]) == attn_layers
