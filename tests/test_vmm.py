"""kv_cache_memory_mode="vmm" (vAttention, `ops.vmm` / `engine.vmm`): the mapping itself
(what the kernel holds, read from /proc/self/maps; faults in a child process), a stateful
test of map/unmap invariants, and the engine's outputs against the paged mode and
transformers on every full-attention family, with prefix sharing, forks (copy-on-write),
preemption and an offload tier; the models the mode does not run are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, random_prompts
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import LLM, SamplingParams
from pagedkv.ops.vmm import OS_PAGE, VirtualKVCache, VMMGeometry, kernel_mappings, tokens_per_page

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vmm is Linux-only")

GREEDY = SamplingParams(max_tokens=10, temperature=0)


def geometry(**kw: Any) -> VMMGeometry:
    base = dict(
        num_layers=2,
        num_kv_heads=3,
        num_blocks=12,
        block_size=8,
        token_elems=128,
        elem_size=4,
        max_rows=4,
        max_blocks=5,
    )
    return VMMGeometry(**{**base, **kw})  # type: ignore[arg-type]


def reservation(cache: VirtualKVCache) -> tuple[int, int]:
    g = cache.geometry
    return cache.virtual_addr, g.planes * g.max_rows * g.row_bytes


def perms_bytes(cache: VirtualKVCache) -> dict[str, int]:
    """Bytes of the reservation per permission string, as the kernel holds them."""
    out: dict[str, int] = {}
    for lo, hi, perms in kernel_mappings(*reservation(cache)):
        out[perms] = out.get(perms, 0) + hi - lo
    return out


# ---- the mapping ------------------------------------------------------------------------------


def test_rows_alias_physical_pages_and_share_complete_ones() -> None:
    cache = VirtualKVCache.create(geometry(), torch.float32)
    g = cache.geometry
    cache.map_blocks(1, [3, 4, 9], first_writable=0)
    data = torch.randn(g.num_layers, g.num_kv_heads, 24, g.token_elems)
    cache.virtual[:, :, 1, :24] = data
    for i, b in enumerate([3, 4, 9]):  # each page landed in its physical block
        assert torch.equal(cache.physical[:, :, b], data[:, :, i * 8 : (i + 1) * 8])
    # A second row sharing two complete pages reads the same memory, read-only.
    cache.map_blocks(2, [3, 4, 7], first_writable=2)
    assert torch.equal(cache.virtual[:, :, 2, :16], data[:, :, :16])
    cache.physical[:, :, 4] += 1.0  # one physical write is seen through both rows
    assert torch.equal(cache.virtual[:, :, 1, 8:16], cache.virtual[:, :, 2, 8:16])
    with pytest.raises(AssertionError, match="writable in rows"):
        cache.map_blocks(3, [9], first_writable=0)  # a page writable in two rows
        cache.check_invariants()
    cache.release(3)
    cache.map_blocks(1, [3, 4, 9], first_writable=3)  # row 1's pages are now complete
    cache.check_invariants()
    perms = perms_bytes(cache)
    assert perms.get("rw-s", 0) == g.planes * 1 * g.page_bytes  # row 2's block 7
    assert perms.get("r--s", 0) == g.planes * 5 * g.page_bytes
    cache.release(1)
    cache.release(2)
    assert set(perms_bytes(cache)) == {"---p"}  # every page unmapped again
    cache.close()


def test_remap_after_new_blocks_and_consecutive_runs_map_in_one_call() -> None:
    cache = VirtualKVCache.create(geometry(), torch.float32)
    planes = cache.geometry.planes
    calls = cache.num_map_calls
    cache.map_blocks(0, [5, 6, 7, 8], first_writable=0)
    assert cache.num_map_calls - calls == planes  # one run: one mmap per plane
    cache.physical[:, :, 2] = 7.0
    cache.map_blocks(0, [2, 10], first_writable=0)  # preempted, new blocks: remapped
    assert cache.rows[0] == [2, 10]
    assert bool((cache.virtual[:, :, 0, :8] == 7.0).all())
    cache.close()


def test_page_geometry_is_checked() -> None:
    assert tokens_per_page(64 * 1024, 512) == 128
    with pytest.raises(ValueError, match="multiple of 4096"):
        tokens_per_page(6000, 512)
    with pytest.raises(ValueError, match="whole number of tokens"):
        tokens_per_page(OS_PAGE, 384)
    with pytest.raises(ValueError, match="not a multiple of the OS page"):
        geometry(block_size=3)


def test_reservation_larger_than_physical_memory() -> None:
    ram = os.sysconf("SC_PHYS_PAGES") * OS_PAGE
    g = geometry(max_rows=64, max_blocks=(2 * ram) // (64 * 6 * 4096) + 1)
    cache = VirtualKVCache.create(g, torch.float32)
    assert g.planes * g.max_rows * g.row_bytes > ram
    last = g.max_blocks - 1
    cache.map_blocks(63, [1] * 0 + list(range(1, 4)), first_writable=0)
    cache.virtual[:, :, 63, :24] = 2.0
    assert bool((cache.physical[:, :, 1:4] == 2.0).all())
    assert last > 0
    cache.close()


def _child(code: str) -> subprocess.CompletedProcess[str]:
    prog = textwrap.dedent(
        """
        import torch
        from pagedkv.ops.vmm import VirtualKVCache, VMMGeometry
        g = VMMGeometry(1, 1, 4, 8, 128, 4, 2, 3)
        c = VirtualKVCache.create(g, torch.float32)
        c.map_blocks(0, [1, 2], first_writable=1)
        """
    ) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)


def test_read_only_and_unmapped_pages_fault() -> None:
    ok = _child("c.virtual[0, 0, 0, 8:16] = 1.0\nprint(float(c.physical[0, 0, 2].sum()))")
    assert ok.returncode == 0, ok.stderr
    assert float(ok.stdout) == 8 * 128
    ro = _child("c.virtual[0, 0, 0, :8] = 1.0")  # a complete (shared) page is read-only
    assert ro.returncode == -11
    past = _child("print(float(c.virtual[0, 0, 0, 16].sum()))")  # past the mapped pages
    assert past.returncode == -11


class MapUnmapMachine(RuleBasedStateMachine):
    """Requests take rows, grow, share other rows' complete pages and end, as the engine
    drives them; the kernel's view and the contents must follow."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = VirtualKVCache.create(geometry(num_blocks=24, max_blocks=6), torch.float32)
        self.free = list(range(1, 24))
        self.refs: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}  # row -> block table
        self.complete: dict[int, int] = {}  # row -> complete pages

    def _take(self) -> int:
        b = self.free.pop()
        self.refs[b] = 1
        # Stamp a fresh page so a stale mapping would show old contents.
        self.cache.physical[:, :, b] = float(b)
        return b

    @precondition(lambda self: len(self.tables) < 4 and len(self.free) >= 2)
    @rule(share=st.integers(0, 6), new=st.integers(1, 2), data=st.data())
    def start(self, share: int, new: int, data: st.DataObject) -> None:
        row = min(set(range(4)) - set(self.tables))
        prefix: list[int] = []
        donors = [r for r in self.tables if self.complete[r]]
        if donors and share:
            donor = data.draw(st.sampled_from(donors))
            room = self.cache.geometry.max_blocks - new
            prefix = self.tables[donor][: min(share, self.complete[donor], room)]
            for b in prefix:
                self.refs[b] += 1
        table = prefix + [self._take() for _ in range(min(new, len(self.free)))]
        self.tables[row], self.complete[row] = table, len(prefix)
        self.cache.map_blocks(row, table, first_writable=len(prefix))

    @precondition(lambda self: self.tables and self.free)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[row]
        if len(table) == self.cache.geometry.max_blocks:
            return
        table.append(self._take())
        self.complete[row] = len(table) - 1  # every page before the new one is complete
        self.cache.map_blocks(row, list(table), first_writable=self.complete[row])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.tables)))
        for b in self.tables.pop(row):
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                self.free.append(b)
        del self.complete[row]
        self.cache.release(row)

    @invariant()
    def kernel_agrees(self) -> None:
        c = self.cache
        c.check_invariants()
        g = c.geometry
        writable = sum(len(t) - self.complete[r] for r, t in self.tables.items())
        ro = sum(self.complete.values())
        perms = perms_bytes(c)
        assert perms.get("rw-s", 0) == writable * g.planes * g.page_bytes
        assert perms.get("r--s", 0) == ro * g.planes * g.page_bytes
        for row, table in self.tables.items():  # each row reads its blocks' pages
            for i, b in enumerate(table):
                assert float(c.virtual[0, 0, row, i * g.block_size, 0]) == float(b)

    def teardown(self) -> None:
        for row in list(self.tables):
            self.cache.release(row)
        assert set(perms_bytes(self.cache)) == {"---p"}  # every page freed at the end
        self.cache.close()


