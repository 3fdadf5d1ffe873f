"""The reducers' shared wire format (hvd_sparse/core/reducers/base.py, docs/algorithms.md#the-wire): (index, value)
pairs packed into one array of int32 or int64 words (int32 while every index fits), the value bit-cast, and unpacked
exactly, on numpy and torch."""

import numpy as np
import pytest

from hvd_sparse.core.reducers.base import pack_pairs, size_bucket, unpack_pairs, wire_index_dtype
from hvd_sparse.core.xp import backend_of

from oracles import NP, on_backend


def test_wire_pairs_roundtrip_exactly_including_large_indexes_and_special_values():
    idx = np.array([0, 2**24 + 1, 2**31 - 3], np.int64)
    vals = np.array([-0.0, np.float32(1e-45), np.nan], np.float32)
    for wire in (np.int32, np.int64):
        flat = pack_pairs(NP, idx, vals, wire, vals)
        assert flat.dtype == wire and flat.size == 6
        i2, v2 = unpack_pairs(NP, flat)
        assert i2.tolist() == idx.tolist() and v2.tobytes() == vals.tobytes()
    big = np.array([2**40 + 1], np.int64)
    i3, _ = unpack_pairs(NP, pack_pairs(NP, big, np.ones(1, np.float32), np.int64, vals))
    assert i3.tolist() == [2**40 + 1]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_region_relative_index_2_24_plus_1_survives(backend):
    rel = np.array([0, 2**24 + 1, 2**31 - 3], np.int64)
    assert int(np.float32(2**24 + 1)) != 2**24 + 1                             # float packing would round it
    vals = np.array([1.5, -2.25, 7.0], np.float32)
    rel_x, vals_x = on_backend(backend, rel, vals)
    xp = backend_of(vals_x)
    wire = wire_index_dtype(xp, 2**31 - 2)
    assert wire == xp.int32
    i2, v2 = unpack_pairs(xp, pack_pairs(xp, rel_x, vals_x, wire, vals_x))
    assert xp.to_numpy(i2).tolist() == rel.tolist()
    assert xp.to_numpy(v2).tolist() == vals.tolist()


@pytest.mark.parametrize("capacity", [1, 7, 8, 100, 2000, 123457])
def test_a_size_bucket_holds_the_need_with_under_an_eighth_of_padding_and_one_size_per_rung(capacity):
    """The smallest size of the ladder capacity, ⌈7/8 of it⌉, ... that holds ``need``: under 8/7 of the need (or at
    most 7), and a rung names one size for a given capacity, so ranks that agree on the need agree on the name."""
    sizes = {}
    for need in sorted({1, 2, 6, 7, 8, 9, capacity // 3, capacity // 2, capacity - 1, capacity} - {0}):
        if need > capacity:
            continue
        rung, size = size_bucket(capacity, need)
        assert need <= size <= capacity and (size * 7 < need * 8 or size <= 7), (need, rung, size)
        assert sizes.setdefault(rung, size) == size
    assert size_bucket(capacity, capacity) == (0, capacity)
    assert len(set(sizes.values())) == len(sizes)
