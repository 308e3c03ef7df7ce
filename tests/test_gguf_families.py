"""GGUF checkpoints of the non-Llama families: Gemma 2, Gemma 3 (text), DeepSeek-V2/V3 (MLA),
Llama 4 (text), and Bamba / GraniteMoeHybrid (llama.cpp's ``granitehybrid``).

Each test builds a tiny random-weight transformers model, writes it as a GGUF the way llama.cpp's
``convert_hf_to_gguf.py`` does (its metadata keys, ``gguf.get_tensor_name_map`` tensor names,
Gemma's norm ``+1``, DeepSeek's stacked experts and, in newer converters, ``kv_b`` split into
``attn_k_b`` / ``attn_v_b``, Llama 4's transposed experts and ``rope_freqs``, Mamba-2's
``-exp(A_log)``, permuted q/k and split Granite MLPs), loads it with ``LLM(model=file.gguf)`` and
checks the config read from the header and the engine's greedy tokens and prompt logprobs
against transformers' forward (logprobs within 1e-4; float32 tensors, one file in float16
against a transformers model holding the same rounded values). Two cases store a tensor
as Q8_0 (a 2-D projection, a stacked 3-D expert tensor) and compare against the transformers
model holding the dequantized values. Files with an unsupported architecture or a missing tensor
fail with a ValueError naming it; a vocabulary we cannot build leaves prompt token ids working.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from engine_utils import random_prompts

from pagedkv import LLM, SamplingParams
from pagedkv.models.config import ModelConfig
from pagedkv.models.gguf_reader import read_gguf
from pagedkv.models.tokenizer import bytes_to_unicode

BLOCK = 4
TOL = 1e-4
WINDOW = 16
Tensors = dict[str, np.ndarray]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """Tiny models: one torch thread runs them fastest and keeps a busy machine's thread
    oversubscription out of the test time."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- a convert_hf_to_gguf.py stand-in


def write_gguf(
    path: Path,
    arch: gguf.MODEL_ARCH,
    meta: Callable[[gguf.GGUFWriter], None],
    tensors: Tensors,
    q8_0: frozenset[str] = frozenset(),
    f16: bool = False,
) -> Path:
    """Write ``tensors`` (float32; those named in ``q8_0`` quantized to Q8_0; with ``f16`` the
    2-D and 3-D ones in float16, as the converter's default ``--outtype f16``) after ``meta``."""
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    meta(w)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float16 if f16 and t.ndim > 1 else np.float32)
        if name in q8_0:
            w.add_tensor(
                name,
                gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mapped(arch: gguf.MODEL_ARCH, n_layers: int, hf_name: str) -> str:
    """The converter's ``map_tensor_name``."""
    name = gguf.get_tensor_name_map(arch, n_layers).get_name(
        hf_name, try_suffixes=(".weight", ".bias")
    )
    assert name is not None, hf_name
    return name


def common_meta(w: gguf.GGUFWriter, c: Any, ffn: int | None = None) -> None:
    """TextModel.set_gguf_parameters: the keys every converter writes."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size if ffn is None else ffn)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)  # no tokenizer below: the vocabulary size says the rows
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def byte_vocab(w: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary: token i < 256 is byte i, token 256 "Hi" (one merge)."""
    spell = bytes_to_unicode()  # GPT-2's printable spelling of each byte
    w.add_tokenizer_model("gpt2")
    w.add_token_list([spell[b] for b in range(256)] + ["Hi"])
    w.add_token_types([int(gguf.TokenType.NORMAL)] * 257)
    w.add_token_merges(["H i"])


def sentencepiece_vocab(w: gguf.GGUFWriter, n: int) -> None:
    """A sentencepiece-style ("llama") vocabulary, as Gemma's converter writes."""
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([int(gguf.TokenType.NORMAL)] * n)


def hf_state(hf: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in hf.state_dict().items()}


# ---------------------------------------------------------------- reference and checks


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt) :]


