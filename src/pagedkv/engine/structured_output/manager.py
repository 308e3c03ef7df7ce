"""`StructuredOutputManager` (vLLM's name): compiles requests' grammars and builds each step's
token bitmask.

Compilation is thread-safe and cached (LRU, by backend and `StructuredOutputsParams.key`), so
`AsyncLLM` compiles a new grammar on its worker pool before the request reaches the engine
thread, and the engine's own `compile` is then a cache hit. A spec no backend can compile
raises `SamplingParamError` naming ``structured_outputs`` (a server's 400).

Backends (``structured_outputs_backend``, vLLM's names): ``"xgrammar"``, ``"guidance"``
(llguidance), or ``"auto"``: xgrammar when it imports, except for Lark grammars (no ``::=``),
which only llguidance reads, and JSON Schemas with keywords xgrammar accepts but does not
enforce (``not``, look-around patterns); a spec xgrammar refuses (e.g. a Unicode class in a regex) is
tried on llguidance before it is refused. Why xgrammar first: its per-step masks are cheaper
and steadier on this vocabulary (median 4-6 us per request but 26 us for any-JSON, p99 <= 63 us;
llguidance's median 4-26 us, p99 47-232 us), and a cached grammar is ready in 0.03 ms against
llguidance's 1-3 ms per request (`benchmarks/results/structured_outputs_zen1.json`).
Both are imported on first use only.

Masks are filled on the engine thread, between the forward pass and sampling: at a few
microseconds per request (xgrammar) against a 20-130 ms decode step here, overlapping them
with the forward pass would gain < 0.1% and, on 2 cores, take a core from the forward's
OpenMP team.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.engine.sampling_params import SamplingParamError, StructuredOutputsParams
from pagedkv.engine.structured_output.backend_types import (
    GrammarFactory,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")


class StructuredOutputManager:
    """``tokenizer``: the engine's `Tokenizer` (None: structured outputs are refused);
    ``vocab_size``: the logits' width; ``backend``: one of `BACKENDS`."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        backend: str = "auto",
        cache_size: int = 256,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_backend must be one of {BACKENDS}, got {backend!r}"
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend = backend
        self.cache_size = cache_size
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._cache: OrderedDict[tuple[str, str, str, bool], GrammarFactory] = OrderedDict()
        self._lock = threading.Lock()
        # Counters (benchmarks, /metrics): compilations, cache hits, seconds compiling and
        # filling masks.
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0
        self.mask_seconds = 0.0

    # ---- compilation (any thread) -----------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> GrammarFactory:
        """The compiled grammar of ``params`` (cached); SamplingParamError when it is invalid."""
        kind, spec, compact = params.key()
        names = self._backend_names(params, kind, spec)
        errors: list[str] = []
        for name in names:
            key = (name, kind, spec, compact)
            with self._lock:
                factory = self._cache.get(key)
                if factory is not None:
                    self._cache.move_to_end(key)
                    self.num_cache_hits += 1
                    return factory
            try:
                t0 = time.perf_counter()
                factory = self.get_backend(name).compile(kind, spec, compact)
            except ValueError as e:
                errors.append(f"{name}: {e}" if len(names) > 1 else str(e))
                continue
            with self._lock:
                self.num_compiled += 1
                self.compile_seconds += time.perf_counter() - t0
                self._cache[key] = factory
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return factory
        raise SamplingParamError(
            "structured_outputs",
            _brief(kind, spec),
            f"cannot compile the {kind}: " + "; ".join(errors),
        )

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        kind, spec, compact = params.key()
        with self._lock:
            return any(
                (n, kind, spec, compact) in self._cache
                for n in self._backend_names(params, kind, spec)
            )

    def grammar_for(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh matcher for one request."""
        return self.compile(params)()

    def _backend_names(self, params: StructuredOutputsParams, kind: str, spec: str) -> list[str]:
        if self.tokenizer is None:
            raise SamplingParamError(
                "structured_outputs", kind, "this model has no tokenizer to build a grammar on"
            )
        wanted = params.backend or self.backend
        if wanted != "auto":
            if not backend_installed(wanted):
                raise SamplingParamError(
                    "structured_outputs", wanted, f"the {wanted} backend is not installed"
                )
            return [wanted]
        have = [n for n in ("xgrammar", "guidance") if backend_installed(n)]
        if _guidance_only(kind, spec):
            have = [n for n in have if n == "guidance"]
        if not have:
            raise SamplingParamError(
                "structured_outputs",
                kind,
                "no structured-output backend is installed (pip install xgrammar or llguidance)",
            )
        return have

    def get_backend(self, name: str) -> StructuredOutputBackend:
        """The ``name`` backend over this tokenizer (built on first use, then kept)."""
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                tok = self.tokenizer
                stops = list(tok.stop_token_ids)
                if name == "xgrammar":
                    from pagedkv.engine.structured_output.backend_xgrammar import XgrammarBackend

                    backend = XgrammarBackend(tok.backend, self.vocab_size, stops)
                else:
                    from pagedkv.engine.structured_output.backend_guidance import GuidanceBackend

                    backend = GuidanceBackend(tok.backend, self.vocab_size, stops)
                self._backends[name] = backend
            return backend

    # ---- the step (engine thread) -----------------------------------------------------------

    def grammar_bitmask(self, requests: Sequence[Any]) -> torch.Tensor | None:
        """One bitmask row per request (int32 ``[rows, ceil(vocab / 32)]``): the tokens each
        structured request's grammar allows next, all bits set for the others; None when no
        request of the batch is structured."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        bitmask = torch.full((len(requests), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for i in rows:
            requests[i].grammar.fill_bitmask(bitmask, i)
        self.mask_seconds += time.perf_counter() - t0
        return bitmask

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "num_compiled": self.num_compiled,
                "num_cache_hits": self.num_cache_hits,
                "compile_seconds": self.compile_seconds,
                "mask_seconds": self.mask_seconds,
                "cached_grammars": len(self._cache),
            }


def _guidance_only(kind: str, spec: str) -> bool:
    """A Lark grammar (no ``::=``: only llguidance reads it), or a JSON Schema with keywords
    xgrammar would not enforce (`backend_xgrammar.xgrammar_ignores`)."""
    if kind == "grammar":
        return "::=" not in spec
    if kind == "json":
        from pagedkv.engine.structured_output.backend_xgrammar import xgrammar_ignores

        try:
            return xgrammar_ignores(json.loads(spec))
        except ValueError:
            return False
    return False


@functools.cache
def backend_installed(name: str) -> bool:
    """The backend's library imports (xgrammar also needs transformers: an install without
    it counts as absent, and "auto" uses llguidance)."""
    module = "xgrammar" if name == "xgrammar" else "llguidance"
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except ImportError as e:
        logger.warning("structured outputs: %s is installed but does not import: %s", module, e)
        return False
    return True


def _brief(kind: str, spec: str) -> str:
    text = f"{kind}:{spec}" if spec else kind
    return text if len(text) <= 60 else text[:57] + "..."
