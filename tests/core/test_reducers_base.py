"""The reducers' shared wire format (hvd_sparse/core/reducers/base.py, docs/algorithms.md#the-wire): (index, value)
pairs packed into one array of int32 or int64 words (int32 while every index fits), the value bit-cast, and unpacked
exactly, on numpy and torch."""

import numpy as np
import pytest

from hvd_sparse.core.reducers.base import pack_pairs, unpack_pairs, wire_index_dtype
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
