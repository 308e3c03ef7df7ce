"""Units and small arithmetic shared by every layer: byte sizes, ceiling division.

The one place that parses a size (``--kv-cache-memory 512MiB``, ``--kv-offload cpu:4GiB``,
``pagedkv plan --memory 8GB``): an integer or decimal with an optional unit, ``B``,
``KB``/``MB``/``GB``/``TB`` (powers of 1000) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of
1024), case-insensitive, spaces allowed around the number and unit.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints (``b > 0``)."""
    return -(a // -b)


def parse_size(text: str) -> int:
    """``"4GiB"`` → 4294967296, ``"1.5KiB"`` → 1536, ``"512"`` → 512; ValueError naming the
    text on anything else."""
    m = _SIZE.fullmatch(str(text))
    if m is None or m.group(2).lower() not in SIZE_UNITS:
        raise ValueError(
            f"invalid size {text!r}: use a number with B, KB, MB, GB, TB, KiB, MiB, "
            "GiB or TiB (e.g. 512MiB, 4GiB, 20GB) or a byte count"
        )
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it exactly (``4GiB``), else bytes."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
