"""A real pagedkv OpenAI server on 127.0.0.1 for a test module, and an httpx client to it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.entrypoints.openai.api_server import create_app


@contextmanager
def running_server(config: EngineConfig, **app_kwargs: Any) -> Iterator[BackgroundServer]:
    """``create_app(config, **app_kwargs)`` served by uvicorn in a background thread; stopped
    (engine shut down) on exit."""
    with BackgroundServer(create_app(config, **app_kwargs)) as srv:
        yield srv


@contextmanager
def client(server: BackgroundServer, timeout: float = 60) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=timeout) as c:
        yield c
