"""The native KIVI decode kernel (``ops/csrc/kivi_decode.c``) against the torch path of
`ops.kivi` on the same batches: several sequences at once, cold prefixes (a prefix-cache hit,
a whole-prompt hit recomputing its last token), the residual's ring wrapping, int3 and int2,
block sizes 16 and 32, and each SIMD path this machine can build."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.specs import FullAttentionSpec
from pagedkv.ops import native
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import reshape_and_cache
from pagedkv.ops.kivi import KiviResidual, KiviStep, quantize_k_blocks
from pagedkv.ops.kv_quant import KVQuant, quantize_part
from pagedkv.ops.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

BUILDS = ["native"] + [b for b in native.BUILD_FLAGS if native.available() and native.isa() != b]
# "native-float": this machine's build with the integer dot products off (the float kernels)
BUILDS.insert(1, "native-float")
HQ, HKV, D = 9, 3, 64


@pytest.fixture(params=BUILDS)
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """This machine's kernels, then each smaller SIMD path it can build (as test_native)."""
    if request.param == "native-float":
        if not native.kivi_int_dot():
            pytest.skip("this build has no integer dot products: 'native' runs the float kernels")
        real = native.kivi_decode
        monkeypatch.setattr(native, "kivi_decode", lambda *a, **k: real(*a, **k, int_dot=False))
    elif request.param != "native":
        so = native.build(native.BUILD_FLAGS[request.param])
        if native.isa(so) != request.param:
            pytest.skip(f"this CPU cannot build the {request.param} path")
        monkeypatch.setattr(native, "lib", lambda: so)
    return request.param


