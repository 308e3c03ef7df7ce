"""The Llama-family model over a paged KV cache against transformers' float32 forward.

Each step is built by hand the way the engine's ModelRunner will: a flat batch of tokens from
several sequences, random (non-contiguous) block tables, ``slot_mapping`` for the new tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.models.loader import LoadedModel, get_model
from pagedkv.ops.kv_cache import allocate_kv_cache
from pagedkv.ops.metadata import AttentionMetadata

BLOCK_SIZE = 16
FP32_TOL = 1e-4

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
    "Paged attention splits the key-value cache of every sequence into fixed-size blocks, so memory is "
    "allocated on demand and shared between requests that start with the same prompt. The block table maps",
    "1, 1, 2, 3, 5, 8, 13, 21, 34,",
    "日本の首都は東京です。フランスの首都は",
]


@dataclass(slots=True)
class Seq:
    """One sequence's tokens and its block table (random physical blocks)."""

    ids: list[int]
    blocks: list[int]
    cached: int = 0  # tokens already written to the KV cache
    logits: list[torch.Tensor] = field(default_factory=list)  # ours, one row per computed position


class PagedRunner:
    """A minimal stand-in for the engine's ModelRunner: KV cache + hand-built metadata."""

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, layout: str = "LBNHC", seed: int = 0
    ) -> None:
        cfg = loaded.config
        self.loaded = loaded
        _, self.kv_caches = allocate_kv_cache(
            layout,
            cfg.num_layers,
            num_blocks,
            BLOCK_SIZE,
            cfg.num_kv_heads,
            cfg.head_dim,
            loaded.dtype,
        )
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)

    def add(self, ids: Sequence[int], max_len: int) -> Seq:
        n = -(-max_len // BLOCK_SIZE)
        blocks, self.free = self.free[:n], self.free[n:]
        assert len(blocks) == n, "test KV cache too small"
        return Seq(list(ids), blocks)

    def step(self, work: list[tuple[Seq, int]]) -> None:
        """Run ``n`` new tokens of each ``(seq, n)`` in ONE flat batch; keep logits of every token."""
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for seq, n in work:
            for p in range(seq.cached, seq.cached + n):
                ids.append(seq.ids[p])
                positions.append(p)
                slots.append(seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            starts.append(starts[-1] + n)
            lens.append(seq.cached + n)
        width = max(len(s.blocks) for s, _ in work)
        table = torch.zeros(len(work), width, dtype=torch.int32)
        for i, (seq, _) in enumerate(work):
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_table=table,
            block_size=BLOCK_SIZE,
            max_query_len=max(n for _, n in work),
            max_seq_len=max(lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=lens,
        )
        model = self.loaded.model
        hidden = model.forward(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(positions), self.kv_caches, md
        )
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (
            len(ids),
            self.loaded.config.vocab_size,
        )
        for i, (seq, n) in enumerate(work):
            seq.logits.extend(logits[starts[i] : starts[i] + n])
            seq.cached += n


def _compare(
    seqs: list[Seq], reference: Callable[[Sequence[int]], torch.Tensor]
) -> tuple[float, float]:
    """(max |ours - ref| over every computed position, top-1 agreement rate)."""
    max_diff, agree, total = 0.0, 0, 0
    for seq in seqs:
        ours = torch.stack(seq.logits)
        ref = reference(seq.ids[: seq.cached])
        assert ours.shape == ref.shape
        max_diff = max(max_diff, (ours - ref).abs().max().item())
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += ours.shape[0]
    return max_diff, agree / total


@pytest.fixture(scope="module")
def prompt_ids(pagedkv_model: LoadedModel) -> list[list[int]]:
    ids = [pagedkv_model.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "prompts must have different lengths"
    assert max(len(i) for i in ids) > 2 * BLOCK_SIZE  # some sequence spans several blocks
    return ids


@pytest.mark.slow
def test_flat_prefill_batch_matches_transformers(
    pagedkv_model: LoadedModel,
    prompt_ids: list[list[int]],
    hf_logits: Callable[[Sequence[int]], torch.Tensor],
) -> None:
    runner = PagedRunner(pagedkv_model, num_blocks=64)
    seqs = [runner.add(ids, len(ids)) for ids in prompt_ids]
    runner.step([(s, len(s.ids)) for s in seqs])
    max_diff, agree = _compare(seqs, hf_logits)
    n = sum(len(s.ids) for s in seqs)
    print(f"\nflat prefill ({n} tokens): max |dlogit| = {max_diff:.2e}, top-1 = {agree:.3f}")
    assert max_diff < FP32_TOL
    assert agree == 1.0


@pytest.mark.slow
def test_chunked_prefill_and_decode_match_transformers(
    pagedkv_model: LoadedModel,
    prompt_ids: list[list[int]],
    hf_logits: Callable[[Sequence[int]], torch.Tensor],
) -> None:
    decode_steps = 4
    runner = PagedRunner(pagedkv_model, num_blocks=96, layout="LBHNC", seed=1)
    seqs = [runner.add(ids, len(ids) + decode_steps + 1) for ids in prompt_ids]
    # Step 1: the first chunk of every prompt (sequence 0 is done in one chunk).
    first = [
        len(s.ids) if i == 0 else max(1, len(s.ids) * (i + 1) // 7) for i, s in enumerate(seqs)
    ]
    runner.step([(s, n) for s, n in zip(seqs, first)])

    def greedy(seq: Seq) -> None:
        seq.ids.append(int(seq.logits[-1].argmax()))

    greedy(seqs[0])
    # Step 2 is mixed: sequence 0 decodes while the others prefill their second chunk against
    # the context cached by step 1.
    runner.step([(s, len(s.ids) - s.cached) for s in seqs])
    for s in seqs[1:]:
        greedy(s)
    for _ in range(decode_steps):
        for s in seqs:
            if len(s.ids) == s.cached:
                greedy(s)
        runner.step([(s, 1) for s in seqs])
    max_diff, agree = _compare(seqs, hf_logits)
    print(f"\nchunked prefill + decode: max |dlogit| = {max_diff:.2e}, top-1 = {agree:.3f}")
    assert all(s.cached >= len(p) + decode_steps for s, p in zip(seqs, prompt_ids))
    assert max_diff < FP32_TOL
    assert agree == 1.0


@pytest.mark.slow
def test_bf16_top1_agreement(
    pagedkv_model_bf16: LoadedModel,
    prompt_ids: list[list[int]],
    hf_logits: Callable[[Sequence[int]], torch.Tensor],
) -> None:
    bf16 = pagedkv_model_bf16
    assert bf16.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    runner = PagedRunner(bf16, num_blocks=64, seed=2)
    seqs = [runner.add(ids, len(ids)) for ids in prompt_ids]
    runner.step([(s, len(s.ids)) for s in seqs])
    max_diff, agree = _compare(seqs, hf_logits)
    print(f"\nbf16 vs HF fp32: top-1 agreement = {agree:.3f}, max |dlogit| = {max_diff:.2f}")
    assert agree >= 0.9


# ---- tiny random-weight models of other architectures, against transformers' own forward ----


def _tiny_hf_model(kind: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers import LlamaForCausalLM as HFLlama
    from transformers import MistralForCausalLM as HFMistral

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    if kind == "qwen2":  # q/k/v bias, rope theta 1e6
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, rope_theta=1e6, **common))
    elif kind == "llama3_rope":  # llama3 rope scaling, 4:1 GQA, untied head
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        model = HFLlama(LlamaConfig(num_key_value_heads=1, rope_parameters=rope, **common))
    elif kind == "llama_tied_linear_rope":
        rope = dict(rope_type="linear", rope_theta=500.0, factor=4.0)
        model = HFLlama(
            LlamaConfig(
                num_key_value_heads=2, rope_parameters=rope, tie_word_embeddings=True, **common
            )
        )
    elif kind == "mistral_sliding":  # every layer attends to the last 8 positions only
        model = HFMistral(MistralConfig(num_key_value_heads=2, sliding_window=8, **common))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: randomize so both are tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


@pytest.mark.parametrize(
    "kind", ["qwen2", "llama3_rope", "llama_tied_linear_rope", "mistral_sliding"]
)
def test_tiny_random_models_match_transformers(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = _tiny_hf_model(kind)
    hf.save_pretrained(tmp_path)
    loaded = get_model(tmp_path, torch.float32)
    assert loaded.tokenizer is None  # no tokenizer.json saved: the model loads anyway
    cfg = loaded.config
    if kind == "qwen2":
        assert cfg.attention_bias and cfg.rope_theta == 1e6
        assert loaded.model.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    if kind == "mistral_sliding":
        assert loaded.model.model.layers[0].self_attn.sliding_window == 8

    def reference(ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([list(ids)])).logits[0]

    gen = torch.Generator().manual_seed(1)
    runner = PagedRunner(loaded, num_blocks=48, seed=3)
    seqs = [
        runner.add(torch.randint(0, 96, (n,), generator=gen).tolist(), n + 3) for n in (70, 33, 9)
    ]
    runner.step([(s, 40 if len(s.ids) == 70 else len(s.ids)) for s in seqs])  # seq 0 chunked
    runner.step([(seqs[0], 30)])
    for _ in range(3):
        for s in seqs:
            s.ids.append(int(s.logits[-1].argmax()))
        runner.step([(s, 1) for s in seqs])
    max_diff, agree = _compare(seqs, reference)
    print(f"\ntiny {kind}: max |dlogit| = {max_diff:.2e}, top-1 = {agree:.3f}")
    assert max_diff < FP32_TOL
    assert agree == 1.0


@pytest.mark.parametrize(
    "rope",
    [
        None,
        dict(rope_type="linear", factor=4.0),
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ],
)
def test_rotary_embedding_bit_identical_to_transformers(rope: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from pagedkv.models.layers import RotaryEmbedding

    theta, head_dim, t = 1e5, 64, 300
    params = {"rope_type": "default", "rope_theta": theta, **(rope or {})}
    cfg = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters=params,
    )
    positions = torch.randperm(4096, generator=torch.Generator().manual_seed(0))[:t]
    x = torch.randn(t, 12, head_dim, generator=torch.Generator().manual_seed(1)) * 4
    cos, sin = LlamaRotaryEmbedding(cfg)(x, positions[None])
    ref, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding.apply(
        x, *RotaryEmbedding(head_dim, 4096, theta, rope).cos_sin(positions)
    )
    assert torch.equal(ours, ref[0].transpose(0, 1))
