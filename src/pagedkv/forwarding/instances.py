"""The instances a request can be forwarded to: `Instance`, `InstancePool` (one role, used
round-robin, failing ones sitting out a cooldown) and `ProxyState`, what one forwarding front end
(the PD proxy, or the router for one request) shares between its requests."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RETRY_PAUSE_S", "Instance", "InstancePool", "ProxyState"]

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5  # between rounds over every instance of a role (one may be restarting)


@dataclass(slots=True)
class Instance:
    """One ``pagedkv serve`` (or vLLM) server; unhealthy until ``unhealthy_until`` (monotonic)."""

    url: str
    unhealthy_until: float = 0.0

    def healthy(self, now: float) -> bool:
        return now >= self.unhealthy_until


@dataclass(slots=True)
class InstancePool:
    """The instances of one role, used round-robin; failing ones sit out ``cooldown`` seconds."""

    role: str
    instances: list[Instance]
    cooldown: float = 5.0
    _next: int = 0

    @classmethod
    def from_urls(cls, role: str, urls: list[str], cooldown: float = 5.0) -> InstancePool:
        return cls(role, [Instance(u.rstrip("/")) for u in urls], cooldown)

    def candidates(self) -> list[Instance]:
        """Every instance, in the order to try them for one request: round-robin from the next
        one, healthy first (unhealthy ones last: better a retry than a 503 when all are)."""
        n = len(self.instances)
        start, self._next = self._next, (self._next + 1) % n
        order = [self.instances[(start + i) % n] for i in range(n)]
        now = time.monotonic()
        return [x for x in order if x.healthy(now)] + [x for x in order if not x.healthy(now)]

    def mark_failed(self, inst: Instance, why: str) -> None:
        inst.unhealthy_until = time.monotonic() + self.cooldown
        logger.warning(
            "%s instance %s failed (%s): skipped for %.1f s",
            self.role,
            inst.url,
            why,
            self.cooldown,
        )

    def mark_ok(self, inst: Instance) -> None:
        inst.unhealthy_until = 0.0

    def any_healthy(self) -> bool:
        now = time.monotonic()
        return any(x.healthy(now) for x in self.instances)


@dataclass(slots=True)
class ProxyState:
    """What the routes share (``app.state.proxy``); ``client`` is an ``httpx.AsyncClient``."""

    prefill: InstancePool
    decode: InstancePool
    client: Any
    health_timeout: float = 2.0
    # How long a request waits for an instance (rounds RETRY_PAUSE_S apart) before giving up.
    retry_window: float = 30.0
    # The last requests' (request id, prefill URL or None, decode URL or None), newest last.
    served: deque[tuple[str, str | None, str | None]] = field(
        default_factory=lambda: deque(maxlen=1000)
    )
    # EPD: encoder instances that encode a chat request's images first (None: no encoder
    # stage), and the last requests' (request id, encoder URL or None), newest last.
    encoder: InstancePool | None = None
    encoded: deque[tuple[str, str | None]] = field(default_factory=lambda: deque(maxlen=1000))
