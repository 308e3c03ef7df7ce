"""The ``--kv-offload`` option: one string naming every tier, parsed into `OffloadConfig`.

Grammar (comma-separated tiers, any order, each at most once; ``cpu`` is required because
the CPU tier is the gateway every other tier goes through)::

    cpu:<size>
    disk:<directory>:<size>
    redis://[:<password>@]<host>:<port>[/<db>][?ttl=<seconds>]

Sizes: an integer or decimal with an optional unit, ``B``, ``KB``/``MB``/``GB``/``TB`` (powers
of 1000) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), case-insensitive. Example::

    cpu:4GiB,disk:/var/cache/pagedkv:20GiB,redis://127.0.0.1:6379/0?ttl=3600
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from pagedkv.core.units import format_size, parse_size

__all__ = ["CPUTierConfig", "DiskTierConfig", "OffloadConfig", "RedisTierConfig", "format_size",
           "parse_offload_spec", "parse_size"]


@dataclass(frozen=True, slots=True)
class CPUTierConfig:
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    path: str
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    host: str
    port: int = 6379
    db: int = 0
    ttl_s: int | None = None
    password: str | None = None


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    cpu: CPUTierConfig
    disk: DiskTierConfig | None = None
    redis: RedisTierConfig | None = None

    def to_spec(self) -> str:
        """The canonical option string (parses back to an equal config)."""
        parts = [f"cpu:{format_size(self.cpu.capacity_bytes)}"]
        if self.disk:
            parts.append(f"disk:{self.disk.path}:{format_size(self.disk.capacity_bytes)}")
        if self.redis:
            r = self.redis
            auth = f":{r.password}@" if r.password else ""
            ttl = f"?ttl={r.ttl_s}" if r.ttl_s is not None else ""
            parts.append(f"redis://{auth}{r.host}:{r.port}/{r.db}{ttl}")
        return ",".join(parts)


def _parse_redis(text: str) -> RedisTierConfig:
    url = urlsplit(text)
    if not url.hostname:
        raise ValueError(f"bad redis URL {text!r}: expected redis://host:port[/db][?ttl=s]")
    path = url.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"bad redis db {path!r} in {text!r}")
    query = parse_qs(url.query, strict_parsing=bool(url.query))
    unknown = set(query) - {"ttl"}
    if unknown:
        raise ValueError(f"unknown redis option(s) {sorted(unknown)} in {text!r} (supported: ttl)")
    ttl = int(query["ttl"][-1]) if "ttl" in query else None
    if ttl is not None and ttl <= 0:
        raise ValueError("redis ttl must be a positive number of seconds")
    return RedisTierConfig(url.hostname, url.port or 6379, int(path or 0), ttl, url.password)


def parse_offload_spec(spec: str) -> OffloadConfig:
    """Parse the option string (see the module docstring); ValueError says what is wrong."""
    tiers: dict[str, object] = {}
    for raw in (p.strip() for p in spec.split(",")):
        if not raw:
            continue
        kind, _, rest = raw.partition(":")
        kind = kind.lower()
        if kind in tiers:
            raise ValueError(f"tier {kind!r} given twice in {spec!r}")
        if kind == "cpu":
            tiers[kind] = CPUTierConfig(parse_size(rest))
        elif kind == "disk":
            path, sep, size = rest.rpartition(":")
            if not sep or not path:
                raise ValueError(f"bad disk tier {raw!r}: expected disk:<directory>:<size>")
            tiers[kind] = DiskTierConfig(path, parse_size(size))
        elif kind == "redis":
            tiers[kind] = _parse_redis(raw)
        else:
            raise ValueError(f"unknown tier {kind!r} in {spec!r} (cpu, disk, redis)")
    if "cpu" not in tiers:
        raise ValueError(f"{spec!r} has no cpu:<size> tier (the gateway of every other tier)")
    return OffloadConfig(**tiers)  # type: ignore[arg-type]
