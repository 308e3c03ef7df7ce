"""Triton kernels (ops/triton) against the dense reference (tests/ref_attention.py) and the
torch cache ops.

Runs on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``, set below before
triton is imported: triton reads it when a kernel is decorated). With ``TRITON_INTERPRET=0``
on a CUDA machine (``gpu/run_checks.sh``) the same tests run compiled on the GPU.
Skipped where ``triton`` is not installed (an optional extra).
"""

from __future__ import annotations

import os

_WE_SET_INTERPRET = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from ref_attention import PagedBatch, make_paged_batch  # noqa: E402
from triton_env import interpret_during_module  # noqa: E402

from pagedkv.ops.cache import reshape_and_cache  # noqa: E402
from pagedkv.ops.kv_cache import allocate_kv_cache, copy_blocks  # noqa: E402
from pagedkv.ops.triton.copy_blocks import copy_blocks_triton  # noqa: E402
from pagedkv.ops.triton.reshape_and_cache import reshape_and_cache_triton  # noqa: E402
from pagedkv.ops.triton.unified_attention import paged_attention_triton, unified_attention  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("0", "")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip(
        "compiled Triton needs CUDA (set TRITON_INTERPRET=1 for the CPU interpreter)",
        allow_module_level=True,
    )
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
LAYOUTS = [None, "LBNHC", "BLNHC", "LBHNC"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


_interpret_during_module = interpret_during_module(_WE_SET_INTERPRET, INTERPRET)


def on_device(batch: PagedBatch, layout: str | None) -> PagedBatch:
    """The batch with its caches (same layout) and metadata tensors on :data:`DEVICE`."""
    if DEVICE.type == "cpu":
        return batch
    kc, vc = batch.key_cache, batch.value_cache
    if layout is None:
        key_cache, value_cache = kc.to(DEVICE), vc.to(DEVICE)
    else:
        _, views = allocate_kv_cache(
            layout,
            1,
            kc.shape[0],
            kc.shape[1],
            kc.shape[2],
            kc.shape[3],
            kc.dtype,
            DEVICE,
            head_size_v=vc.shape[3],
        )
        key_cache, value_cache = views[0]
        key_cache.copy_(kc)
        value_cache.copy_(vc)
    md = dataclasses.replace(
        batch.md,
        slot_mapping=batch.md.slot_mapping.to(DEVICE),
        query_start_loc=batch.md.query_start_loc.to(DEVICE),
        seq_lens=batch.md.seq_lens.to(DEVICE),
        block_table=batch.md.block_table.to(DEVICE),
        _rows=None,
    )
    return dataclasses.replace(
        batch, query=batch.query.to(DEVICE), key_cache=key_cache, value_cache=value_cache, md=md
    )


def random_cases(n: int, seed: int) -> list[dict]:
    """``n`` mixed steps (decodes, prompts, chunks after cached context) with random block
    sizes 16/32, GQA groups, windows, soft caps, layouts, dtypes and split settings."""
    rnd = random.Random(seed)
    cases = []
    for i in range(n):
        seq_lens, query_lens = [], []
        for _ in range(rnd.randint(1, 4)):
            length = rnd.randint(1, 80)
            kind = rnd.choice(["decode", "decode", "chunk", "prompt"])
            seq_lens.append(length)
            query_lens.append(
                {"decode": 1, "prompt": length, "chunk": rnd.randint(1, length)}[kind]
            )
        cases.append(
            dict(
                spec=dict(
                    seq_lens=seq_lens,
                    query_lens=query_lens,
                    block_size=rnd.choice([16, 32]),
                    num_kv_heads=rnd.choice([1, 2]),
                    group=rnd.choice([1, 3, 4]),
                    head_size=rnd.choice([16, 32]),
                    head_size_v=rnd.choice([None, None, 16]),
                    layout=rnd.choice(LAYOUTS),
                    shared_prefix=rnd.random() < 0.5,
                    seed=seed * 1000 + i,
                ),
                dtype=[torch.float32, torch.bfloat16, torch.float16][i % 3],
                window=rnd.choice([None, None, 1, 9, 40]),
                cap=rnd.choice([None, None, 5.0]),
                splits=rnd.choice([None, 1, 4]),
            )
        )
    return cases


def check(
    spec: dict, dtype: torch.dtype, window: int | None, cap: float | None, splits: int | None
) -> torch.Tensor:
    """Run the kernel on a fresh batch and assert it matches the float64 dense reference."""
    cpu_batch = make_paged_batch(dtype=dtype, **spec)
    batch = on_device(cpu_batch, spec["layout"])
    scale = spec["head_size"] ** -0.5
    out = paged_attention_triton(
        batch.query, batch.key_cache, batch.value_cache, batch.md, scale, window, cap, splits
    )
    ref = cpu_batch.reference(scale, window, cap)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    return out


@pytest.mark.parametrize(
    "case",
    random_cases(18, seed=7),
    ids=lambda c: (
        f"{str(c['dtype'])[6:]}-bs{c['spec']['block_size']}-g{c['spec']['group']}"
        f"-w{c['window']}-cap{c['cap']}-s{c['splits']}-{c['spec']['layout']}"
    ),
)
@pytest.mark.slow
def test_unified_attention_matches_dense_reference(case: dict) -> None:
    check(case["spec"], case["dtype"], case["window"], case["cap"], case["splits"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_prefill_and_decode_batch_gqa_window_softcap(dtype: torch.dtype) -> None:
    """One launch: decodes, a whole prompt and a chunk after cached context, G=4, both
    block sizes' worth of tiles, a window that cuts into the context and a soft cap."""
    spec = dict(
        seq_lens=[70, 33, 64, 5],
        query_lens=[1, 33, 20, 1],
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_size=32,
        layout="LBNHC",
        shared_prefix=True,
        seed=3,
    )
    check(spec, dtype, 24, 8.0, None)


@pytest.mark.parametrize("layout", ["LBHNC", None])
@pytest.mark.slow
def test_split_kv_decode_equals_single_pass(layout: str | None) -> None:
    """Long decodes (few programs → split-KV automatically): every segment count agrees with
    the 2D kernel and the reference, also when a window leaves whole segments empty."""
    spec = dict(
        seq_lens=[300, 257, 17],
        query_lens=[1, 1, 1],
        block_size=32,
        num_kv_heads=2,
        group=3,
        head_size=32,
        layout=layout,
        shared_prefix=True,
        seed=11,
    )
    single = check(spec, torch.float32, None, None, 1)
    for n in (2, 16, None):
        torch.testing.assert_close(
            check(spec, torch.float32, None, None, n), single, atol=1e-5, rtol=1e-5
        )
    check(spec, torch.float32, 40, None, 8)  # segments wholly before the window: empty


@pytest.mark.slow
def test_split_kv_short_queries_after_context() -> None:
    """Split-KV also serves short multi-token queries (≤ 8, spec decoding shape): causal
    inside the last segment."""
    spec = dict(
        seq_lens=[150, 90],
        query_lens=[5, 8],
        block_size=16,
        num_kv_heads=1,
        group=4,
        head_size=16,
        layout="BLNHC",
        shared_prefix=False,
        seed=5,
    )
    check(spec, torch.float32, None, None, None)
    check(spec, torch.float32, 30, 5.0, 4)


def test_window_of_one_sees_only_itself() -> None:
    spec = dict(
        seq_lens=[40, 20],
        query_lens=[1, 20],
        block_size=16,
        num_kv_heads=2,
        group=1,
        head_size=16,
        layout="LBNHC",
        shared_prefix=False,
        seed=2,
    )
    batch = on_device(make_paged_batch(dtype=torch.float32, **spec), "LBNHC")
    out = paged_attention_triton(
        batch.query, batch.key_cache, batch.value_cache, batch.md, 0.3, sliding_window=1
    )
    own = torch.cat([batch.values[0][-1:], batch.values[1]]).to(out.device)
    torch.testing.assert_close(out, own, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_reads_only_blocks_in_the_block_table() -> None:
    """Blocks outside every table (and the table's padding entries) hold NaN: any read of
    them would poison the output."""
    spec = dict(
        seq_lens=[45, 30, 3],
        query_lens=[1, 12, 3],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=32,
        layout=None,
        shared_prefix=False,
        seed=9,
    )
    batch = make_paged_batch(dtype=torch.float32, **spec)
    used = set(batch.md.block_table.flatten().tolist()) - {0}
    for b in range(batch.key_cache.shape[0]):
        if b not in used:
            batch.key_cache[b] = float("nan")
            batch.value_cache[b] = float("nan")
    ref = batch.reference(0.2)
    batch = on_device(batch, None)
    for splits in (1, 4):
        out = paged_attention_triton(
            batch.query, batch.key_cache, batch.value_cache, batch.md, 0.2, num_kv_splits=splits
        )
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)


def test_strided_query_and_out_buffer() -> None:
    """q as a column slice of a fused qkv output (non-contiguous), written into a given out."""
    spec = dict(
        seq_lens=[40, 21],
        query_lens=[1, 21],
        block_size=32,
        num_kv_heads=2,
        group=3,
        head_size=16,
        layout="LBNHC",
        shared_prefix=False,
        seed=6,
    )
    cpu_batch = make_paged_batch(dtype=torch.float32, **spec)
    batch = on_device(cpu_batch, "LBNHC")
    qkv = torch.randn(batch.query.shape[0], 10, 16, device=DEVICE)
    qkv[:, :6] = batch.query
    query = qkv[:, :6]
    assert not query.is_contiguous()
    out = torch.full((query.shape[0], 6, 16), float("nan"), device=DEVICE)
    md = batch.md
    res = unified_attention(
        query,
        batch.key_cache,
        batch.value_cache,
        md.query_start_loc,
        md.seq_lens,
        md.block_table,
        md.max_query_len,
        md.max_seq_len,
        0.2,
        out=out,
    )
    assert res is out
    torch.testing.assert_close(out.cpu().double(), cpu_batch.reference(0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC", "HNBLC", None])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_torch_path(layout: str | None, cache_dtype: torch.dtype) -> None:
    """Same bytes as the torch scatter for every layout (and separate caches); negative slots
    skipped; float32 K/V (a strided slice of a fused qkv) cast to the cache dtype."""
    nb, bs, h, d, dv, t = 6, 16, 2, 16, 8, 9
    gen = torch.Generator().manual_seed(0)
    if layout is None:
        caches = [
            (
                torch.zeros(nb, bs, h, d, dtype=cache_dtype),
                torch.zeros(nb, bs, h, dv, dtype=cache_dtype),
            )
            for _ in range(2)
        ]
        dev_caches = [(k.to(DEVICE, copy=True), v.to(DEVICE, copy=True)) for k, v in caches]
    else:
        caches = allocate_kv_cache(layout, 2, nb, bs, h, d, cache_dtype, head_size_v=dv)[1]
        dev_caches = allocate_kv_cache(
            layout, 2, nb, bs, h, d, cache_dtype, DEVICE, head_size_v=dv
        )[1]
    qkv = torch.randn(t, h * (d + dv) + 5, generator=gen)
    key = qkv[:, : h * d].view(t, h, d)
    value = qkv[:, h * d : h * (d + dv)].view(t, h, dv)
    slots = torch.tensor([5, -1, 17, 0, -3, 95, 40, 41, -1])  # 95: the last slot
    reshape_and_cache(key, value, *caches[1], slots)  # CPU tensors: the torch path
    reshape_and_cache_triton(key.to(DEVICE), value.to(DEVICE), *dev_caches[1], slots.to(DEVICE))
    # The interpreter rounds float32 → bfloat16 its own way (not torch's round-to-nearest-even):
    # equal within one bfloat16 ulp there, byte-equal when compiled.
    tol = 2.0**-7 if INTERPRET and cache_dtype == torch.bfloat16 else 0.0
    for (k, v), (dk, dvc) in zip(caches, dev_caches, strict=True):
        torch.testing.assert_close(dk.cpu(), k, atol=0.0, rtol=tol)
        torch.testing.assert_close(dvc.cpu(), v, atol=0.0, rtol=tol)
    assert bool((caches[1][0][1, 1] != 0).all())  # slot 17 really written...
    assert bool((caches[0][0] == 0).all())  # ...and only in layer 1


def test_reshape_and_cache_then_attention_round_trip() -> None:
    """Write a prompt's K/V with the Triton scatter, then attend over it: equals the
    reference built from the same dense K/V."""
    spec = dict(
        seq_lens=[37],
        query_lens=[37],
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_size=16,
        layout="LBHNC",
        shared_prefix=False,
        seed=4,
    )
    cpu_batch = make_paged_batch(dtype=torch.float32, **spec)
    batch = on_device(cpu_batch, "LBHNC")
    batch.key_cache.zero_()
    batch.value_cache.zero_()
    reshape_and_cache_triton(
        cpu_batch.keys[0].to(DEVICE),
        cpu_batch.values[0].to(DEVICE),
        batch.key_cache,
        batch.value_cache,
        batch.md.slot_mapping,
    )
    out = paged_attention_triton(batch.query, batch.key_cache, batch.value_cache, batch.md, 0.25)
    torch.testing.assert_close(out.cpu().double(), cpu_batch.reference(0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC", None])
def test_copy_blocks_matches_torch_path(layout: str | None) -> None:
    nb, bs, h, d, dv = 7, 16, 2, 16, 8
    gen = torch.Generator().manual_seed(1)
    if layout is None:
        views = [
            (torch.randn(nb, bs, h, d, generator=gen), torch.randn(nb, bs, h, dv, generator=gen))
            for _ in range(2)
        ]
    else:
        buffer, views = allocate_kv_cache(layout, 2, nb, bs, h, d, torch.float32, head_size_v=dv)
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    dev_views = (
        [(k.to(DEVICE, copy=True), v.to(DEVICE, copy=True)) for k, v in views]
        if layout is None
        else None
    )
    if dev_views is None:
        dev_buffer, dev_views = allocate_kv_cache(
            layout, 2, nb, bs, h, d, torch.float32, DEVICE, head_size_v=dv
        )
        dev_buffer.copy_(buffer)
    mapping = [(1, 2), (3, 5), (6, 0)]
    copy_blocks(views, mapping)  # CPU: torch path
    src = torch.tensor([s for s, _ in mapping], device=DEVICE)
    dst = torch.tensor([t for _, t in mapping], device=DEVICE)
    tensors = [t for kv in dev_views for t in kv]  # K and V separately (strided views)
    copy_blocks_triton(tensors, src, dst)
    for (k, v), (dk, dvc) in zip(views, dev_views, strict=True):
        assert torch.equal(dk.cpu(), k) and torch.equal(dvc.cpu(), v)
    assert torch.equal(views[0][0][2], views[0][0][1])


@pytest.mark.slow
def test_cpu_ops_need_no_triton() -> None:
    """Without triton importable, the CPU ops import and run as before (the extra is optional)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from pagedkv.ops.triton import available\n"
        "from pagedkv.ops.cache import reshape_and_cache\n"
        "from pagedkv.ops.kv_cache import copy_blocks\n"
        "from pagedkv.ops.attention import paged_attention\n"
        "assert not available()\n"
        "kc = torch.zeros(3, 4, 1, 8); vc = torch.zeros(3, 4, 1, 8)\n"
        "reshape_and_cache(torch.ones(2, 1, 8), torch.ones(2, 1, 8), kc, vc, torch.tensor([4, 5]))\n"
        "copy_blocks([(kc, vc)], [(1, 2)])\n"
        "assert kc[2, :2].eq(1).all() and 'triton' not in [m.split('.')[0] for m in sys.modules"
        " if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_copy_blocks_op_with_a_chain_reads_before_writing() -> None:
    """``copy_blocks`` on :data:`DEVICE`: a block both read and written takes the reads-first
    path; a plain mapping takes the kernel on CUDA. Either way every layer ends right."""
    _, views = allocate_kv_cache("LBHNC", 2, 7, 16, 2, 16, torch.float32, DEVICE, head_size_v=8)
    for k, v in views:
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    for mapping in ([(1, 2), (2, 5), (6, 0)], [(3, 4), (1, 6)]):
        before = [(k.clone(), v.clone()) for k, v in views]
        copy_blocks(views, mapping)
        for (k, v), (k0, v0) in zip(views, before, strict=True):
            ek, ev = k0.clone(), v0.clone()
            for s, d in mapping:
                ek[d], ev[d] = k0[s], v0[s]
            assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.slow
def test_kernels_compile_for_cuda_without_a_gpu() -> None:
    """Triton's full pipeline down to a cubin for sm_90 (bundled ptxas): catches what the
    interpreter cannot (types of loop-carried values, layouts, shared memory)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.ops.triton.compile_check",
            "--arch",
            "90",
            "--dtypes",
            "fp32",
            "bf16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 failures" in res.stdout


@pytest.mark.slow
def test_engine_greedy_output_is_unchanged_with_the_triton_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real model and engine with the Triton cache write and attention in every layer (what
    the CUDA dispatch runs; here on CPU, interpreted): a mixed prefill/decode batch gives the
    same greedy tokens as the CPU kernels."""
    import pagedkv.models.llama as llama
    from pagedkv import LLM, SamplingParams

    if DEVICE.type != "cpu":
        pytest.skip("on CUDA the engine dispatches to these kernels itself (gpu/run_checks.sh)")
    llm = LLM(num_kv_blocks=16, max_model_len=128)
    prompts = [{"prompt_token_ids": list(range(100, 114))}, {"prompt_token_ids": [300, 301, 302]}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(llama, "paged_attention", paged_attention_triton)
    monkeypatch.setattr(llama, "reshape_and_cache", reshape_and_cache_triton)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref and all(len(t) == 3 for t in got)


@pytest.mark.slow
def test_gpu_benchmark_and_checks_skip_cleanly_without_cuda(tmp_path) -> None:
    """``benchmarks/bench_gpu.py`` (and so ``gpu/run_checks.sh``) on a machine without CUDA:
    a JSON saying so, in the file asked for, exit 0."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real benchmark (gpu/run_checks.sh)")
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "res.json"
    res = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "bench_gpu.py"),
            "--out",
            str(out),
            "--check",
            "x=3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert (
        data["gpu"] is False and data["reason"] == "no CUDA device" and data["checks"] == {"x": 3}
    )
    assert json.loads(res.stdout) == data
    syntax = subprocess.run(
        ["bash", "-n", str(root / "gpu" / "run_checks.sh")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 9]])
def test_mla_latent_cache_value_is_a_view_of_the_key(query_lens: list[int]) -> None:
    """MLA's absorbed decode (models/deepseek_v2.py): one KV head holding ``[kv_c | k_pe]``
    (48 values here), value = a view of its first 32 columns (same strides as K). The kernel
    must read V through that view: equal to the torch path over the same caches."""
    from pagedkv.ops.attention import _attention
    from pagedkv.ops.kv_gather import PagedKV

    spec = dict(
        seq_lens=[23, 40, 17],
        query_lens=query_lens,
        block_size=16,
        num_kv_heads=1,
        group=4,
        head_size=48,
        layout="LBNHC",
        shared_prefix=False,
        seed=11,
    )
    cpu_batch = make_paged_batch(dtype=torch.float32, head_size_v=0, **spec)
    key_cache = cpu_batch.key_cache
    value_view = key_cache[..., :32]
    want = _attention(
        cpu_batch.query, PagedKV.of(key_cache, value_view), cpu_batch.md, 0.125, None, None, None
    )
    kc = key_cache.to(DEVICE)
    batch = on_device(cpu_batch, None)
    out = paged_attention_triton(batch.query, kc, kc[..., :32], batch.md, 0.125)
    assert out.shape == (sum(query_lens), 4, 32)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