def _batch(mode: str, bs: int, seed: int = 0):
    """A spec, its KVQuant with a 5-row residual, pages, and per sequence (prompt length,
    start, table, q/k/v over every position, whether its row holds restored sinks)."""
    s = FullAttentionSpec(
        block_size=bs, num_kv_heads=HKV, head_size=D, dtype=mode[:4], kv_quant_mode=mode
    )
    kq = KVQuant.for_spec(s)
    kq.residual = KiviResidual.allocate(s, 5, "cpu")
    nb = 64 * 16 // bs
    kc = torch.zeros(nb, bs, HKV, s.k_part_bytes, dtype=torch.uint8)
    vc = torch.zeros(nb, bs, HKV, s.v_part_bytes, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    # (prompt, start): cold from 0; a prefix hit of two blocks; a whole-prompt hit whose
    # last token is computed again; a short prompt still inside the sinks' reach; a hit whose
    # row holds the int8 sinks a cold run stored (the engine's KiviSinkStore)
    seqs, first = [], 1
    cases = ((70, 0), (3 * bs + 5, 2 * bs), (2 * bs, 2 * bs - 1), (3, 0), (3 * bs + 9, 2 * bs))
    for i, (prompt, start) in enumerate(cases):
        n = prompt + 48
        blocks = -(-n // bs)
        table = torch.arange(first, first + blocks, dtype=torch.int32)
        first += blocks
        q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
        k[:, :, 7] += 5.0  # an outlier channel, as real keys have
        cached = -(-start // bs) * bs if start % bs else start  # whole blocks before start
        if cached:  # the hit's pages, coded as a first request would have left them
            kb = k[:cached].reshape(-1, bs, HKV, D)
            kc[table[: cached // bs].long()] = quantize_k_blocks(
                kb, kq.fmt.mode.code_bits, kq.fmt.k_bytes
            )
            vb = quantize_part(v[:cached], kq.fmt, 1.0, kq.fmt.v_bytes)
            vc[table[: cached // bs].long()] = vb.reshape(-1, bs, HKV, kq.fmt.v_bytes)
        held = i == 4
        if held:
            res = kq.residual
            res.k[i, :4], res.v[i, :4] = res.encode(k[:4], v[:4])
        seqs.append((prompt, start, table, q, k, v, held))
    return kq, kc, vc, seqs


def _step(kq, kc, vc, seqs, spans, bs):
    """One batched step: sequence i computes positions spans[i] = (lo, hi)."""
    width = max(len(t) for _, _, t, *_ in seqs)
    table = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for _, _, t, *_ in seqs])
    qsl, slots, qs, ks, vs = [0], [], [], [], []
    for (_, _, t, q, k, v, _), (lo, hi) in zip(seqs, spans):
        p = torch.arange(lo, hi)
        slots.append(t[p // bs].long() * bs + p % bs)
        qs.append(q[lo:hi])
        ks.append(k[lo:hi])
        vs.append(v[lo:hi])
        qsl.append(qsl[-1] + hi - lo)
    lens = [hi for _, hi in spans]
    md = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, block_size=bs,
        max_query_len=max(hi - lo for lo, hi in spans), max_seq_len=max(lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        kivi=KiviStep(list(range(len(seqs))), [s for _, s, *_ in seqs], [x[-1] for x in seqs]),
    )  # fmt: skip
    reshape_and_cache(torch.cat(ks), torch.cat(vs), kc, vc, md.slot_mapping, kq)
    return paged_attention(torch.cat(qs), kc, vc, md, D**-0.5, kv_quant=kq)


def _decode_run(mode: str, bs: int, steps: int):
    kq, kc, vc, seqs = _batch(mode, bs)
    _step(kq, kc, vc, seqs, [(s, p) for p, s, *_ in seqs], bs)  # prefill: the torch path
    outs = []
    for i in range(steps):
        outs.append(_step(kq, kc, vc, seqs, [(p + i, p + i + 1) for p, *_ in seqs], bs))
    return torch.stack(outs), kc, vc, kq.residual


@pytest.mark.parametrize(("mode", "bs"), [("int3_kivi", 16), ("int2_kivi", 16), ("int3_kivi", 32)])
def test_kernel_reads_what_the_torch_path_reads(build, mode, bs, monkeypatch) -> None:
    """48 decode steps of 5 sequences (every block boundary, the ring wrapping): the kernel's
    outputs match the torch path's to float rounding, and both leave the same codes and
    residual."""
    calls: list[bool] = []
    real = native.kivi_decode  # as the build fixture left it

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(native, "kivi_decode", spy)
    got, kc, vc, res = _decode_run(mode, bs, 48)
    assert len(calls) == 48 and all(calls)  # every decode step ran the kernel
    with monkeypatch.context() as m:
        m.setattr(native, "lib", lambda: None)  # the torch path writes and attends
        want, kc2, vc2, res2 = _decode_run(mode, bs, 48)
    err = (got - want).abs()
    if build == "native" and native.kivi_int_dot():
        # integer dot products: 15-bit query / probability integers, ~6e-5 relative measured
        assert err.max() < 1e-3 and (got - want).norm() < 2e-4 * want.norm(), err.max()
    else:
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), err.max()
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(res.k, res2.k) and torch.equal(res.v, res2.v)
    # not vacuous: another batch's keys give other outputs
    assert (got[0] - got[-1]).abs().max() > 1e-2


def test_kernel_declines_what_it_does_not_cover(monkeypatch) -> None:
    """A block longer than the kernel's key tile (64) returns None: the torch path runs."""
    s = FullAttentionSpec(
        block_size=128, num_kv_heads=1, head_size=128, dtype="int3", kv_quant_mode="int3_kivi"
    )
    kq = KVQuant.for_spec(s)
    kq.residual = KiviResidual.allocate(s, 1, "cpu")
    kc = torch.zeros(2, 128, 1, s.k_part_bytes, dtype=torch.uint8)
    vc = torch.zeros(2, 128, 1, s.v_part_bytes, dtype=torch.uint8)
    one = torch.ones(1, dtype=torch.int32)
    got = native.kivi_decode(
        torch.zeros(1, 1, 128), kc, vc, one[None], one, 1.0, kq, one.long() * 0, one.long() * 0
    )
    assert got is None
