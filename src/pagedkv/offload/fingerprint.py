"""Config fingerprint and the self-describing record header of persistent tiers.

A chunk's bytes depend on more than its token prefix: the model weights, the KV dtype and
quantization, block size and chunking, the memory layout and the parallel rank all change
them. `OffloadFingerprint.hexdigest` folds all of that (plus `FORMAT_VERSION`) into a stable
hex digest. Disk and Redis tiers namespace keys by it (a directory, a key prefix) and stamp it
into every record, so a key can never map to bytes of another configuration, even if someone
copies files around.

Record = `RecordHeader` + payload. The header holds the fingerprint, the key, the payload
length and checksums (xxh3-64) of the payload and of the header itself; `RecordHeader.unpack`
and `verify` reject torn, corrupted and foreign records.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

FORMAT_VERSION = 1
FINGERPRINT_HEX_CHARS = 32  # 128 bits


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class OffloadFingerprint:
    """Everything that changes a chunk's bytes. ``model`` should identify the *weights*, not
    only the architecture (e.g. the GGUF file name and size, or a content hash)."""

    model: str
    dtype: str
    block_size: int
    layout: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_quant: str = "none"
    blocks_per_chunk: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # Decode context parallelism: which share of each block's tokens the chunk holds. Left out
    # of the JSON at (0, 1), so digests without DCP are those of before it existed.
    dcp_rank: int = 0
    dcp_size: int = 1
    # The KV cache group layout (`offload.kv_groups.OffloadGroupLayout.describe`): kind, block
    # size, window and layer count of each group. Empty for one full-attention group (the
    # fields above describe it), and then left out of the JSON, so single-group digests are
    # those of before groups were covered.
    kv_cache_groups: str = ""
    # The tier codec (`offload.codec`): records of another codec live in another namespace.
    # Left out of the JSON when raw, so raw digests are those of before codecs existed.
    codec: str = ""
    format_version: int = FORMAT_VERSION

    @classmethod
    def create(
        cls,
        model: str,
        dtype: Any,
        block_size: int,
        layout: Any,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        **kw: Any,
    ) -> OffloadFingerprint:
        """Normalising constructor: ``dtype`` may be a torch dtype, ``layout`` an enum."""
        layout_str = layout if isinstance(layout, str) else getattr(layout, "name", str(layout))
        return cls(
            model=model,
            dtype=_dtype_name(dtype),
            block_size=block_size,
            layout=layout_str.upper(),
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            **kw,
        )

    def to_json(self) -> str:
        fields = asdict(self)
        if not fields["kv_cache_groups"]:
            del fields["kv_cache_groups"]
        if fields["dcp_size"] == 1:
            del fields["dcp_rank"], fields["dcp_size"]
        if fields["codec"] in ("", "raw"):
            del fields["codec"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @property
    def hexdigest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:FINGERPRINT_HEX_CHARS]


class RecordError(ValueError):
    """A stored record is torn, corrupted or belongs to another configuration or key."""


_MAGIC = b"PKVC"
_KEY_MAX = 64
# magic, version, header_len, fingerprint(16 B), key_len, key(64 B), payload_len,
# payload xxh3-64; then the header's own xxh3-64 over everything before it.
_BODY = struct.Struct(f"<4sHH16sH{_KEY_MAX}sQQ")
_TAIL = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + _TAIL.size


def checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object (≈ memory speed, so verifying every read is cheap)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    fingerprint: str  # hex, FINGERPRINT_HEX_CHARS long
    key: bytes
    payload_len: int
    payload_checksum: int

    @classmethod
    def for_payload(cls, fingerprint: str, key: bytes, payload: Any) -> RecordHeader:
        return cls(fingerprint, bytes(key), memoryview(payload).nbytes, checksum(payload))

    def pack(self) -> bytes:
        if len(self.key) > _KEY_MAX:
            raise ValueError(f"key longer than {_KEY_MAX} bytes")
        body = _BODY.pack(
            _MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            bytes.fromhex(self.fingerprint),
            len(self.key),
            self.key,
            self.payload_len,
            self.payload_checksum,
        )
        return body + _TAIL.pack(checksum(body))

    @classmethod
    def unpack(cls, data: Any) -> RecordHeader:
        """Parse and check the header's own integrity (not the payload); RecordError if bad."""
        buf = memoryview(data)[:HEADER_SIZE]
        if buf.nbytes < HEADER_SIZE:
            raise RecordError("short header")
        body = buf[: _BODY.size]
        if _TAIL.unpack(buf[_BODY.size :])[0] != checksum(body):
            raise RecordError("header checksum mismatch")
        magic, version, size, fp, key_len, key, plen, pcs = _BODY.unpack(body)
        if (
            magic != _MAGIC
            or version != FORMAT_VERSION
            or size != HEADER_SIZE
            or key_len > _KEY_MAX
        ):
            raise RecordError("not a pagedkv record of this format version")
        return cls(fp.hex(), key[:key_len], plen, pcs)

    def verify(self, fingerprint: str, key: bytes, payload: Any) -> None:
        """RecordError unless this header describes ``payload`` stored under (fingerprint, key)."""
        if self.fingerprint != fingerprint:
            raise RecordError("record of another configuration (fingerprint mismatch)")
        if self.key != key:
            raise RecordError("record of another key")
        if memoryview(payload).nbytes != self.payload_len:
            raise RecordError("payload length mismatch (torn record?)")
        if checksum(payload) != self.payload_checksum:
            raise RecordError("payload checksum mismatch")
