"""Codecs between a chunk's device bytes and what a tier stores or sends (seed §8.2; CacheGen,
KIVI): compress KV only where it rests or travels, restore it on load. What attention computes
in the device cache never changes; a lossy codec changes only what comes back from a tier.

* ``raw``: the bytes as they are.
* ``zstd`` / ``lz4`` (lossless): a byte-plane shuffle (byte ``i`` of every element together:
  the exponent bytes of bf16/fp16/fp32 values repeat, the mantissa bytes do not), then
  zstandard (level 1: on real bf16 KV pages it stores fewer bytes than level 3, at twice the
  speed) or LZ4 frames, from the well-kept libraries of those names.
* ``int8`` (lossy): every K or V row of ``head_size`` values (a chunk's bytes are rows of
  ``head_size`` elements, K then V for each token-head, whatever the layout) as int8 codes and
  an fp16 scale, absmax / 127 per row: 1.94× fewer bytes than bf16 at head size 64.

A codec is a pure function of the bytes, run on the tiers' I/O threads, never on a step's
critical path. Tiers record the codec in the config fingerprint (so a reader configured with
another codec never finds, let alone decodes, these records) and checksum the encoded bytes.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

import numpy as np

CODECS = ("raw", "zstd", "lz4", "int8")
# dtype name -> bytes of one element (what the shuffle groups by; 1 for quantized pages).
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LEN = struct.Struct("<Q")  # the decoded length, ahead of a compressed frame


class CodecError(ValueError):
    """Encoded bytes that do not decode to the expected chunk (corrupt or foreign)."""


@dataclass(frozen=True, slots=True)
class KVCodec:
    """One codec for chunks of one KV configuration: ``element_bytes`` per value
    (1 for quantized pages), rows of ``head_size`` values for ``int8``."""

    name: str = "raw"
    element_bytes: int = 2
    head_size: int = 64
    dtype: str = "bfloat16"
    level: int = 1

    @property
    def lossy(self) -> bool:
        return self.name == "int8"

    def max_encoded_bytes(self, nbytes: int) -> int:
        """An upper bound of ``encode``'s output for a chunk of ``nbytes`` (for buffers)."""
        if self.name == "raw":
            return nbytes
        return _LEN.size + nbytes + nbytes // 64 + 1024  # incompressible input grows a little

    def encode(self, data: memoryview) -> memoryview | bytes:
        """The stored form of one chunk's bytes (any C-contiguous buffer, read as bytes)."""
        data = _bytes_view(data)
        if self.name == "raw":
            return data
        if self.name == "int8":
            return _LEN.pack(data.nbytes) + _int8_encode(data, self.dtype, self.head_size)
        shuffled = _shuffle(data, self.element_bytes)
        return _LEN.pack(data.nbytes) + _compress(self.name, shuffled, self.level)

    def decode(self, data: memoryview | bytes, out: memoryview) -> None:
        """Restore a chunk into ``out`` (its exact size); CodecError if ``data`` is not one."""
        out = _bytes_view(out)
        if self.name == "raw":
            if memoryview(data).nbytes != out.nbytes:
                raise CodecError("raw chunk of the wrong size")
            out[:] = data
            return
        view = memoryview(data)
        if view.nbytes < _LEN.size or _LEN.unpack(view[: _LEN.size])[0] != out.nbytes:
            raise CodecError(f"{self.name} frame of another chunk size")
        body = view[_LEN.size :]
        if self.name == "int8":
            _int8_decode(body, out, self.dtype, self.head_size)
            return
        raw = _decompress(self.name, body, out.nbytes)
        _unshuffle(raw, self.element_bytes, out)


def make_codec(name: str, dtype: str, head_size: int, quantized: bool) -> KVCodec:
    """The codec ``name`` for a cache of ``dtype`` (a torch dtype name) and ``head_size``;
    ``quantized``: its pages are quantized bytes (the lossless codecs then shuffle nothing,
    the lossy one is refused). ValueError names what does not fit."""
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r} (choose {', '.join(CODECS)})")
    if name == "int8" and (quantized or dtype not in ELEMENT_BYTES):
        raise ValueError(
            f"the int8 codec quantizes float pages; this cache stores {dtype}"
            + (" (quantized)" if quantized else "")
        )
    esize = 1 if quantized else ELEMENT_BYTES.get(dtype, 1)
    if name in ("zstd", "lz4"):
        _library(name)  # a clear error now, not on an I/O thread
    return KVCodec(name, esize, head_size, dtype)


def _bytes_view(buf: memoryview | bytes | bytearray) -> memoryview:
    """``buf`` as a flat view of unsigned bytes (tensors' and arrays' views have shapes)."""
    view = memoryview(buf)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


# ---- lossless ------------------------------------------------------------------------------------


