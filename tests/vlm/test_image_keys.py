"""``content_hash.image_keys``: rows keyed by their image tensors exactly, on the tensors' device.

Equal tensors (in different rows, as separate copies) share a key; different tensors never do, even when every
fingerprint collides (forced here), and an image's key does not depend on what else its call keys; no image tensor is
copied to the host (a tensor subclass records every host transfer: only fingerprints and digests may cross).
"""

from __future__ import annotations

import pytest
import torch

from grpo_mem.model import content_hash
from grpo_mem.model.content_hash import image_keys
from grpo_mem.patches.trl_images import chunk_images


def _rows():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 12, generator=g), torch.randn(16, 12, generator=g)
    grid, types = torch.tensor([[1, 4, 4]]), torch.tensor([0, 1, 1, 1, 1, 0])
    flipped = a.clone()
    flipped[3, 5] = -flipped[3, 5]  # one sign bit apart
    swapped = a.clone()[[1, 0, *range(2, 16)]]  # two patch rows swapped: the same multiset of values
    return [
        [types, a, grid],
        [types.clone(), b, grid.clone()],
        [types.clone(), a.clone(), grid.clone()],  # row 0 again, other storage
        [],  # a text-only row
        [types.clone(), flipped, grid.clone()],
        [types.clone(), swapped, grid.clone()],
        [types.clone(), a.clone().view(8, 24), grid.clone()],  # row 0's bytes in another shape
        [types.clone(), a.clone().to(torch.float64), grid.clone()],
        [types.clone(), b.clone(), grid.clone()],  # row 1 again
    ]


EXPECTED = [0, 1, 0, None, 2, 3, 4, 5, 1]
"""Rows of equal content share a number; None: the empty key."""


def _check(keys):
    assert len(keys) == len(EXPECTED)
    for i, ei in enumerate(EXPECTED):
        assert (keys[i] == b"") == (ei is None), i
        for j, ej in enumerate(EXPECTED):
            if ei is not None and ej is not None:
                assert (keys[i] == keys[j]) == (ei == ej), (i, j)


@pytest.fixture(params=["host", "device"])
def digest_path(request, monkeypatch):
    """Both digests of ``image_keys``: blake2b on host bytes, and the on-device one (forced on CPU tensors)."""
    if request.param == "device":
        monkeypatch.setattr(content_hash, "_on_host", lambda t: False)
    return request.param


def test_equal_images_share_a_key_and_different_ones_do_not(digest_path):
    keys = image_keys(_rows())
    _check(keys)
    # A key depends on the row's tensors only: the same content keyed in another call, alone, gets the same key
    assert image_keys([_rows()[2]]) == [keys[0]] and image_keys([_rows()[8], []]) == [keys[1], b""]
    assert image_keys([[], []]) == [b"", b""] and image_keys([]) == []


def test_forced_fingerprint_collisions_still_separate_different_images(monkeypatch, digest_path):
    monkeypatch.setattr(
        content_hash, "_fingerprint", lambda t, cache: torch.zeros((), dtype=torch.int64, device=t.device)
    )
    keys = image_keys(_rows())
    _check(keys)
    # the key of an image whose fingerprint collided with an earlier one's is still a function of its content only,
    # so a window's micro-batches, keyed one call each, agree on it
    assert image_keys([_rows()[8]]) == [keys[1]] and image_keys([_rows()[4], _rows()[0]]) == [keys[4], keys[0]]


def test_patch_rows_that_differ_in_one_element_get_other_keys(digest_path):
    a = torch.randn(64, 48)
    b = a.clone()
    b.view(-1)[-1] = torch.nextafter(b.view(-1)[-1], torch.tensor(float("inf")))  # one ulp, last element
    keys = image_keys([[a], [b], [a.clone()]])
    assert keys[0] != keys[1] and keys[0] == keys[2]


class _HostWatch(torch.Tensor):
    """A tensor that records every transfer of its data to the host (method name, elements)."""

    transfers: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name in ("cpu", "numpy", "tolist", "item", "__array__", "tobytes") or (
            name == "to" and any(str(x) == "cpu" for x in (*args[1:], *kwargs.values()))
        )
        if to_host:
            cls.transfers.append((name, args[0].numel()))
        return super().__torch_function__(func, types, args, kwargs)


def test_image_tensors_are_never_copied_to_the_host(monkeypatch):
    from vlm_fixtures import PROMPTS, vlm_batch

    ids, mask, C, extras = vlm_batch(PROMPTS, G=3, C=4)
    P = ids.shape[1] - C
    monkeypatch.setattr(content_hash, "_on_host", lambda t: False)  # as on an accelerator
    watched = dict(extras, pixel_values=extras["pixel_values"].as_subclass(_HostWatch))  # what is derived from it too
    rows = ids.shape[0]
    vision = chunk_images(watched, 0, rows, rows)
    _HostWatch.transfers.clear()
    keys = vision.row_keys(P)
    # What crosses of the images: their fingerprints and, per distinct content, a 128-bit digest; never an image
    # (the smallest alone has 16 patch rows of 12 values)
    assert any(name == "tolist" for name, _ in _HostWatch.transfers)
    assert all(numel < 16 * 12 for _, numel in _HostWatch.transfers), _HostWatch.transfers
    # Rows of one prompt (G = 3 in a row) share a key; PROMPTS[3] has PROMPTS[0]'s ids and another image
    assert [keys.index(k) for k in keys] == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9]
