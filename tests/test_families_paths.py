"""Every new model family through every engine path: Gemma 2 (sliding window + global), DeepSeek
V3 (MLA), Llama 4 text (chunked local + NoPE global) and Bamba (Mamba-2 + attention hybrid).

Tiny random-weight models built with the families' own test builders (transformers' classes,
float32) are saved as HF directories. For each family:

* ``LLM``: ``n = 3`` samples fork one request; greedy ones all equal transformers' greedy
  output, seeded random ones equal three separate requests seeded ``seed + i``. While the fork
  runs, the dashboard state lists every KV cache group with its kind and attributes the
  request's blocks to each group.
* ``pagedkv serve`` (a subprocess on 127.0.0.1, free ports, stopped by SIGINT to its PID): greedy
  ``/v1/completions`` of token-id prompts return transformers' tokens (and ``LLM``'s), streaming
  or not; ``/v1/kv_cache_config`` lists every group; ``BlockStored`` KV events carry each group's
  ``group_idx``, ``kv_cache_spec_kind`` and (sliding-window groups only, as vLLM) the window;
  distinct prompts overflowing the small pool evict, published as ``BlockRemoved``; the
  dashboard's state attributes cached blocks to their groups.

Also: the window KV events annotate a group with follows vLLM's rule (a uniform sliding group
carries its window, chunked and merged-full groups None), and the dashboard page in headless
Chromium names Gemma 2's groups in its header and in each block's tooltip.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_utils import check_clean, random_prompts
from test_dashboard import browser, wait_js  # noqa: F401  (browser: a fixture; skips without chromium)

from pagedkv import LLM, SamplingParams
from pagedkv.core.event_transport import KVEventSubscriber
from pagedkv.core.events import BlockRemoved, BlockStored
from pagedkv.entrypoints.dashboard import dashboard_state


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one torch thread (and a busy machine's oversubscription stays
    out of the test time)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gemma2() -> Any:
    import test_gemma2

    return test_gemma2.build(test_gemma2.tiny_config())


def _deepseek_v3() -> Any:
    import test_mla

    return test_mla.build(test_mla.v3_config())


def _llama4() -> Any:
    import test_llama4

    return test_llama4.build(test_llama4.tiny_config())


def _bamba() -> Any:
    import test_bamba
    from transformers import BambaForCausalLM

    torch.manual_seed(0)
    hf = BambaForCausalLM(test_bamba.tiny_config()).eval()
    with torch.no_grad():  # as test_bamba: HF's constant initialisations made to matter
        for layer in hf.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.D.normal_(0, 1)
                layer.mamba.dt_bias.normal_(0, 1)
                layer.mamba.norm.weight.normal_(1, 0.3)
    return hf


@dataclass(frozen=True, slots=True)
class Family:
    """One tiny model and the engine geometry its tests run with."""

    build: Callable[[], Any]
    vocab: int
    block_size: int  # the engine's (Bamba's is raised from 16 so a page holds a Mamba state)
    num_kv_blocks: int  # small: a few distinct prompts overflow it (evictions)
    max_model_len: int
    prompt_len: int  # crosses the window / chunk / Mamba block in every family
    kinds: tuple[str, ...]  # the groups' spec kinds, in group order
    window: int | None = None  # the sliding-window groups' window


FAMILIES = {
    "gemma2": Family(_gemma2, 256, 4, 36, 64, 30, ("sliding_window", "full_attention"), 16),
    "deepseek_v3": Family(_deepseek_v3, 128, 4, 20, 64, 30, ("mla_attention",)),
    "llama4": Family(
        _llama4, 256, 4, 66, 64, 30, ("chunked_local_attention",) * 3 + ("full_attention",)
    ),
    "bamba": Family(_bamba, 256, 48, 12, 160, 100, ("mamba", "full_attention")),
}
MAX_TOKENS = 12


@dataclass(slots=True)
class Model:
    name: str
    family: Family
    hf: Any
    path: Path
    memo: dict[tuple[int, ...], list[int]]

    def greedy(self, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        """transformers' greedy continuation, by a full forward per token (memoised)."""
        key = (*prompt, -n)
        if key not in self.memo:
            ids = list(prompt)
            with torch.inference_mode():
                for _ in range(n):
                    ids.append(int(self.hf(torch.tensor([ids])).logits[0, -1].argmax()))
            self.memo[key] = ids[len(prompt) :]
        return self.memo[key]

    def prompts(self, seed: int, count: int) -> list[list[int]]:
        return random_prompts(self.family.vocab, seed, [self.family.prompt_len] * count)

    def llm(self, **kw: Any) -> LLM:
        f = self.family
        return LLM(
            model=str(self.path),
            block_size=f.block_size,
            num_kv_blocks=f.num_kv_blocks,
            max_model_len=f.max_model_len,
            **kw,
        )


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    family = FAMILIES[request.param]
    hf = family.build()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return Model(request.param, family, hf, path, {})


