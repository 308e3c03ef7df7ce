"""Token eviction on the default model (float32): StreamingLLM checked token by token against
transformers under the same visibility mask, SnapKV's selection against a plain loop and its
compaction byte for byte, both policies exact while they drop nothing, memory flat, and bad
settings refused with the engine serving on."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.core.token_eviction import KVEvictionConfig
from pagedkv.models.layers import RotaryEmbedding
from pagedkv.ops.token_eviction import rerotate_keys, snapkv_select

BS = 16
NEAR_TIE = 1e-3
TEXT = (
    "The lighthouse keeper wrote in his log every evening. The storm came from the west and "
    "the boats stayed in the harbour. "
)


@pytest.fixture(scope="module")
def llm():
    return LLM(
        num_kv_blocks=160,
        max_model_len=2048,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
    )


def _engine(llm):
    return llm.llm_engine


def _prompt(llm, reps: int) -> list[int]:
    return _engine(llm).tokenizer.encode(TEXT * reps)


def _greedy(llm, ids, n, ev=None):
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, kv_eviction=ev)
    out = llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids
    kv = _engine(llm).scheduler.kv_cache_manager
    kv.release_deferred()
    kv.check_invariants()
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1
    return list(out)


def _assert_greedy_follows(logits, n_prompt, out):
    """The engine's greedy tokens ``out`` are the argmax of transformers' ``logits`` rows from
    the last prompt position on, up to a float near-tie (where the sequences may part)."""
    for i, tok in enumerate(out):
        row = logits[n_prompt - 1 + i]
        ref = int(row.argmax())
        if ref != tok:
            gap = float(row[ref] - row[tok])
            assert gap < NEAR_TIE, f"token {i}: engine {tok}, transformers {ref} (gap {gap})"
            return


def streaming_visibility(n_prompt: int, n_total: int, ev: KVEvictionConfig) -> torch.Tensor:
    """``mask [n_total, n_total]`` (bool): which positions each position reads under the
    streaming schedule (prefill chunks of ``chunk_tokens``, then one token a step), written
    from the policy's description, independently of the manager's code."""
    S = math.ceil(ev.sink_tokens / BS) * BS
    chunk = ev.chunk_tokens(BS)
    evicted, start = 0, 0
    mask = torch.zeros(n_total, n_total, dtype=torch.bool)
    while start < n_total:
        n = min(chunk, n_prompt - start) if start < n_prompt else 1
        # Before the step: drop whole blocks after the sinks while the window keeps recent.
        while (start - evicted) - S - BS >= ev.recent_tokens:
            evicted += BS
        for p in range(start, start + n):
            mask[p, : p + 1] = True
            mask[p, S : S + evicted] = False
        start += n
    return mask


def test_streaming_matches_transformers_under_the_same_mask(llm, hf_model):
    ev = KVEvictionConfig("streaming", sink_tokens=4, budget_tokens=132)
    ids = _prompt(llm, 8)[:300]
    out = _greedy(llm, ids, 120, _as_dict(ev))
    seq = ids + out
    mask = streaming_visibility(len(ids), len(seq) - 1, ev)
    # The test really evicts (and keeps the sinks): the last token reads under half the text.
    assert mask[-1, :16].all() and not mask[-1, 16:100].any()
    assert int(mask[-1].sum()) < len(seq) // 2
    bias = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        logits = hf_model(
            torch.tensor([seq[:-1]]), attention_mask=bias[None, None], position_ids=None
        ).logits[0]
    _assert_greedy_follows(logits, len(ids), out)


def _as_dict(ev: KVEvictionConfig) -> dict:
    return {
        "policy": ev.policy,
        "sink_tokens": ev.sink_tokens,
        "recent_tokens": ev.recent_tokens,
        "budget_tokens": ev.budget_tokens,
    }


@pytest.mark.parametrize(
    "ev",
    [
        {"policy": "streaming", "budget_tokens": 1024},
        {"policy": "streaming", "budget_tokens": 1024, "positions": "cache"},
        {"policy": "snapkv", "budget_tokens": 1024},
        {"policy": "pyramidkv", "budget_tokens": 1024},
    ],
)
def test_a_policy_that_drops_nothing_is_exact(llm, ev):
    ids = _prompt(llm, 6)
    assert _greedy(llm, ids, 24, ev) == _greedy(llm, ids, 24)


def test_streaming_memory_is_flat(llm):
    ev = {"policy": "streaming", "budget_tokens": 128}
    eng = _engine(llm)
    kv = eng.scheduler.kv_cache_manager
    ids = _prompt(llm, 20)[:900]
    sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, kv_eviction=ev)
    eng.add_request("flat", {"prompt_token_ids": ids}, sp)
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        blocks = kv.get_block_ids("flat")[0]
        if blocks:
            held.append(len(blocks))
    cap = KVEvictionConfig.from_value(ev).max_blocks_per_request(BS, 900, 200)
    assert max(held) <= cap < math.ceil(1100 / BS) / 4
    assert held[-1] >= cap - 2  # it sits at the ceiling, not below it by luck


@pytest.mark.parametrize(
    "ev",
    [
        {"policy": "streaming", "budget_tokens": 128},
        {"policy": "snapkv", "budget_tokens": 160},
        {"policy": "pyramidkv", "budget_tokens": 160},
    ],
)
def test_plan_and_engine_agree_on_the_per_request_peak(llm, capsys, ev):
    import json

    from pagedkv.entrypoints.cli import main

    n_prompt, n_out = 700, 40
    argv = ["plan", "--json", "--context", str(n_prompt + n_out), "--output-tokens", str(n_out)]
    assert main([*argv, "--kv-eviction", json.dumps(ev)]) == 0
    row = json.loads(capsys.readouterr().out)["eviction"][0]
    eng = _engine(llm)
    pool = eng.scheduler.kv_cache_manager.block_pool
    ids = (_prompt(llm, 40) * 2)[:n_prompt]
    sp = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True, kv_eviction=ev)
    eng.add_request("plan-agree", {"prompt_token_ids": ids}, sp)
    used = []
    while eng.has_unfinished_requests():
        eng.step()
        used.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
    assert max(used) == row["peak_blocks_per_request"]
    assert used[-1] <= row["steady_blocks_per_request"] < row["exact_blocks_per_request"]


def test_snapkv_select_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    L, hkv, group, d, w = 50, 2, 3, 8, 6
    q = torch.randn(w, hkv * group, d, generator=g)
    k = torch.randn(L, hkv, d, generator=g)
    budget, sink, recent, kern = 20, 3, 6, 5
    idx = snapkv_select(q, k, 0.35, budget, sink, recent, kern)
    for h in range(hkv):
        score = torch.zeros(L)
        for qh in range(h * group, (h + 1) * group):
            for i in range(w):
                vis = L - w + i + 1
                p = torch.softmax(torch.mv(k[:vis, h], q[i, qh]) * 0.35, 0)
                score[:vis] += p / group
        pooled = torch.tensor(
            [sum(score[j] for j in range(c - 2, c + 3) if 0 <= j < L) / kern for c in range(L)]
        )
        middle = sorted(range(sink, L - recent), key=lambda j: -float(pooled[j]))[
            : budget - sink - recent
        ]
        want = sorted(list(range(sink)) + middle + list(range(L - recent, L)))
        assert idx[h].tolist() == want


def test_snapkv_compaction_moves_each_heads_kept_rows(llm):
    eng = _engine(llm)
    runner = eng.runner
    seen = {}
    real = runner.execute_model_input

    def spy(mi):
        for s in mi.scheduled:
            if s.compaction is not None:
                seen["old"] = list(s.block_ids[0])
                seen["new"] = list(s.compaction.block_ids)
                seen["k0"] = [kc.clone() for kc, _ in runner.kv_caches[:2]]
        out = real(mi)
        if "old" in seen and "after" not in seen:
            seen["after"] = [(kc.clone(), vc.clone()) for kc, vc in runner.kv_caches[:2]]
        return out

    runner.execute_model_input = spy
    try:
        ids = _prompt(llm, 12)
        out = _greedy(llm, ids, 8, {"policy": "snapkv", "budget_tokens": 96})
    finally:
        runner.execute_model_input = real
    assert len(out) == 8 and "after" in seen
    sel = runner.last_kv_selection
    (idx_layers,) = sel.values()
    for layer in range(2):
        idx = idx_layers[layer]
        assert idx.shape == (3, 96)
        assert idx[:, :4].tolist() == [[0, 1, 2, 3]] * 3  # sinks
        window = list(range(len(ids) - 32, len(ids)))
        assert idx[:, -32:].tolist() == [window] * 3  # the observation window
        k_after, v_after = seen["after"][layer]
        for h in range(3):
            for j in (0, 10, 50, 95):
                src = int(idx[h, j])
                ob, oo = seen["old"][src // BS], src % BS
                nb, no = seen["new"][j // BS], j % BS
                assert torch.equal(k_after[nb, no, h], k_after[ob, oo, h])
                assert torch.equal(v_after[nb, no, h], v_after[ob, oo, h])
    # Heads choose differently (the selection is per KV head).
    assert any(not torch.equal(idx_layers[5][0], idx_layers[5][h]) for h in (1, 2))


def test_pyramidkv_keeps_fewer_tokens_in_deeper_layers_and_decodes(llm):
    ids = _prompt(llm, 12)
    ev = {"policy": "pyramidkv", "budget_tokens": 96}
    out = _greedy(llm, ids, 12, ev)
    (layers,) = _engine(llm).runner.last_kv_selection.values()
    sizes = [int(x.shape[1]) for x in layers]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 96 > sizes[-1]
    want = KVEvictionConfig("pyramidkv", budget_tokens=96, num_layers=30).kept_tokens(len(ids))
    assert sizes == want
    for x in layers:  # sinks and the observation window in every layer
        assert x[:, :4].tolist() == [[0, 1, 2, 3]] * 3
        assert x[:, -32:].tolist() == [list(range(len(ids) - 32, len(ids)))] * 3
    # Decoding after the compression goes on with per-layer shifts; an exact first token.
    assert len(out) == 12 and out[0] == _greedy(llm, ids, 1)[0]


def test_pyramid_layer_metadata_shifts_slots_and_lengths(llm):
    from pagedkv.engine.model_input import ModelInput, ScheduledTokens

    runner = _engine(llm).runner
    shift = [0] * 10 + [5] * 10 + [21] * 10
    a = ScheduledTokens("a", [1], 100, ([7, 3, 9, 4, 8, 2, 6, 5],), True, kv_offset=20)
    a.layer_shift = shift
    b = ScheduledTokens("b", [1, 2, 3], 10, ([11, 12],), True)
    mi = ModelInput([a, b])
    _, _, mds, _ = runner.prepare_inputs(mi)
    per_layer = runner._shifted_layer_metadata(mi, mds[0])
    assert len(per_layer) == 30 and per_layer[0] is mds[0]

    def slot(table, idx):
        return table[idx // BS] * BS + idx % BS

    for layer, d in ((12, 5), (29, 21)):
        md = per_layer[layer]
        want_a = slot(a.block_ids[0], 100 - 20 - d)
        want_b = [slot(b.block_ids[0], i) for i in (10, 11, 12)]
        assert md.slot_mapping.tolist() == [want_a, *want_b]
        assert md.seq_lens_cpu == [81 - d, 13] and md.seq_lens.tolist() == [81 - d, 13]
    assert per_layer[12] is per_layer[15]  # one metadata per distinct shift


def _per_head_masked_logits(hf_model, seq, n_prompt, selection):
    """transformers' logits over ``seq`` where, in layer ``l`` and KV head ``h``, every query
    after the prompt reads of the prompt only the tokens ``selection[l][h]`` (and everything
    after the prompt, causally): the visibility SnapKV/PyramidKV leave. A registered attention
    function applies the per-layer, per-head mask (an independent reference: no pagedkv code)."""
    from transformers import AttentionInterface

    T = len(seq)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    masks = []
    for sel in selection:
        hkv = sel.shape[0]
        m = causal.expand(hkv, T, T).clone()
        keep = torch.zeros(hkv, n_prompt, dtype=torch.bool)
        keep.scatter_(1, sel.long(), True)
        m[:, n_prompt:, :n_prompt] &= keep[:, None, :]
        masks.append(m)

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        g = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(g, dim=1)
        v = value.repeat_interleave(g, dim=1)
        scores = (query @ k.transpose(-1, -2)) * scaling
        vis = masks[module.layer_idx].repeat_interleave(g, dim=0)[None]
        scores = scores.masked_fill(~vis, float("-inf"))
        out = torch.softmax(scores.float(), dim=-1).to(query.dtype) @ v
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("pagedkv_per_head_mask", attend)
    old = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("pagedkv_per_head_mask")
    try:
        with torch.inference_mode():
            return hf_model(torch.tensor([seq])).logits[0]
    finally:
        hf_model.set_attn_implementation(old)


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv"])
def test_compaction_matches_transformers_with_the_same_tokens_dropped(llm, hf_model, policy):
    """The tokens generated after a compression are transformers' under a mask that hides,
    per layer and KV head, the prompt tokens the selection dropped: compaction, the per-head
    copy, cache indices and (pyramidkv) the per-layer shifts lose nothing else."""
    ids = _prompt(llm, 10)
    out = _greedy(llm, ids, 16, {"policy": policy, "budget_tokens": 80})
    (selection,) = _engine(llm).runner.last_kv_selection.values()
    assert selection[0].shape[1] < len(ids)  # something was dropped
    logits = _per_head_masked_logits(hf_model, ids + out[:-1], len(ids), selection)
    with torch.inference_mode():
        plain = hf_model(torch.tensor([ids + out[:-1]])).logits[0]
    n = len(ids)
    assert (logits[n:] - plain[n:]).abs().max() > 1e-2  # the dropped tokens mattered
    torch.testing.assert_close(logits[:n], plain[:n], atol=1e-4, rtol=1e-4)  # the prompt: exact
    _assert_greedy_follows(logits, len(ids), out)


def test_rerotation_equals_writing_at_the_shifted_position():
    rope = RotaryEmbedding(64, 512, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(40, 3, 64, generator=g)
    pos = torch.arange(100, 140)
    cache = torch.zeros(4, BS, 3, 64)
    table = [2, 0, 3]
    written = RotaryEmbedding.apply(raw, *rope.cos_sin(pos))
    for i in range(40):
        cache[table[i // BS], i % BS] = written[i]
    cos, sin = rope.cos_sin(torch.tensor([32]))
    rerotate_keys(cache, table, 8, 40, cos, -sin, RotaryEmbedding.apply)
    want = RotaryEmbedding.apply(raw, *rope.cos_sin(pos - 32))
    for i in range(40):
        got = cache[table[i // BS], i % BS]
        expect = written[i] if i < 8 else want[i]
        torch.testing.assert_close(got, expect, atol=2e-5, rtol=1e-5)


def _key_digits(text: str, key: str = "71432") -> int:
    """How many leading digits of ``key`` the answer reproduces."""
    got = text.strip()
    return next((i for i in range(len(key)) if got[i : i + 1] != key[i]), len(key))


def test_snapkv_keeps_more_of_a_passkey_than_a_window_of_the_same_size(llm):
    tok = _engine(llm).tokenizer
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 9
    text = (
        "There is important info hidden inside a lot of irrelevant text. Find it. "
        + filler
        + "The pass key is 71432. Remember it. 71432 is the pass key. "
        + filler
        + "What is the pass key? The pass key is"
    )
    ids = tok.encode(text)
    budget = len(ids) // 4
    exact = _key_digits(tok.decode(_greedy(llm, ids, 6)))
    snap = _key_digits(
        tok.decode(_greedy(llm, ids, 6, {"policy": "snapkv", "budget_tokens": budget}))
    )
    stream = _key_digits(
        tok.decode(_greedy(llm, ids, 6, {"policy": "streaming", "budget_tokens": budget}))
    )
    assert exact == 5
    # A quarter of the prompt, chosen by attention, keeps the key's head; the window, which
    # is past the needle, keeps nothing of it (the point of the test). The default 135M model
    # loses the key's tail under SnapKV (docs/features/lossy-kv.md reports the grid).
    assert snap >= 2 and stream == 0


@pytest.mark.parametrize(
    "ev, needle",
    [
        ({"policy": "lru"}, "policy"),
        ({"policy": "streaming"}, "budget_tokens"),
        ({"policy": "snapkv", "budget_tokens": 64, "n": 1}, "unknown keys"),
    ],
)
def test_bad_settings_are_refused_and_the_engine_serves_on(llm, ev, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(max_tokens=4, kv_eviction=ev)
    ids = _prompt(llm, 1)
    assert len(_greedy(llm, ids, 4)) == 4


def test_n_greater_than_one_is_refused(llm):
    sp = SamplingParams(n=2, max_tokens=4, kv_eviction={"policy": "streaming", "budget_tokens": 64})
    with pytest.raises(ValueError, match="one sample"):
        llm.generate([{"prompt_token_ids": _prompt(llm, 1)}], sp)
    assert len(_greedy(llm, _prompt(llm, 1), 4)) == 4