TestMapUnmap = MapUnmapMachine.TestCase
TestMapUnmap.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


# ---- the engine -------------------------------------------------------------------------------


def _tiny(kind: str, tmp_path: Path) -> tuple[Any, Path]:
    from test_llama_model import _tiny_hf_model

    torch.manual_seed(0)
    hf = _tiny_hf_model(kind)
    hf.save_pretrained(tmp_path)
    return hf, tmp_path


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _outputs(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list[Any]:
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [[o.token_ids for o in r.outputs] for r in res]


@pytest.mark.parametrize("kind", ["qwen2", "llama3_rope", "llama_tied_linear_rope"])
def test_tiny_families_equal_paged_and_transformers(kind: str, tmp_path: Path) -> None:
    hf, path = _tiny(kind, tmp_path)
    # 32-token pages; prompts share 40 tokens (one complete page is a prefix hit).
    prompts = random_prompts(96, 1, [30, 70, 9, 45], shared=40)
    kw = dict(model=str(path), max_model_len=128, num_kv_blocks=40, max_num_seqs=4)
    vmm = LLM(kv_cache_memory_mode="vmm", vmm_page_size=4096, **kw)
    assert vmm.llm_engine.block_size == 32  # a page: 4096 B / (16 + 16) float32
    got = _outputs(vmm, prompts)
    assert got == _outputs(LLM(**kw), prompts)
    assert [g[0] for g in got] == [_hf_greedy(hf, p, 10) for p in prompts]
    assert _outputs(vmm, prompts) == got  # again: every prompt's first page is a hit
    assert vmm.stats()["prefix_cache_hits"] > 0
    check_clean(vmm)
    vmm.llm_engine.runner.vmm.check_invariants()


@pytest.fixture(scope="module")
def smollm_prompts() -> list[list[int]]:
    return random_prompts(49152, 7, [300, 140, 20, 260], shared=200)


def test_default_model_equals_paged_with_prefix_sharing(smollm_prompts: list[list[int]]) -> None:
    kw: dict[str, Any] = dict(max_model_len=1024, kv_cache_memory=64 << 20)
    paged = _outputs(LLM(**kw), smollm_prompts)
    llm = LLM(kv_cache_memory_mode="vmm", **kw)
    eng = llm.llm_engine
    assert eng.block_size == 128 and eng.kv_cache_config.layout.value == "LHBNC"
    assert _outputs(llm, smollm_prompts[:1]) == paged[:1]
    # The others start with its first complete page: their rows map that physical page.
    seen: list[list[int]] = []
    runner = eng.runner
    orig = runner._vmm_map

    def spy(mi: Any) -> list[int]:
        rows = orig(mi)
        seen.extend(list(runner.vmm.rows[r]) for r in rows)
        return rows

    runner._vmm_map = spy  # type: ignore[method-assign]
    assert _outputs(llm, smollm_prompts[1:]) == paged[1:]
    first_pages = {t[0] for t in seen if t}
    assert len(first_pages) == 1  # one shared physical page under every row
    assert perms_bytes(runner.vmm).get("r--s", 0) > 0 or not runner.vmm_rows.by_request
    check_clean(llm)


def test_forks_copy_the_shared_partial_page() -> None:
    prompts = random_prompts(49152, 3, [150])  # a partial second page at the fork
    sp = SamplingParams(n=3, max_tokens=8, temperature=0)
    kw: dict[str, Any] = dict(max_model_len=512, kv_cache_memory=32 << 20)
    got = _outputs(LLM(kv_cache_memory_mode="vmm", **kw), prompts, sp)
    assert got == _outputs(LLM(**kw), prompts, sp)
    assert got[0][0] == got[0][1] == got[0][2]


def test_preemption_and_row_reuse_equal_paged() -> None:
    # 10 pages of 32 tokens per (layer, head) for 6 requests of ~100 tokens: preemptions, and
    # more requests than rows over the run.
    prompts = random_prompts(49152, 11, [60, 90, 75, 40, 100, 30])
    sp = SamplingParams(max_tokens=40, temperature=0)
    kw: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=10, max_num_seqs=3)
    llm = LLM(kv_cache_memory_mode="vmm", vmm_page_size=16384, **kw)
    assert llm.llm_engine.block_size == 32
    got = _outputs(llm, prompts, sp)
    assert llm.stats()["num_preemptions"] > 0
    assert got == _outputs(LLM(block_size=32, **kw), prompts, sp)
    check_clean(llm)
    llm.llm_engine.runner.vmm.check_invariants()


