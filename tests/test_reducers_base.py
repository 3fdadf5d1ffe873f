"""The reducers' shared wire format (hvd_sparse/core/reducers/base.py, docs/algorithms.md#wire-format): (index, value)
pairs packed into one array of int32 or int64 words, the value bit-cast, and unpacked exactly."""

import numpy as np

from hvd_sparse.core.reducers.base import pack_pairs, unpack_pairs

from oracles import NP


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