def check_against_transformers(
    llm: LLM, hf: Any, vocab: int, seed: int, lens: tuple[int, ...] = (37, 9), new_tokens: int = 12
) -> None:
    """Greedy tokens equal transformers' and every prompt position's logprob is within TOL.

    One transformers forward over prompt + output checks both: each output token must be the
    argmax of transformers' logits at the position before it (when all are, the output is exactly
    transformers' greedy continuation)."""
    batch = random_prompts(vocab, seed, list(lens))
    params = SamplingParams(
        temperature=0, max_tokens=new_tokens, prompt_logprobs=0, ignore_eos=True
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, o in zip(batch, outs, strict=True):
        got = list(o.outputs[0].token_ids)
        ref = torch.log_softmax(hf_logits(hf, p + got), dim=-1)
        assert got == ref[len(p) - 1 : -1].argmax(-1).tolist(), f"prompt of {len(p)} tokens"
        err = max(
            abs(o.prompt_logprobs[i][p[i]].logprob - float(ref[i - 1, p[i]]))
            for i in range(1, len(p))
        )
        assert err < TOL, err
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 3  # not one repeated token


def engine(path: Path, **kw: Any) -> LLM:
    return LLM(
        model=str(path), block_size=BLOCK, **({"num_kv_blocks": 100, "max_model_len": 96} | kw)
    )


# ---------------------------------------------------------------- Gemma 2 / Gemma 3


def gemma2_hf(**overrides: Any) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # Real Gemma 2 GGUFs tie the head (the converter drops lm_head); query_pre_attn_scalar is
    # head_dim, which is what llama.cpp assumes for every size but 27B.
    kw = dict(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        initializer_range=0.3,
        tie_word_embeddings=True,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return _randomise_norms(Gemma2ForCausalLM(Gemma2Config(**(kw | overrides))))


def gemma3_hf(**overrides: Any) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    kw = dict(
        vocab_size=192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        query_pre_attn_scalar=16,
        initializer_range=0.3,
        tie_word_embeddings=False,
        rope_parameters=rope,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return _randomise_norms(Gemma3ForCausalLM(Gemma3TextConfig(**(kw | overrides))))


def _randomise_norms(hf: Any) -> Any:
    """Random (1 + w) norms (HF starts them at 0) and a small embedding table: with a tied head a
    large (√hidden-scaled) embedding dominates the residual and greedy just repeats a token."""
    torch.manual_seed(0)
    for name, p in hf.named_parameters():
        torch.nn.init.normal_(p, 0, 0.05 if "embed_tokens" in name else 0.3)
    return hf.eval()


def gemma_gguf(
    path: Path,
    hf: Any,
    arch: gguf.MODEL_ARCH,
    q8_0: frozenset[str] = frozenset(),
    tokenizer: bool = False,
) -> Path:
    """Gemma2Model / Gemma3Model of convert_hf_to_gguf.py: norms stored as w + 1; Gemma 2 writes no
    output tensor; Gemma 3 writes the global and the sliding layers' RoPE bases."""
    c = hf.config

    def meta(w: gguf.GGUFWriter) -> None:
        common_meta(w, c)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        if arch == gguf.MODEL_ARCH.GEMMA2:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        else:
            w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
            w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        if tokenizer:
            byte_vocab(w)
        else:
            sentencepiece_vocab(w, c.vocab_size)

    tensors = {}
    for name, t in hf_state(hf).items():
        if name == "lm_head.weight" and (arch == gguf.MODEL_ARCH.GEMMA2 or c.tie_word_embeddings):
            continue
        tensors[mapped(arch, c.num_hidden_layers, name)] = (
            t + 1 if name.endswith("norm.weight") else t
        ).numpy()
    return write_gguf(path, arch, meta, tensors, q8_0)


def test_gemma2_gguf_config_and_exactness(tmp_path: Path) -> None:
    hf = gemma2_hf()
    path = gemma_gguf(tmp_path / "gemma2.gguf", hf, gguf.MODEL_ARCH.GEMMA2, tokenizer=True)
    cfg = ModelConfig.from_gguf(path)
    assert (cfg.architecture, cfg.sliding_window, cfg.query_pre_attn_scalar) == (
        "gemma2",
        WINDOW,
        16,
    )
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.tie_word_embeddings) == (
        5.0,
        3.0,
        True,
    )
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 16, 257)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())  # tied head counted once
    llm = engine(path)
    assert llm.llm_engine.model.lm_head is llm.llm_engine.model.model.embed_tokens
    check_against_transformers(llm, hf, 257, seed=1)
    # The file's byte-level vocabulary tokenizes text.
    (out,) = llm.generate(
        "Hi, Hi!", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    assert out.prompt_token_ids == [256, ord(","), ord(" "), 256, ord("!")]
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 2)


