"""Java `String.hashCode` and the IndexFile key hash.

Java hashes UTF-16 code units, so a character outside the BMP counts as its two surrogates; hashing
code points or UTF-8 bytes gives different values. `hash_many` computes the same function over a whole
array of strings with numpy: with P[j] = sum(c[i] * 31**-i for i < j) (31 is odd, hence invertible
modulo 2**32) the hash of units [a, b) is 31**(b-1) * (P[b] - P[a]), all in wrapping uint32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INT32_MIN = -0x8000_0000
_MASK32 = 0xFFFF_FFFF
_INV31 = pow(31, -1, 1 << 32)


def java_string_hash(s: str) -> int:
    """`s.hashCode()` as Java computes it, a signed int32."""
    data = s.encode("utf-16-be", "surrogatepass")
    h = 0
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & _MASK32
    return h - 0x1_0000_0000 if h & 0x8000_0000 else h


def index_key_hash(key: str) -> int:
    """`IndexFile.indexKeyHashMethod`: abs of the hash, with Integer.MIN_VALUE mapped to 0."""
    h = java_string_hash(key)
    return 0 if h == INT32_MIN else abs(h)


def _utf16_units(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    joined = "".join(strings)
    if joined.isascii():
        lengths = np.fromiter(map(len, strings), dtype=np.int64, count=len(strings))
        units = np.frombuffer(joined.encode("ascii"), dtype=np.uint8).astype(np.uint32)
    else:
        encoded = [s.encode("utf-16-be", "surrogatepass") for s in strings]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) // 2
        units = np.frombuffer(b"".join(encoded), dtype=">u2").astype(np.uint32)
    return units, lengths


def hash_many(strings: Sequence[str]) -> np.ndarray:
    """`java_string_hash` of every string, as an int32 array, without a per-character Python loop."""
    n = len(strings)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    units, lengths = _utf16_units(strings)
    total = len(units)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    with np.errstate(over="ignore"):
        inv_pow = np.empty(total + 1, dtype=np.uint32)
        inv_pow[0] = 1
        inv_pow[1:] = _INV31
        inv_pow = np.cumprod(inv_pow, dtype=np.uint32)
        pow31 = np.empty(total + 1, dtype=np.uint32)
        pow31[0] = 1
        pow31[1:] = 31
        pow31 = np.cumprod(pow31, dtype=np.uint32)
        prefix = np.zeros(total + 1, dtype=np.uint32)
        np.cumsum(units * inv_pow[:total], dtype=np.uint32, out=prefix[1:])
        last = np.maximum(ends - 1, 0)
        h = pow31[last] * (prefix[ends] - prefix[starts])
    h[lengths == 0] = 0
    return h.view(np.int32)


def index_key_hash_many(strings: Sequence[str]) -> np.ndarray:
    """`index_key_hash` of every string, as an int32 array."""
    h = hash_many(strings)
    out = np.abs(h)
    out[out < 0] = 0
    return out
