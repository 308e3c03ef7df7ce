"""GGUF header reader: metadata and tensor descriptors, tensor bytes memory-mapped, not read.

``gguf.GGUFReader`` builds a numpy view per vocabulary string and takes ~1.7 s on SmolLM2; this
parser takes ~0.1 s (a test checks it against ``GGUFReader``). No torch here, so
``pagedkv plan`` can read a model's shape without importing it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_U64 = struct.Struct("<Q")
_NP_SCALAR = {t: np.dtype(f) for t, f in _SCALAR.items()}


@dataclass(slots=True)
class GGUFTensor:
    """One tensor's header: ``shape`` in torch order (rows, cols) and its raw bytes (mapped)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    raw: np.ndarray  # uint8 [nbytes], a view into the memory-mapped file


@dataclass(slots=True)
class GGUFFile:
    """A parsed GGUF file: all key/value metadata (arrays as lists) and its tensors by name."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


class _Cursor:
    """Little-endian reads over a byte buffer."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = str(self.buf[self.pos : self.pos + n], "utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings: one tight loop (vocabularies hold ~50k of them)."""
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            out[i] = str(buf[pos : pos + n], "utf-8", "replace")
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if etype in _NP_SCALAR:  # numeric arrays in one numpy read
                arr = np.frombuffer(self.buf, _NP_SCALAR[etype], count, self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            if etype == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        return self.scalar(_SCALAR[vtype])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF (v2/v3, little-endian) header and map its tensor data (nothing is read yet)."""
    path = Path(path)
    data = np.memmap(
        path, dtype=np.uint8, mode="c"
    )  # copy-on-write: writable views, file untouched
    cur = _Cursor(memoryview(data))
    if bytes(cur.buf[:4]) != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(
            f"{path}: unsupported GGUF version {version} (big-endian files are not supported)"
        )
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(GGUFValueType(cur.scalar("<I")))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        infos.append(
            (name, tuple(reversed(dims)), GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q"))
        )
    align = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cur.pos // align) * align
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * type_size
        tensors[name] = GGUFTensor(
            name, shape, qtype, data[start + offset : start + offset + nbytes]
        )
    return GGUFFile(path, version, meta, tensors)