def test_gemma3_gguf_with_a_q8_0_tensor(tmp_path: Path) -> None:
    """Gemma 3: q/k norms, local RoPE theta from ``rope.freq_base_swa``, five sliding layers to
    one global; ``blk.1.attn_q`` stored as Q8_0 gives transformers' output once transformers holds
    the same dequantized values."""
    hf = gemma3_hf()
    q_name = "blk.1.attn_q.weight"
    path = gemma_gguf(
        tmp_path / "gemma3.gguf", hf, gguf.MODEL_ARCH.GEMMA3, q8_0=frozenset({q_name})
    )
    cfg = ModelConfig.from_gguf(path)
    assert (cfg.architecture, cfg.qk_norm, cfg.rope_theta, cfg.rope_local_theta) == (
        "gemma3_text",
        True,
        1e6,
        1e4,
    )
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (cfg.sliding_window, cfg.tie_word_embeddings, cfg.vocab_size) == (WINDOW, False, 192)
    q = hf.model.layers[1].self_attn.q_proj.weight
    with torch.no_grad():
        dq = gguf.quants.dequantize(
            gguf.quants.quantize(q.detach().numpy(), gguf.GGMLQuantizationType.Q8_0),
            gguf.GGMLQuantizationType.Q8_0,
        )
        assert 0 < (torch.from_numpy(dq) - q).abs().max() < 0.01  # really quantized, and close
        q.copy_(torch.from_numpy(dq))
    llm = engine(path, max_num_batched_tokens=16)  # chunked prefill across the window
    # A sentencepiece vocabulary is not built (yet): prompt token ids work, text is refused.
    assert llm.llm_engine.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", SamplingParams(max_tokens=1), use_tqdm=False)
    check_against_transformers(llm, hf, 192, seed=2, lens=(41, 7), new_tokens=16)


# ---------------------------------------------------------------- DeepSeek-V2 / V3 (MLA)

KV_LORA, ROPE, NOPE, V_DIM, HEADS = 16, 16, 32, 24, 4


