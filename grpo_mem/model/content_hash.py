"""Content keys of tensors: rows whose tensors are equal (shapes, dtypes, bytes) get equal keys, on the tensors' device.

``image_keys`` keys the rows of one micro-batch by their image tensors (patch rows, grids, token types): exact within
one call (rows are bucketed by a cheap on-device fingerprint and compared bytewise), and a function of the content
only across calls (a 128-bit digest per distinct content). No tensor is copied to the host. This module knows torch
only.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["image_keys"]


_GOLDEN = 0x9E3779B9 - (1 << 32)  # 2**32 / golden ratio (Knuth's multiplicative hashing) as a signed int32


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat integer tensor on its device, no copy for a contiguous ``t`` (int32 words for
    elements of 4 bytes or more, int16 or uint8 otherwise): equal words exactly when the bytes are equal."""
    flat = t.detach().contiguous().view(-1)
    size = flat.element_size()
    return flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)


def _weights(n: int, device: torch.device, cache: dict) -> torch.Tensor:
    """(n,) odd int32 position weights on ``device`` (z xor z >> 16 | 1, z = i·φ mod 2**32, i = 1 … n), computed
    once per call of ``image_keys`` (``cache``) for its longest tensor."""
    have = cache.get(device)
    if have is None or have.numel() < n:
        z = torch.arange(1, n + 1, dtype=torch.int32, device=device) * _GOLDEN
        cache[device] = have = (z ^ (z >> 16)) | 1
    return have[:n]


def _fingerprint(t: torch.Tensor, cache: dict) -> torch.Tensor:
    """0-d int64 on ``t``'s device: Σ_i word_i · w_i, products wrapping in int32 (``_weights``). Equal tensors give
    equal values; different ones may collide (``image_keys`` then tells them apart exactly)."""
    words = _words(t)
    words = words if words.dtype == torch.int32 else words.to(torch.int32)
    return (words * _weights(words.numel(), words.device, cache)).sum(dtype=torch.int64)


# (multiplier of the word, multiplier of its index, finalizer) per 64-bit lane of ``_digest``, as signed int64
_LANES = tuple(
    tuple(c - (1 << 64) if c >> 63 else c for c in lane)
    for lane in (
        (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB),
        (0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB),
    )
)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are in host memory (hashed in place by ``_digest``)."""
    return t.device.type == "cpu"


def _digest(row: list[torch.Tensor]) -> tuple:
    """A 128-bit digest per tensor of ``row``: equal tensors give equal digests; different ones collide with a chance
    of about 2**-128 per pair (what keeps the keys of one image equal across calls of ``image_keys``, whose own
    comparisons are exact). A CPU tensor's bytes go through blake2b in place; any other tensor is digested on its
    device, two 64-bit sums (wrapping) of each word and its index mixed by a multiply-xorshift finalizer, one lane per
    constant set (``_LANES``), and only the sums cross to the host."""
    if all(_on_host(t) for t in row):
        return tuple(hashlib.blake2b(_words(t).numpy().tobytes(), digest_size=16).digest() for t in row)
    out = []
    for t in row:
        words = _words(t).to(torch.int64)
        index = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
        for word_mul, index_mul, final in _LANES:
            x = words * word_mul + index * index_mul
            x = (x ^ _shr(x, 31)) * final
            out.append((x ^ _shr(x, 29)).sum())
    return tuple(torch.stack(out).tolist())


def image_keys(parts: list[list[torch.Tensor]]) -> list[bytes]:
    """Per row b, a key of its image tensors ``parts[b]`` (patch rows, grids, token types, in a fixed order): rows
    whose tensors are equal (shapes, dtypes and bytes) get equal keys, rows with other tensors other keys; a row
    without tensors gets ``b""``.

    Within one call the keys are exact: rows are bucketed by a cheap on-device fingerprint of each tensor
    (``_fingerprint``; shapes and dtypes too) and compared bytewise on device (``torch.equal``) with the first row of
    each distinct content in their bucket, so no collision merges two images. Across calls (a window's micro-batches
    are keyed one at a time) a key is a function of the content only: the first row of each distinct content is
    digested on device (``_digest``, 128 bits), and the key holds that digest (and, should two distinct contents of
    one call share it, the later one's rank). Host traffic: the fingerprints (one int64 per tensor), one boolean per
    comparison and one digest per distinct content; no tensor is copied to the host.
    """
    tensors = [t for row in parts for t in row]
    if not tensors:
        return [b""] * len(parts)
    device, cache = tensors[0].device, {}
    values = iter(torch.stack([_fingerprint(t, cache).to(device) for t in tensors]).tolist())
    buckets: dict[tuple, list[tuple[int, tuple, bytes]]] = {}  # fingerprints -> (first row, digest, key) per content
    keys = []
    for b, row in enumerate(parts):
        if not row:
            keys.append(b"")
            continue
        head = tuple((tuple(t.shape), str(t.dtype), next(values)) for t in row)
        seen = buckets.setdefault(head, [])
        key = next(
            (k for r, _, k in seen if all(torch.equal(_words(x), _words(y)) for x, y in zip(parts[r], row))), None
        )
        if key is None:
            shape = tuple((tuple(t.shape), str(t.dtype)) for t in row)
            digest = _digest(row)
            same = sum(1 for _, d, _ in seen if d == digest)
            key = hashlib.blake2b(repr((shape, digest, same)).encode(), digest_size=16).digest()
            seen.append((b, digest, key))
        keys.append(key)
    return keys
