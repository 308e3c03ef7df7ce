"""Weight loading: the GGUF reader, dequantization, name mapping and the HF-directory loader."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.models import layers
from pagedkv.models.gguf_loader import dequantize, hf_name, read_gguf, unpermute_qk
from pagedkv.models.loader import get_model, resolve_dtype, resolve_model_path
from pagedkv.ops.kv_cache import allocate_kv_cache
from pagedkv.ops.metadata import AttentionMetadata


@pytest.fixture(scope="module")
def reader(gguf_path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(gguf_path)


@pytest.mark.slow
def test_read_gguf_matches_gguf_reader(gguf_path: Path, reader: gguf.GGUFReader) -> None:
    ours = read_gguf(gguf_path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(ours.metadata)
    for key in keys:
        ref = reader.fields[key].contents()
        got = ours.metadata[key]
        assert got == ref or np.allclose(got, ref), key
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(reversed(t.shape.tolist())) and mine.qtype == t.tensor_type
        assert np.array_equal(mine.raw, t.data.reshape(-1).view(np.uint8)), t.name


@pytest.mark.slow
def test_dequantize_bit_identical_to_gguf(gguf_path: Path, reader: gguf.GGUFReader) -> None:
    ours = read_gguf(gguf_path)
    seen = set()
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        got = dequantize(ours.tensors[t.name])
        assert tuple(got.shape) == ref.shape and np.array_equal(got.float().numpy(), ref), t.name
        seen.add(t.tensor_type.name)
    assert {"Q4_1", "Q8_0", "F32"} <= seen


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16"])
def test_dequantize_other_types_against_gguf(qtype: str) -> None:
    """Round-trip random data through gguf's quantizer, then our dequantizer must equal gguf's."""
    from pagedkv.models.gguf_loader import GGUFTensor

    kind = gguf.GGMLQuantizationType[qtype]
    data = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    packed = gguf.quants.quantize(data, kind)
    tensor = GGUFTensor("x", (8, 64), kind, np.ascontiguousarray(packed).reshape(-1).view(np.uint8))
    ref = gguf.quants.dequantize(packed, kind)
    got = dequantize(tensor).float().numpy()
    assert np.array_equal(got, ref)
    assert 0 < np.abs(got - data).max() < 0.3  # and it is a real (lossy) round trip of the data


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    n_head, rows, cols = 3, 3 * 8, 5
    w = torch.randn(rows, cols)
    # llama.cpp's convert_hf_to_gguf permute (HF half-split -> interleaved pairs).
    permuted = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, n_head), w)
    bias = torch.randn(rows)
    assert torch.equal(
        unpermute_qk(bias.reshape(n_head, 2, -1).swapaxes(1, 2).reshape(rows), n_head), bias
    )


def test_gguf_name_mapping() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.unknown.weight") is None


def _fused_reference(hf_model: Any) -> dict[str, torch.Tensor]:
    """The HF model's parameters under our fused names."""
    sd = hf_model.state_dict()
    out = {
        "model.embed_tokens.weight": sd["model.embed_tokens.weight"],
        "model.norm.weight": sd["model.norm.weight"],
    }
    for i in range(hf_model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[a + "qkv_proj.weight"] = torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"])
        out[a + "o_proj.weight"] = sd[a + "o_proj.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )
        out[p + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
    return out


def test_gguf_weights_identical_to_transformers(pagedkv_model: Any, hf_model: Any) -> None:
    ours = dict(pagedkv_model.model.named_parameters())
    ref = _fused_reference(hf_model)
    assert set(ref) == set(ours)
    for name, w in ref.items():
        assert torch.equal(ours[name], w), name
    model = pagedkv_model.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, not copied


def test_loaded_model_metadata(pagedkv_model: Any, gguf_path: Path) -> None:
    cfg = pagedkv_model.config
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert pagedkv_model.source == gguf_path and pagedkv_model.dtype == torch.float32
    assert pagedkv_model.tokenizer.eos_token_id == cfg.eos_token_id
    n_params = sum(p.numel() for p in pagedkv_model.model.parameters())
    assert n_params == cfg.num_params
    print(f"\nGGUF float32 load: {pagedkv_model.load_seconds:.2f} s")


def test_bf16_load_is_cast_of_fp32(pagedkv_model: Any, pagedkv_model_bf16: Any) -> None:
    bf16 = pagedkv_model_bf16
    assert bf16.dtype == torch.bfloat16
    ref = dict(pagedkv_model.model.named_parameters())
    for name, w in bf16.model.named_parameters():
        assert w.dtype == torch.bfloat16 and torch.equal(w, ref[name].to(torch.bfloat16)), name
    print(f"\nGGUF bfloat16 load: {bf16.load_seconds:.2f} s")


def _one_prompt_logits(loaded: Any, ids: list[int]) -> torch.Tensor:
    cfg, t, bs = loaded.config, len(ids), 16
    _, kv = allocate_kv_cache(
        "LBNHC", cfg.num_layers, 8, bs, cfg.num_kv_heads, cfg.head_dim, loaded.dtype
    )
    table = torch.tensor([[2, 5, 3, 7]], dtype=torch.int32)
    pos = torch.arange(t)
    slots = table[0, pos // bs].long() * bs + pos % bs
    starts, lens = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    md = AttentionMetadata(slots, starts, lens, table, bs, t, t, [0, t], [t])
    return loaded.model.compute_logits(loaded.model.forward(torch.tensor(ids), pos, kv, md))


@pytest.fixture(scope="module")
def hf_dir(hf_model: Any, hf_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference model saved as an HF directory (safetensors + config + tokenizer)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smollm2_hf")
    # A GGUF-quantized model refuses save_pretrained: copy its weights into a plain one.
    config = copy.deepcopy(hf_model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(out)
    hf_tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_hf_directory_loader_matches_gguf(
    pagedkv_model: Any, hf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = get_model(hf_dir, torch.float32)
    assert loaded.tokenizer is not None and loaded.config.architecture == "llama"
    ref = dict(pagedkv_model.model.named_parameters())
    for name, w in loaded.model.named_parameters():
        assert torch.equal(w, ref[name]), name
    text = "Paged attention stores the KV cache in fixed-size blocks"
    ids = pagedkv_model.tokenizer.encode(text)
    assert loaded.tokenizer.encode(text) == ids
    # The GGUF model also carries ggml rows for the native small-batch GEMV (same weights, other
    # summation order): close with it, bit-equal when both take BLAS.
    with_native = _one_prompt_logits(pagedkv_model, ids)
    torch.testing.assert_close(_one_prompt_logits(loaded, ids), with_native, atol=1e-3, rtol=1e-4)
    monkeypatch.setattr(layers, "NATIVE_GEMV_MAX_ROWS", 0)
    assert torch.equal(_one_prompt_logits(loaded, ids), _one_prompt_logits(pagedkv_model, ids))


@pytest.mark.slow
def test_hf_loader_rejects_incomplete_checkpoint(hf_dir: Path, tmp_path: Path) -> None:
    shutil.copy(hf_dir / "config.json", tmp_path / "config.json")
    weights = load_file(str(next(hf_dir.glob("*.safetensors"))))
    weights.pop("model.layers.3.self_attn.k_proj.weight")  # a fused shard goes missing
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="qkv_proj"):
        get_model(tmp_path, torch.float32)
    weights["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(192, 576)
    weights["model.layers.3.self_attn.extra.weight"] = torch.zeros(1)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="extra"):
        get_model(tmp_path, torch.float32)


def test_resolve_paths_and_dtypes(gguf_path: Path, tmp_path: Path) -> None:
    assert resolve_model_path(None) == gguf_path
    assert resolve_model_path(gguf_path) == gguf_path
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert resolve_model_path(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError):
        resolve_model_path(tmp_path / "missing.gguf")
    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError):
        resolve_dtype("int3")


def test_gguf_rope_freq_factors_reproduce_llama3_scaling() -> None:
    """Llama 3.x GGUFs carry ``rope_freqs`` (per-frequency divisors) instead of a scaling config:
    loading them must give the same rope table as HF's "llama3" rope_scaling."""
    from pagedkv.models.config import ModelConfig
    from pagedkv.models.layers import RotaryEmbedding, rope_inv_freq
    from pagedkv.models.llama import LlamaForCausalLM

    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    target = RotaryEmbedding(16, 256, 1e4, scaling)
    config = ModelConfig.from_dict(
        dict(
            architecture="llama",
            num_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            num_kv_heads=1,
            head_dim=16,
            intermediate_size=64,
            vocab_size=8,
            max_position_embeddings=256,
            rope_theta=1e4,
        )
    )
    model = LlamaForCausalLM(config)
    assert not torch.allclose(model.model.rotary_emb.cos_sin_cache, target.cos_sin_cache)
    factors = rope_inv_freq(16, 1e4, None) / rope_inv_freq(16, 1e4, scaling)
    assert model.load_weights([("model.rotary_emb.freq_factors", factors)]) == set()
    torch.testing.assert_close(model.model.rotary_emb.cos_sin_cache, target.cos_sin_cache)