def deepseek_hf(v3: bool, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    if v3:  # sigmoid router over 2 groups with a live correction bias; q LoRA
        c = DeepseekV3Config(
            **overrides,
            vocab_size=128,
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
    else:  # V2-Lite style: direct q_proj, softmax group-limited router
        c = DeepseekV2Config(
            vocab_size=128,
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
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(c).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
        for name, b in hf.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    return hf


def deepseek_gguf(
    path: Path, hf: Any, split_kv_b: bool = True, drop: str | None = None, f16: bool = False
) -> Path:
    """DeepseekV2Model of convert_hf_to_gguf.py: MLA written as MQA (head_count_kv 1, key length =
    the latent row), experts stacked per layer, and (``split_kv_b``, converters since 2025)
    kv_b_proj split into k_b [H, R, nope] (transposed) and v_b [H, v, R]."""
    c, arch = hf.config, gguf.MODEL_ARCH.DEEPSEEK2
    n, h = c.num_hidden_layers, c.num_attention_heads

    def meta(w: gguf.GGUFWriter) -> None:
        common_meta(w, c)
        rope = c.rope_parameters
        w.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        if c.model_type == "deepseek_v3":  # scoring_func "sigmoid" in the V3 config.json
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        if c.q_lora_rank is not None:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        if split_kv_b:
            w.add_head_count_kv(1)
            w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
            w.add_value_length(c.kv_lora_rank)
            w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length_mla(c.v_head_dim)
        else:  # the older converter: per-head lengths, kv heads = heads
            w.add_head_count_kv(h)
            w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length(c.v_head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        if c.norm_topk_prob:
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(c.qk_rope_head_dim)

    tensors: Tensors = {}
    for name, t in hf_state(hf).items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate first
            prefix = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            tensors[mapped(arch, n, prefix + "gate_proj.weight")] = gate.numpy()
            tensors[mapped(arch, n, prefix + "up_proj.weight")] = up.numpy()
        elif name.endswith("mlp.experts.down_proj"):
            tensors[mapped(arch, n, name + ".weight")] = t.numpy()
        elif name.endswith("e_score_correction_bias"):
            tensors[mapped(arch, n, name.replace("_bias", ".bias"))] = t.numpy()
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = t.view(h, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            tensors[mapped(arch, n, name.replace("kv_b_proj", "k_b_proj"))] = k_b.transpose(
                1, 2
            ).numpy()
            tensors[mapped(arch, n, name.replace("kv_b_proj", "v_b_proj"))] = v_b.numpy()
        else:
            tensors[mapped(arch, n, name)] = t.numpy()
    if drop is not None:
        del tensors[drop]
    return write_gguf(path, arch, meta, tensors, f16=f16)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = deepseek_hf(v3=True)
    return hf, deepseek_gguf(tmp_path_factory.mktemp("ds3") / "ds3.gguf", hf)


def test_deepseek_v3_gguf_config_and_exactness(deepseek_v3: tuple[Any, Path]) -> None:
    hf, path = deepseek_v3
    names = set(read_gguf(path).tensors)
    assert {
        "blk.1.attn_k_b.weight",
        "blk.1.attn_v_b.weight",
        "blk.1.ffn_gate_exps.weight",
        "blk.1.exp_probs_b.bias",
    } <= names and "blk.1.attn_kv_b.weight" not in names
    cfg = ModelConfig.from_gguf(path)
    mla = cfg.mla
    assert cfg.architecture == "deepseek_v3" and mla is not None
    assert (
        mla.kv_lora_rank,
        mla.q_lora_rank,
        mla.qk_nope_head_dim,
        mla.qk_rope_head_dim,
        mla.v_head_dim,
    ) == (KV_LORA, 24, NOPE, ROPE, V_DIM)
    assert (
        mla.topk_method,
        mla.n_routed_experts,
        mla.num_experts_per_tok,
        mla.n_group,
        mla.topk_group,
    ) == ("noaux_tc", 8, 2, 2, 1)
    assert (
        mla.first_k_dense_replace,
        mla.n_shared_experts,
        mla.routed_scaling_factor,
        mla.norm_topk_prob,
    ) == (1, 1, hf.config.routed_scaling_factor, hf.config.norm_topk_prob)
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, KV_LORA + ROPE)  # one latent row per token
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for n, b in hf.named_buffers() if "e_score_correction_bias" in n
    )
    check_against_transformers(engine(path, max_num_batched_tokens=16), hf, 128, seed=3)


def test_deepseek_v3_gguf_yarn_rope(tmp_path: Path) -> None:
    """YaRN as the converter writes it (type, factor, original context, betas and
    ``yarn_log_multiplier = 0.1·mscale_all_dim``; released checkpoints have mscale ==
    mscale_all_dim): prompt logprobs over 100 tokens, most past the original 32, match."""
    yarn = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=32,
        mscale=0.75,
        mscale_all_dim=0.75,
        beta_fast=32.0,
        beta_slow=1.0,
    )
    hf = deepseek_hf(v3=True, rope_parameters=yarn)
    path = deepseek_gguf(tmp_path / "ds3_yarn.gguf", hf)
    rs = ModelConfig.from_gguf(path).rope_scaling
    assert rs is not None and (
        rs["rope_type"],
        rs["factor"],
        rs["original_max_position_embeddings"],
    ) == ("yarn", 4.0, 32)
    assert rs["mscale_all_dim"] == pytest.approx(0.75, rel=1e-6)
    llm = engine(path, num_kv_blocks=80, max_model_len=128, max_num_batched_tokens=32)
    check_against_transformers(llm, hf, 128, seed=8, lens=(100,), new_tokens=8)


def test_deepseek_v2_gguf_old_converter_layout(tmp_path: Path) -> None:
    """A V2 file from a converter before the k_b/v_b split (one ``attn_kv_b``, per-head key and
    value lengths), no q LoRA, softmax group-limited router; matrices in float16 (the converter's
    default), the transformers model holding the same rounded values."""
    hf = deepseek_hf(v3=False)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.copy_(p.half().float())
    path = deepseek_gguf(tmp_path / "ds2.gguf", hf, split_kv_b=False, f16=True)
    assert (
        read_gguf(path).tensors["blk.1.ffn_gate_exps.weight"].qtype == gguf.GGMLQuantizationType.F16
    )
    cfg = ModelConfig.from_gguf(path)
    assert cfg.architecture == "deepseek_v2" and cfg.mla is not None
    assert (
        cfg.mla.q_lora_rank,
        cfg.mla.qk_nope_head_dim,
        cfg.mla.v_head_dim,
        cfg.mla.rope_style,
    ) == (None, 16, 16, "complex")
    assert (cfg.mla.topk_method, cfg.mla.routed_scaling_factor, cfg.num_kv_heads, cfg.head_dim) == (
        "group_limited_greedy",
        1.5,
        1,
        32 + 8,
    )
    check_against_transformers(engine(path), hf, 128, seed=4, lens=(30,))


# ---------------------------------------------------------------- Llama 4 (text)

CHUNK = 8


def llama4_hf() -> Any:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    # RoPE/chunked layers 0-2, NoPE global layer 3; MoE on layers 1 and 3; llama3 RoPE scaling
    # (the converter writes it as a rope_freqs tensor); floor_scale 4 so the NoPE temperature moves.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    c = Llama4TextConfig(
        vocab_size=160,
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
        rope_parameters=rope,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    hf = Llama4ForCausalLM(c).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
    return hf


def llama3_rope_factors(c: Any) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: per-frequency divisors of llama3 RoPE scaling."""
    rp = c.rope_parameters
    freqs = 1.0 / (rp["rope_theta"] ** (np.arange(0, c.head_dim, 2, dtype=np.float32) / c.head_dim))
    factor, low, high, old = (
        rp["factor"],
        rp["low_freq_factor"],
        rp["high_freq_factor"],
        rp["original_max_position_embeddings"],
    )
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama4_gguf(path: Path, hf: Any, q8_0: frozenset[str] = frozenset()) -> Path:
    """Llama4Model of convert_hf_to_gguf.py: no q/k permutation, experts' gate_up [E, H, 2I]
    transposed and split into gate/up [E, I, H], down [E, I, H] transposed. The chunk size and
    temperature floor (fixed at 8192 in llama.cpp) go in ``attention.sliding_window`` /
    ``attention.temperature_length`` so the tiny model can use small ones."""
    c, arch = hf.config, gguf.MODEL_ARCH.LLAMA4

    def meta(w: gguf.GGUFWriter) -> None:
        common_meta(w, c, ffn=c.intermediate_size_mlp)  # the converter swaps the two sizes
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_dimension_count(c.head_dim)
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_interleave_moe_layer_step(c.interleave_moe_layer_step)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_sliding_window(c.attention_chunk_size)
        w.add_attn_temperature_length(int(c.floor_scale))

    n = c.num_hidden_layers
    tensors: Tensors = {"rope_freqs.weight": llama3_rope_factors(c)}
    for name, t in hf_state(hf).items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.transpose(-1, -2).chunk(2, dim=-2)
            tensors[mapped(arch, n, name.replace("gate_up_proj", "gate_proj.weight"))] = (
                gate.numpy()
            )
            tensors[mapped(arch, n, name.replace("gate_up_proj", "up_proj.weight"))] = up.numpy()
        elif name.endswith("experts.down_proj"):
            tensors[mapped(arch, n, name + ".weight")] = t.transpose(-1, -2).numpy()
        else:
            tensors[mapped(arch, n, name)] = t.numpy()
    return write_gguf(path, arch, meta, tensors, q8_0)


def test_llama4_gguf_config_and_exactness(tmp_path: Path) -> None:
    """Chunked local layers, a NoPE global layer with temperature tuning, MoE + shared expert,
    llama3 RoPE from ``rope_freqs``; the routed experts' stacked down projection is Q8_0."""
    hf = llama4_hf()
    q_name = "blk.1.ffn_down_exps.weight"
    path = llama4_gguf(tmp_path / "llama4.gguf", hf, q8_0=frozenset({q_name}))
    cfg = ModelConfig.from_gguf(path)
    p = cfg.llama4
    assert cfg.architecture == "llama4_text" and p is not None
    assert (cfg.attention_chunk_size, cfg.layer_types) == (
        CHUNK,
        ["chunked_attention"] * 3 + ["full_attention"],
    )
    assert (p.no_rope_layers, p.moe_layers, p.num_local_experts, p.intermediate_size_mlp) == (
        [1, 1, 1, 0],
        [1, 3],
        4,
        96,
    )
    assert (cfg.intermediate_size, p.floor_scale, p.attn_scale, p.use_qk_norm) == (
        64,
        4.0,
        0.1,
        True,
    )
    down = hf.model.layers[1].feed_forward.experts.down_proj  # [E, I, H]; the file holds [E, H, I]
    with torch.no_grad():
        dq = gguf.quants.dequantize(
            gguf.quants.quantize(
                down.detach().transpose(1, 2).contiguous().numpy(), gguf.GGMLQuantizationType.Q8_0
            ),
            gguf.GGMLQuantizationType.Q8_0,
        )
        assert 0 < (torch.from_numpy(dq).transpose(1, 2) - down).abs().max() < 0.02
        down.copy_(torch.from_numpy(dq).transpose(1, 2))
    llm = engine(path, max_num_batched_tokens=16)
    check_against_transformers(llm, hf, 160, seed=5, lens=(45, 11), new_tokens=14)


# ---------------------------------------------------------------- Bamba / GraniteMoeHybrid (granitehybrid)


def bamba_hf() -> Any:
    from transformers import BambaConfig, BambaForCausalLM

    c = BambaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1, 3],
        mamba_n_heads=16,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=256,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return _randomise_mixers(BambaForCausalLM(c), 0)


def granite_hf() -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    c = GraniteMoeHybridConfig(
        vocab_size=128,
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
        mamba_chunk_size=256,
        max_position_embeddings=512,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.25,
        logits_scaling=3.0,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type=None,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return _randomise_mixers(GraniteMoeHybridForCausalLM(c), 1)


def _randomise_mixers(hf: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    for p in hf.parameters():  # the mixers' D, dt_bias and norms start as constants in HF
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3)
    with torch.no_grad():
        for layer in hf.model.layers:
            if getattr(layer, "mamba", None) is not None:
                layer.mamba.A_log.uniform_(-1.0, 1.0)
    return hf.eval()


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: half-split RoPE pairs -> llama.cpp's interleaved ones."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def granite_hybrid_gguf(path: Path, hf: Any, drop: str | None = None) -> Path:
    """GraniteHybridModel of convert_hf_to_gguf.py (Bamba and GraniteMoeHybrid): Mamba2Model's
    tensors (A stored as -exp(A_log) [H, 1], D [H, 1], conv1d squeezed, norm [G, inner/G]),
    q/k permuted for llama.cpp's RoPE, Granite's fused [gate | up] split, per-layer KV heads
    (0 on mixer layers), RoPE only for Bamba, Granite's multipliers as *_scale keys."""
    c, arch = hf.config, gguf.MODEL_ARCH.GRANITE_HYBRID
    bamba = c.model_type == "bamba"
    n, heads, kv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    attn = (
        c.attn_layer_indices
        if bamba
        else [
            i for i, t in enumerate(c.layer_types) if "attention" in t and t != "linear_attention"
        ]
    )
    inner = c.mamba_expand * c.hidden_size

    def meta(w: gguf.GGUFWriter) -> None:
        common_meta(w, c)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        if not bamba:
            w.add_expert_count(c.num_local_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
            w.add_attention_scale(c.attention_multiplier)
            w.add_embedding_scale(c.embedding_multiplier)
            w.add_residual_scale(c.residual_multiplier)
            w.add_logit_scale(c.logits_scaling)
            w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
        w.add_ssm_conv_kernel(c.mamba_d_conv)
        w.add_ssm_state_size(c.mamba_d_state)
        w.add_ssm_group_count(c.mamba_n_groups)
        w.add_ssm_inner_size(inner)
        w.add_ssm_time_step_rank(c.mamba_n_heads)
        head_dim = c.hidden_size // heads
        w.add_rope_dimension_count(
            int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))
        )
        w.add_head_count_kv([kv if i in attn else 0 for i in range(n)])
        w.add_rope_scaling_finetuned(bamba)  # the converter's "use_rope" flag

    tensors: Tensors = {}

    def put(hf_name: str, t: torch.Tensor) -> None:
        tensors[mapped(arch, n, hf_name)] = t.contiguous().numpy()

    for name, t in hf_state(hf).items():
        if name.endswith("mamba.dt_bias"):
            put(name.replace("dt_bias", "dt_proj.bias"), t)
        elif name.endswith("mamba.A_log"):
            put(name, -torch.exp(t).reshape(-1, 1))
        elif name.endswith("mamba.D"):
            put(name, t.reshape(-1, 1))
        elif name.endswith("mamba.conv1d.weight"):
            put(name, t.squeeze(1))
        elif name.endswith("mamba.norm.weight"):
            put(name, t.reshape(c.mamba_n_groups, -1))
        elif name.endswith("self_attn.q_proj.weight"):
            put(name, permute_qk(t, heads))
        elif name.endswith("self_attn.k_proj.weight"):
            put(name, permute_qk(t, kv))
        elif name.endswith(
            ("shared_mlp.input_linear.weight", "block_sparse_moe.experts.gate_up_proj")
        ):
            gate, up = t.chunk(2, dim=-2)  # [.., 2I, H]: gate rows first
            layer = name.split(".")[2]
            kind = "exps" if "experts" in name else "shexp"
            tensors[f"blk.{layer}.ffn_gate_{kind}.weight"] = gate.contiguous().numpy()
            tensors[f"blk.{layer}.ffn_up_{kind}.weight"] = up.contiguous().numpy()
        elif name.endswith("block_sparse_moe.experts.down_proj"):
            tensors[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = t.numpy()
        elif name.endswith("block_sparse_moe.router.weight"):
            tensors[f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"] = t.numpy()
        else:
            put(name, t)
    if drop is not None:
        del tensors[drop]
    return write_gguf(path, arch, meta, tensors)


def test_bamba_gguf_config_and_exactness(tmp_path: Path) -> None:
    """Bamba in llama.cpp's granitehybrid: Mamba-2 mixers on layers 0 and 2, partial-RoPE
    attention on 1 and 3 (q/k un-permuted), final_layernorm."""
    hf = bamba_hf()
    path = granite_hybrid_gguf(tmp_path / "bamba.gguf", hf)
    cfg = ModelConfig.from_gguf(path)
    m = cfg.mamba
    assert cfg.architecture == "bamba" and m is not None and cfg.granite is None
    assert (m.attn_layer_indices, m.n_heads, m.d_head, m.n_groups, m.d_state, m.d_conv) == (
        [1, 3],
        16,
        8,
        1,
        16,
        4,
    )
    assert (m.conv_bias, m.proj_bias, m.partial_rotary_factor, cfg.num_kv_heads, cfg.head_dim) == (
        True,
        False,
        0.5,
        2,
        16,
    )
    check_against_transformers(
        engine(path, max_num_batched_tokens=16), hf, 128, seed=6, lens=(40, 9)
    )


def test_granitemoehybrid_gguf_config_and_exactness(tmp_path: Path) -> None:
    """GraniteMoeHybrid in granitehybrid: NoPE attention, multipliers, shared MLP + 4 experts."""
    hf = granite_hf()
    path = granite_hybrid_gguf(tmp_path / "granite.gguf", hf)
    cfg = ModelConfig.from_gguf(path)
    g, m = cfg.granite, cfg.mamba
    assert cfg.architecture == "granitemoehybrid" and g is not None and m is not None
    assert m.attn_layer_indices == [1, 3]
    assert (
        g.embedding_multiplier,
        g.residual_multiplier,
        g.attention_multiplier,
        g.logits_scaling,
    ) == (2.0, 0.5, 0.25, 3.0)  # float32 in the file: exactly representable values
    assert (g.shared_intermediate_size, g.num_local_experts, g.num_experts_per_tok, g.rope) == (
        48,
        4,
        2,
        False,
    )
    check_against_transformers(engine(path), hf, 128, seed=7, lens=(33,))


# ---------------------------------------------------------------- facts the header leaves out


def test_header_defaults_follow_llama_cpp() -> None:
    """What llama.cpp assumes where a GGUF is silent: Gemma's query scale is (hidden/heads)^-0.5
    for the 27B models (46 / 62 layers) and head_dim^-0.5 otherwise unless ``attention.scale``
    says; Llama 4 chunks at 8192 unless ``sliding_window`` is 0 (then RoPE everywhere, no
    chunks), drops q/k norms at 128 experts; granitehybrid without the RoPE flag is Granite."""
    from pagedkv.models.gguf_config import hf_config_from_gguf

    def cfg(arch: str, shapes: dict[str, tuple[int, ...]] | None = None, **kv: Any) -> ModelConfig:
        meta = {"general.architecture": arch} | {f"{arch}.{k}": v for k, v in kv.items()}
        return ModelConfig.from_hf_dict(
            hf_config_from_gguf(meta, shapes or {"token_embd.weight": (32, 8)})
        )

    gemma = {
        "embedding_length": 4608,
        "feed_forward_length": 64,
        "attention.head_count": 32,
        "attention.head_count_kv": 16,
        "attention.key_length": 128,
        "attention.sliding_window": 4096,
    }
    assert cfg("gemma2", block_count=46, **gemma).query_pre_attn_scalar == 144
    assert cfg("gemma2", block_count=42, **gemma).query_pre_attn_scalar == 128
    assert (
        cfg("gemma3", block_count=42, **gemma, **{"attention.scale": 0.125}).query_pre_attn_scalar
        == 64
    )
    g3 = cfg("gemma3", block_count=12, **gemma)
    assert (g3.rope_local_theta, g3.layer_types[:6]) == (
        10000.0,
        ["sliding_attention"] * 5 + ["full_attention"],
    )
    llama4 = {
        "block_count": 4,
        "embedding_length": 64,
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "expert_count": 16,
        "expert_feed_forward_length": 64,
    }
    l4 = cfg("llama4", **llama4)
    assert (l4.attention_chunk_size, l4.llama4.floor_scale, l4.llama4.use_qk_norm) == (
        8192,
        8192.0,
        True,
    )
    l4 = cfg("llama4", **llama4 | {"attention.sliding_window": 0, "expert_count": 128})
    assert (
        l4.attention_chunk_size,
        l4.layer_types,
        l4.llama4.no_rope_layers,
        l4.llama4.use_qk_norm,
    ) == (None, None, [1, 1, 1, 1], False)
    hybrid = {
        "block_count": 2,
        "embedding_length": 64,
        "attention.head_count": 4,
        "attention.head_count_kv": [0, 2],
        "ssm.time_step_rank": 16,
        "ssm.inner_size": 128,
        "ssm.state_size": 16,
        "ssm.conv_kernel": 4,
    }
    assert cfg("granitehybrid", **hybrid).architecture == "granitemoehybrid"
    assert (
        cfg("granitehybrid", **hybrid, **{"rope.scaling.finetuned": True}).architecture == "bamba"
    )
    with pytest.raises(ValueError, match="lacks granitehybrid.ssm.state_size"):
        cfg("granitehybrid", **{k: v for k, v in hybrid.items() if k != "ssm.state_size"})


# ---------------------------------------------------------------- bad files


def test_missing_tensor_is_named(deepseek_v3: tuple[Any, Path], tmp_path: Path) -> None:
    hf, _ = deepseek_v3
    path = deepseek_gguf(tmp_path / "no_v_b.gguf", hf, drop="blk.2.attn_v_b.weight")
    with pytest.raises(ValueError, match=r"blk\.2\.attn_v_b\.weight is missing"):
        engine(path)
    path = deepseek_gguf(tmp_path / "no_norm.gguf", hf, drop="blk.0.attn_kv_a_norm.weight")
    with pytest.raises(ValueError, match=r"kv_a_layernorm"):
        engine(path)
    path = granite_hybrid_gguf(
        tmp_path / "no_up.gguf", granite_hf(), drop="blk.3.ffn_up_shexp.weight"
    )
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up_shexp\.weight is missing"):
        engine(path)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    def meta(w: gguf.GGUFWriter) -> None:
        w.add_block_count(1)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_vocab_size(16)

    path = write_gguf(
        tmp_path / "rwkv.gguf",
        gguf.MODEL_ARCH.RWKV6,
        meta,
        {"token_embd.weight": np.zeros((16, 8), np.float32)},
    )
    with pytest.raises(ValueError, match="unsupported architecture 'rwkv6'"):
        engine(path)
