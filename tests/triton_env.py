"""``TRITON_INTERPRET`` handling shared by the Triton test modules (imported after they set it)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest


def interpret_during_module(we_set: bool, interpret: bool) -> Callable[[], Iterator[None]]:
    """A module-scoped autouse fixture: keep ``TRITON_INTERPRET`` set while the module's kernels
    (decorated as interpreted at import) run — triton reads it again at every launch, and an
    earlier module may have unset it — and do not leak it into later modules and their
    subprocesses. ``we_set``: the module set the variable itself (it was absent)."""

    @pytest.fixture(scope="module", autouse=True)
    def _interpret_during_module() -> Iterator[None]:
        before = os.environ.get("TRITON_INTERPRET")
        if interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        yield
        if we_set or before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before

    return _interpret_during_module
