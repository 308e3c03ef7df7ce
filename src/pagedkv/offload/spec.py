"""The ``--kv-offload`` option: one string naming every tier, parsed into `OffloadConfig`.

Grammar (comma-separated tiers, any order, each at most once; ``cpu`` is required because
the CPU tier is the gateway every other tier goes through)::

    cpu:<size>
    disk:<directory>:<size>[:<codec>]
    redis://[:<password>@]<host>:<port>[/<db>][?ttl=<seconds>][&codec=<codec>]
    p2p:<peer host>:<port>[:<codec>]            (a peer to read cached prefixes from; repeatable)
    p2p-listen:[<host>:]<port>:<size>[:<codec>] (serve this instance's prefixes; <size> of them)

A P2P tier has one codec (what its chunks are in memory and on the wire); every ``p2p`` and
``p2p-listen`` part that names one must name the same, and peers must agree (the handshake
refuses another codec).

Codecs (`offload.codec`): ``raw`` (default), ``zstd`` and ``lz4`` (lossless), ``int8``
(lossy: what comes back from the tier is int8-rounded).

Sizes: an integer or decimal with an optional unit, ``B``, ``KB``/``MB``/``GB``/``TB`` (powers
of 1000) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), case-insensitive. Example::

    cpu:4GiB,disk:/var/cache/pagedkv:20GiB:zstd,redis://127.0.0.1:6379/0?ttl=3600&codec=lz4
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from pagedkv.core.units import format_size, parse_size
from pagedkv.offload.codec import CODECS

__all__ = [
    "CPUTierConfig",
    "DiskTierConfig",
    "OffloadConfig",
    "P2PTierConfig",
    "RedisTierConfig",
    "format_size",
    "parse_offload_spec",
    "parse_size",
]


@dataclass(frozen=True, slots=True)
class CPUTierConfig:
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    path: str
    capacity_bytes: int
    codec: str = "raw"


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    host: str
    port: int = 6379
    db: int = 0
    ttl_s: int | None = None
    password: str | None = None
    codec: str = "raw"


@dataclass(frozen=True, slots=True)
class P2PTierConfig:
    """Peers to read from, and where (and how much) this instance serves (port 0: it serves
    nothing, it only reads)."""

    peers: tuple[tuple[str, int], ...] = ()
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    capacity_bytes: int = 0
    codec: str = "raw"


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    cpu: CPUTierConfig
    disk: DiskTierConfig | None = None
    redis: RedisTierConfig | None = None
    p2p: P2PTierConfig | None = None

    def to_spec(self) -> str:
        """The canonical option string (parses back to an equal config)."""
        parts = [f"cpu:{format_size(self.cpu.capacity_bytes)}"]
        if self.disk:
            codec = f":{self.disk.codec}" if self.disk.codec != "raw" else ""
            parts.append(f"disk:{self.disk.path}:{format_size(self.disk.capacity_bytes)}{codec}")
        if self.redis:
            r = self.redis
            auth = f":{r.password}@" if r.password else ""
            query = [f"ttl={r.ttl_s}"] if r.ttl_s is not None else []
            query += [f"codec={r.codec}"] if r.codec != "raw" else []
            q = f"?{'&'.join(query)}" if query else ""
            parts.append(f"redis://{auth}{r.host}:{r.port}/{r.db}{q}")
        if self.p2p:
            p = self.p2p
            codec = f":{p.codec}" if p.codec != "raw" else ""
            parts.extend(f"p2p:{h}:{port}{codec}" for h, port in p.peers)
            if p.listen_port:
                parts.append(
                    f"p2p-listen:{p.listen_host}:{p.listen_port}:"
                    f"{format_size(p.capacity_bytes)}{codec}"
                )
        return ",".join(parts)


def _parse_redis(text: str) -> RedisTierConfig:
    url = urlsplit(text)
    if not url.hostname:
        raise ValueError(f"bad redis URL {text!r}: expected redis://host:port[/db][?ttl=s]")
    path = url.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"bad redis db {path!r} in {text!r}")
    query = parse_qs(url.query, strict_parsing=bool(url.query))
    unknown = set(query) - {"ttl", "codec"}
    if unknown:
        raise ValueError(
            f"unknown redis option(s) {sorted(unknown)} in {text!r} (supported: ttl, codec)"
        )
    ttl = int(query["ttl"][-1]) if "ttl" in query else None
    if ttl is not None and ttl <= 0:
        raise ValueError("redis ttl must be a positive number of seconds")
    codec = _codec(query["codec"][-1] if "codec" in query else "raw", text)
    return RedisTierConfig(url.hostname, url.port or 6379, int(path or 0), ttl, url.password, codec)


def _codec(name: str, raw: str) -> str:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r} in {raw!r} (choose {', '.join(CODECS)})")
    return name


def _port(text: str, raw: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port {text!r} in {raw!r}")
    return int(text)


def _split_codec(rest: str, raw: str) -> tuple[str, str | None]:
    """``rest`` without a trailing ``:<codec>`` (a codec starts with a letter; sizes and ports
    with a digit), and the codec or None."""
    head, sep, last = rest.rpartition(":")
    if sep and last and last[0].isalpha() and head:
        return head, _codec(last.lower(), raw)
    return rest, None


def _parse_p2p_peer(rest: str, raw: str) -> tuple[str, int]:
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"bad p2p peer {raw!r}: expected p2p:<host>:<port>")
    return host, _port(port, raw)


def _parse_p2p_listen(rest: str, raw: str) -> tuple[str, int, int]:
    hostport, sep, size = rest.rpartition(":")
    if not sep or not hostport:
        raise ValueError(f"bad p2p-listen {raw!r}: expected p2p-listen:[<host>:]<port>:<size>")
    host, _, port = hostport.rpartition(":")
    return host or "127.0.0.1", _port(port, raw), parse_size(size)


def parse_offload_spec(spec: str) -> OffloadConfig:
    """Parse the option string (see the module docstring); ValueError says what is wrong."""
    tiers: dict[str, object] = {}
    peers: list[tuple[str, int]] = []
    listen: tuple[str, int, int] | None = None
    p2p_codecs: set[str] = set()
    for raw in (p.strip() for p in spec.split(",")):
        if not raw:
            continue
        kind, _, rest = raw.partition(":")
        kind = kind.lower()
        if kind in ("p2p", "p2p-listen"):
            rest, codec = _split_codec(rest, raw)
            if codec is not None:
                p2p_codecs.add(codec)
        if kind == "p2p":
            peers.append(_parse_p2p_peer(rest, raw))
            continue
        if kind == "p2p-listen":
            if listen is not None:
                raise ValueError(f"p2p-listen given twice in {spec!r}")
            listen = _parse_p2p_listen(rest, raw)
            continue
        if kind in tiers:
            raise ValueError(f"tier {kind!r} given twice in {spec!r}")
        if kind == "cpu":
            tiers[kind] = CPUTierConfig(parse_size(rest))
        elif kind == "disk":
            codec = "raw"
            head, sep, last = rest.rpartition(":")
            if sep and last and not last[0].isdigit():  # disk:<dir>:<size>:<codec> (sizes start
                # with a digit)
                rest, codec = head, _codec(last.lower(), raw)
            path, sep, size = rest.rpartition(":")
            if not sep or not path:
                raise ValueError(
                    f"bad disk tier {raw!r}: expected disk:<directory>:<size>[:<codec>]"
                )
            tiers[kind] = DiskTierConfig(path, parse_size(size), codec)
        elif kind == "redis":
            tiers[kind] = _parse_redis(raw)
        else:
            raise ValueError(
                f"unknown tier {kind!r} in {spec!r} (cpu, disk, redis, p2p, p2p-listen)"
            )
    if "cpu" not in tiers:
        raise ValueError(f"{spec!r} has no cpu:<size> tier (the gateway of every other tier)")
    if peers or listen:
        host, port, size = listen or ("127.0.0.1", 0, 0)
        if listen and size <= 0:
            raise ValueError(f"p2p-listen needs a size above 0 in {spec!r}")
        if len(p2p_codecs) > 1:
            raise ValueError(f"one P2P tier, one codec: {sorted(p2p_codecs)} in {spec!r}")
        codec = p2p_codecs.pop() if p2p_codecs else "raw"
        tiers["p2p"] = P2PTierConfig(tuple(peers), host, port, size, codec)
    return OffloadConfig(**tiers)  # type: ignore[arg-type]