def test_cpu_offload_tier_moves_physical_pages() -> None:
    prompts = random_prompts(49152, 5, [30, 20], shared=256)
    kw: dict[str, Any] = dict(max_model_len=512, num_kv_blocks=8, max_num_seqs=1)
    llm = LLM(kv_cache_memory_mode="vmm", kv_offload="cpu:64MiB", **kw)
    want = _outputs(LLM(block_size=128, **kw), prompts)
    assert _outputs(llm, prompts) == want
    # Evict the device copies (other prompts fill the pool), then load from the tier.
    _outputs(llm, random_prompts(49152, 6, [400, 400, 400]))
    assert _outputs(llm, prompts) == want
    stats = llm.stats()
    assert stats["external_cache_hits"] > 0 and stats["offload"]["loaded_tokens"] > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_cache_dtype="int8_per_token_head"), "unquantized"),
        (dict(block_size=32), "set vmm_page_size"),
        (dict(kv_eviction={"policy": "streaming", "budget_tokens": 256}), "no token eviction"),
        (dict(vmm_page_size=5000), "multiple of 4096"),
        (dict(tensor_parallel_size=2), "one rank"),
    ],
)
def test_bad_settings_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(kv_cache_memory_mode="vmm", **kw)


@pytest.mark.parametrize("kind", ["mistral_sliding"])
def test_models_the_mode_does_not_run_are_refused(kind: str, tmp_path: Path) -> None:
    _, path = _tiny(kind, tmp_path)
    with pytest.raises(ValueError, match="full attention"):
        LLM(model=str(path), kv_cache_memory_mode="vmm", max_model_len=64)
    assert _outputs(LLM(model=str(path), max_model_len=64), [[1, 2, 3]])  # paged runs it