def _library(name: str):  # noqa: ANN202 (a module)
    try:
        if name == "zstd":
            import zstandard

            return zstandard
        import lz4.frame

        return lz4.frame
    except ImportError:  # pragma: no cover - both are project dependencies
        raise ValueError(f"the {name} codec needs the {name} package") from None


def _shuffle(data: memoryview, esize: int) -> bytes:
    a = np.frombuffer(data, dtype=np.uint8)
    if esize == 1 or a.size % esize:
        return a.tobytes()
    return a.reshape(-1, esize).T.tobytes()


def _unshuffle(raw: bytes, esize: int, out: memoryview) -> None:
    a = np.frombuffer(raw, dtype=np.uint8)
    dst = np.frombuffer(out, dtype=np.uint8)
    if esize == 1 or a.size % esize:
        dst[:] = a
    elif esize in _WORD and sys.byteorder == "little" and dst.ctypes.data % esize == 0:
        # Byte planes back into words with shifts and ors over whole planes: 10x (bf16) and
        # 4x (fp32) the rate of numpy's strided scatter (which writes one byte per element).
        word = _WORD[esize]
        planes = a.reshape(esize, -1)
        o, tmp = dst.view(word), np.empty(planes.shape[1], dtype=word)
        np.copyto(o, planes[0], casting="unsafe")
        for i in range(1, esize):
            np.left_shift(planes[i], 8 * i, out=tmp, dtype=word)
            np.bitwise_or(o, tmp, out=o)
    else:
        dst.reshape(-1, esize)[:] = a.reshape(esize, -1).T


_WORD = {2: np.uint16, 4: np.uint32}


def _compress(name: str, data: bytes, level: int) -> bytes:
    lib = _library(name)
    if name == "zstd":
        return lib.ZstdCompressor(level=level).compress(data)
    return lib.compress(data, compression_level=0)


def _decompress(name: str, body: memoryview, nbytes: int) -> bytes:
    lib = _library(name)
    try:
        if name == "zstd":
            raw = lib.ZstdDecompressor().decompress(body, max_output_size=nbytes)
        else:
            raw = lib.decompress(body)
    except Exception as exc:  # the libraries raise their own error types
        raise CodecError(f"{name} frame does not decode: {exc}") from None
    if len(raw) != nbytes:
        raise CodecError(f"{name} frame decodes to {len(raw)} B, not {nbytes}")
    return raw


# ---- lossy: int8 rows -----------------------------------------------------------------------------


def _rows(data: memoryview, dtype: str, head_size: int):  # noqa: ANN202 (a torch tensor)
    """``data`` as rows of ``head_size`` values (a view: writes go to ``data``; a read-only
    buffer is only read, so torch's warning about it does not apply)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(data, dtype=getattr(torch, dtype))
    if t.numel() % head_size:
        raise CodecError(f"{t.numel()} values are not rows of {head_size}")
    return t.view(-1, head_size)


def _to_f32(t):  # noqa: ANN001, ANN202 (torch tensors)
    """float32 of ``t``, bf16 through an integer shift (exact; torch's own bf16 conversion is
    an order of magnitude slower on CPUs without AVX-512 bf16)."""
    import torch

    if t.dtype is torch.bfloat16:
        return (t.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    return t.float()


def _from_f32(x, dtype):  # noqa: ANN001, ANN202 (torch tensors)
    """``x`` (float32) in ``dtype``; bf16 rounded to nearest even with integer ops (as torch
    rounds it; finite values only)."""
    import torch

    if dtype is not torch.bfloat16:
        return x.to(dtype)
    bits = x.view(torch.int32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    return rounded.to(torch.int16).view(torch.bfloat16)


def _int8_encode(data: memoryview, dtype: str, head_size: int) -> bytes:
    import torch

    # A copy first: conversions read a tensor over a foreign buffer ~1000x slower (measured).
    x = _to_f32(_rows(data, dtype, head_size).clone())
    s = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp_(min=1e-8).half().float()
    q = torch.round(x / s).clamp_(-127, 127).to(torch.int8)
    return q.numpy().tobytes() + s.half().numpy().tobytes()


def _int8_decode(body: memoryview, out: memoryview, dtype: str, head_size: int) -> None:
    import torch

    n = out.nbytes // (head_size * ELEMENT_BYTES[dtype])
    if n * head_size * ELEMENT_BYTES[dtype] != out.nbytes:
        raise CodecError(f"{out.nbytes} B are not rows of {head_size} {dtype} values")
    if body.nbytes != n * head_size + 2 * n:
        raise CodecError("int8 frame of another chunk size")
    q = torch.frombuffer(bytearray(body[: n * head_size]), dtype=torch.int8).view(n, head_size)
    s = torch.frombuffer(bytearray(body[n * head_size :]), dtype=torch.float16).view(n, 1)
    x = _from_f32(q.float() * s.float(), getattr(torch, dtype))
    np.frombuffer(out, dtype=np.uint8)[:] = x.view(torch.uint8).reshape(-1).numpy()