def group_kinds(llm: LLM) -> list[str]:
    return [g.kv_cache_spec.kind for g in llm.llm_engine.kv_cache_config.kv_cache_groups]


# ---- LLM: n > 1 forks, and the dashboard's per-group map while they run ----------------------


def test_n_samples_fork_and_equal_separate_runs(model: Model) -> None:
    llm = model.llm()
    engine = llm.llm_engine
    assert (
        group_kinds(llm) == list(model.family.kinds)
        and engine.block_size == model.family.block_size
    )
    prompt, other = model.prompts(1, 2)
    ref = model.greedy(prompt)

    # Greedy n = 3, stepped by hand so the dashboard sees the forked request mid-run.
    engine.add_request(
        "g",
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    outs: dict[str, Any] = {}
    state = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        if state is None and engine.scheduler.num_running == 3:
            state = dashboard_state(engine)
    assert [c.token_ids for c in outs["g"].outputs] == [ref] * 3
    assert state is not None
    assert [g["kind"] for g in state["groups"]] == list(model.family.kinds)
    held = [0] * len(state["groups"])
    for block_id, group in state["block_groups"].items():
        held[group] += state["blocks"][int(block_id)] in "us"
    assert all(held), held  # every group holds blocks of the running samples
    assert "s" in state["blocks"]  # the fork shares the prompt's blocks

    # Seeded random n = 3 == three separate requests seeded seed, seed + 1, seed + 2.
    kw = dict(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (forked,) = llm.generate(
        {"prompt_token_ids": other}, SamplingParams(n=3, seed=11, **kw), use_tqdm=False
    )
    single = llm.generate(
        [{"prompt_token_ids": other}] * 3,
        [SamplingParams(seed=11 + i, **kw) for i in range(3)],
        use_tqdm=False,
    )
    got = [c.token_ids for c in forked.outputs]
    assert got == [o.outputs[0].token_ids for o in single]
    assert len({tuple(t) for t in got}) > 1  # really sampled
    check_clean(llm)


# ---- pagedkv serve: completions, the cache config, KV events, the dashboard -----------------


class Server:
    """``pagedkv serve`` in a subprocess on free ports; ``stop()`` sends SIGINT to its PID."""

    def __init__(self, model: Model) -> None:
        f = model.family
        cmd = [
            sys.executable,
            "-m",
            "pagedkv.entrypoints.cli",
            "serve",
            "--model",
            str(model.path),
            "--port",
            "0",
            "--block-size",
            str(min(f.block_size, 16)),
            "--num-kv-blocks",
            str(f.num_kv_blocks),
            "--max-model-len",
            str(f.max_model_len),
            "--max-num-seqs",
            "4",
            "--enable-kv-cache-events",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--log-stats-interval",
            "0",
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        )
        self.url = self.events = ""
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while not self.url and time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            if "kv events on" in line:
                self.events = line.split()[-1]
            if "listening on" in line:
                self.url = line.split()[-1]
        if not (self.url and self.events):
            self.stop()
            raise AssertionError("pagedkv serve did not start:\n" + "".join(lines))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def complete(http: httpx.Client, prompt: list[int], stream: bool = False) -> tuple[list[int], int]:
    """Greedy ``/v1/completions`` of a token-id prompt: (the completion's token ids, the prompt
    tokens served from the prefix cache)."""
    body = dict(
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
    )
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["prompt_token_ids"] == prompt and choice["finish_reason"] == "length"
        return choice["token_ids"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    import json

    tokens: list[int] = []
    usage: dict[str, Any] = {}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens, usage["prompt_tokens_details"]["cached_tokens"]


def drain(
    sub: KVEventSubscriber, until: Callable[[list[Any]], bool], timeout: float = 20.0
) -> list[Any]:
    events: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(events):
        item = sub.recv(timeout=0.2)
        if item is not None:
            events += item[1].events
    assert until(events), f"timed out with {len(events)} events"
    return events


@pytest.mark.slow
def test_serve_completions_events_and_dashboard(model: Model) -> None:
    f = model.family
    batch = model.prompts(2, 5)
    server = Server(model)
    try:
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            KVEventSubscriber(server.events) as sub,
        ):
            cfg = http.get("/v1/kv_cache_config").json()
            assert cfg["block_size"] == f.block_size and cfg["num_blocks"] == f.num_kv_blocks
            groups = cfg["kv_cache_groups"]
            assert [g["kind"] for g in groups] == list(f.kinds)
            assert all(g["block_size"] == f.block_size and g["num_layers"] >= 1 for g in groups)
            assert sum(g["num_layers"] for g in groups) == model.hf.config.num_hidden_layers
            time.sleep(0.3)  # PUB/SUB: the subscription reaches the publisher first

            first, cached = complete(http, batch[0])
            assert first == model.greedy(batch[0]) and cached == 0
            again, cached = complete(http, batch[0], stream=True)
            assert (
                again == first and cached > 0 and cached % f.block_size == 0
            )  # a prefix hit, streamed
            stored = drain(
                sub,
                lambda ev: (
                    {e.group_idx for e in ev if isinstance(e, BlockStored)}
                    == set(range(len(groups)))
                ),
            )
            for e in stored:
                if not isinstance(e, BlockStored):
                    continue
                assert e.kv_cache_spec_kind == f.kinds[e.group_idx] and e.block_size == f.block_size
                window = f.window if e.kv_cache_spec_kind == "sliding_window" else None
                assert e.kv_cache_spec_sliding_window == window
                assert len(e.token_ids) == len(e.block_hashes) * f.block_size

            st = http.get("/dashboard/state").json()
            assert [g["kind"] for g in st["groups"]] == list(f.kinds)
            cached = {st["block_groups"][str(i)] for i, ch in enumerate(st["blocks"]) if ch == "c"}
            assert cached == set(range(len(groups)))  # every group's cached blocks, attributed

            # Distinct prompts overflow the pool: cached blocks are evicted and published.
            for p in batch[1:]:
                assert complete(http, p)[0] == model.greedy(p)
            events = stored + drain(sub, lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
            time.sleep(0.3)
            while (item := sub.recv(timeout=0.2)) is not None:
                events += item[1].events
            # Every evicted block was published as stored in its group, and not yet removed (a
            # multiset, as vLLM's: equal blocks computed twice are stored and removed twice).
            live: Counter[tuple[int, Any]] = Counter()
            for e in events:
                if isinstance(e, BlockStored):
                    live.update((e.group_idx, h) for h in e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    for h in e.block_hashes:
                        assert live[e.group_idx, h] > 0, e
                        live[e.group_idx, h] -= 1
            assert any(isinstance(e, BlockRemoved) for e in events)
            assert http.get("/debug/kv_cache").json()["invariants_ok"] is True
    finally:
        rc = server.stop()
    assert rc == 0
    llm = model.llm()  # LLM offline gives the same tokens as the server
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [model.greedy(p) for p in batch]


# ---- the KV event annotation rule (vLLM's get_kv_cache_spec_sliding_window) ------------------


def test_event_window_annotation_follows_vllm() -> None:
    """A sliding-window group's events carry its window, also when the group is a
    `UniformTypeKVCacheSpecs` of sliding layers with different head sizes; chunked local groups
    and a full-attention spec that merged windowed layers carry None (vLLM annotates
    ``SlidingWindowSpec`` only)."""
    from core_utils import admit, make_manager, make_request

    from pagedkv.core.specs import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
        get_kv_cache_spec_sliding_window,
    )

    geo = dict(block_size=16, num_kv_heads=1, dtype="float32")
    swa = [SlidingWindowSpec(head_size=h, sliding_window=64, **geo) for h in (1, 2)]  # type: ignore[arg-type]
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": swa[0], "b": swa[1]})
    merged = FullAttentionSpec(head_size=1, sliding_window=64, **geo)  # type: ignore[arg-type]
    chunked = ChunkedLocalAttentionSpec(head_size=1, attention_chunk_size=32, **geo)  # type: ignore[arg-type]
    assert [get_kv_cache_spec_sliding_window(s) for s in (swa[0], uniform, merged, chunked)] == [
        64,
        64,
        None,
        None,
    ]
    full = [FullAttentionSpec(head_size=h, **geo) for h in (1, 2)]  # type: ignore[arg-type]
    mixed = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full[0], "b": full[1]})
    assert get_kv_cache_spec_sliding_window(mixed) is None

    m = make_manager(num_blocks=20, specs=[uniform, chunked, merged], events=True)
    admit(m, make_request(list(range(40)), m))
    got = {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in m.take_events()
    }
    assert got == {
        (0, "sliding_window", 64),
        (1, "chunked_local_attention", None),
        (2, "full_attention", None),
    }


# ---- the dashboard page: a hybrid model's groups in a real browser --------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemma2"], indirect=True)
def test_dashboard_page_names_each_group_in_chromium(model: Model, browser: Any) -> None:
    """Gemma 2's two groups (sliding window 16, full) in headless Chromium: the header lists
    both, and hovering a cached block of each group names its group in the tooltip."""
    import json

    from selenium.webdriver.common.action_chains import ActionChains
    from server_utils import running_server

    from pagedkv.engine.config import EngineConfig

    f = model.family
    config = EngineConfig(
        model=str(model.path),
        block_size=f.block_size,
        num_kv_blocks=f.num_kv_blocks,
        max_model_len=f.max_model_len,
    )
    with running_server(config) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        prompt = model.prompts(3, 1)[0]
        assert complete(http, prompt)[0] == model.greedy(prompt)
        browser.get(srv.url + "/dashboard")
        st = wait_js(browser, "window.__pagedkv.lastState", 30, "a state")
        header = browser.find_element("id", "geometry").text
        assert (
            "2 KV cache groups: 0 sliding_window (w 16)" in header and "1 full_attention" in header
        )
        canvas = browser.find_element("id", "map")
        for gid, name in enumerate(["0 sliding_window (w 16)", "1 full_attention"]):
            block = next(
                int(b)
                for b, g in st["block_groups"].items()
                if g == gid and st["blocks"][int(b)] == "c"
            )
            x, y, w, h = browser.execute_script(f"""
                const g = window.__pagedkv.mapGeom, i = {block};
                const r = document.getElementById('map').getBoundingClientRect();
                return [g.gutter + (i % g.cols) * g.cell + g.cell / 2, Math.floor(i / g.cols) * g.cell + g.cell / 2,
                        r.width, r.height];""")
            ActionChains(browser).move_to_element_with_offset(
                canvas, int(x - w / 2), int(y - h / 2)
            ).perform()
            got = wait_js(
                browser,
                f"""(() => {{ const b = document.getElementById('tip-block');
                return b && b.textContent === 'block {block}' && document.getElementById('tip-group').textContent;
                }})()""",
                10,
                f"the tooltip of block {block}",
            )
            assert got == name, json.dumps(got)