def test_hybrid_model_refused(tmp_path: Path) -> None:
    import test_gemma2

    test_gemma2.build(test_gemma2.tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="one KV cache group"):
        LLM(model=str(tmp_path), kv_cache_memory_mode="vmm", max_model_len=64)


def test_bench_vmm_small_parts(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pagedkv.bench import vmm as bench
    from pagedkv.ops import native

    parts = ["waste", "alloc"] + (["decode"] if native.available() else [])
    for part in parts:
        argv = [part, "--json-only", "--seqs", "4", "--tokens", "256", "--rounds", "1"]
        assert bench.main([*argv, "--calls", "1", "--footprint-mb", "1", "--repeats", "2"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["benchmark"] == "vmm" and part in report
    # Waste grows with the page's tokens, from real mappings.
    (w,) = [r for r in bench.run_waste()["workloads"] if r["workload"].startswith("256")]
    assert 0 < w["paged_block16_waste"] < w["vmm_16KiB_waste"] < w["vmm_64KiB_waste"]
    assert w["vmm_64KiB_waste"] < w["vmm_2MiB_waste"]


def test_pd_transfer_between_vmm_engines_moves_physical_pages() -> None:
    """A NixlConnector producer and consumer, both in vmm mode (TCP backend): the consumer's
    rows map the pages the transfer wrote, and it decodes exactly what one engine does."""
    from redis_server import free_port

    prompts = random_prompts(49152, 17, [300, 150])
    sp = SamplingParams(max_tokens=12, temperature=0)
    kw: dict[str, Any] = dict(max_model_len=512, num_kv_blocks=24, kv_cache_memory_mode="vmm")

    def pd(role: str) -> LLM:
        extra = {"side_channel_port": free_port(), "backend": "tcp", "handshake_timeout_s": 2.0}
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}
        return LLM(kv_transfer_config=cfg, **kw)

    want = _outputs(LLM(**kw), prompts, sp)
    p, d = pd("kv_producer"), pd("kv_consumer")
    try:
        reqs = [{"prompt_token_ids": x} for x in prompts]
        first = SamplingParams(
            max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True}
        )
        params = [o.kv_transfer_params for o in p.generate(reqs, first, use_tqdm=False)]
        assert all(prm and prm["remote_block_ids"] for prm in params)
        sps = [
            SamplingParams(max_tokens=12, temperature=0, kv_transfer_params=prm) for prm in params
        ]
        got = [[o.token_ids for o in r.outputs] for r in d.generate(reqs, sps, use_tqdm=False)]
        assert got == want
        assert d.llm_engine.connector.num_transfers == len(prompts)
        d.llm_engine.runner.vmm.check_invariants()
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()
