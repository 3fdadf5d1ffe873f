"""The reducer interface: how the ranks combine their selections into one global sparse sum.

    u, included, info = reducer.reduce(xp, acc, idx, k, comm, state, ctx)

* ``acc``: this rank's float32 accumulator (length n); ``idx``: the sparsifier's sorted int64 selection (for a
  reducer that ``opens`` the step: in the selection's fixed capacity, padded with the index n);
* ``u``: float32 length-n *sum* over ranks of the contributions that survive (the engine divides by P),
  bit-identical on every rank (invariant 1) -- or a :class:`SparseSum` (its support and values), which spares
  the engine a dense n-sized buffer: the adapters then zero the gradients and scatter the K values into them
  (Ok-Topk always; TopkA and ExDyna on the host, where the support costs no read of a device);
* ``included``: the indices of ``acc`` that reached ``u`` (error feedback zeroes exactly these,
  docs/algorithms.md#error-feedback), or :data:`ALL` when every entry did (dense);
* ``info``: a dict of what the step learned (e.g. ``"counts"``: every rank's selection size, ``"K"``:
  the global count, thresholds), handed to ``sparsifier.update`` and kept in the engine's statistics.
  A reducer whose residual is not "acc with the included entries zeroed" (SparDL's global residual
  collection) returns the new residual as ``info["residual"]``;
* ``ctx``: the :class:`hvd_sparse.core.context.StepContext` (rank, size, step, layout).

Reducers issue collectives only through ``comm``, in an order that depends on nothing but data every rank
holds identically; with ``comm.size == 1`` they issue none (docs/algorithms.md#invariants).
"""

from __future__ import annotations

from typing import NamedTuple

from ..validate import Options, options

#: ``included`` value meaning "every entry of acc reached the result" (dense reducer).
ALL = "all"


class SparseSum(NamedTuple):
    """A reducer's sum given by its support: ``u = zeros(n); u[idx] = val``.

    ``idx``: int64 global indexes, ascending and unique; ``val``: their float32 sums."""

    idx: object
    val: object


#: Largest n whose indices go on the wire as int32 (the padding slot ``n`` must fit too).
INT32_INDEX_LIMIT = 2**31 - 2


def wire_index_dtype(xp, n):
    """int32 on the wire while every index fits, int64 beyond (never float-encoded: docs/algorithms.md#the-wire)."""
    return xp.int32 if n <= INT32_INDEX_LIMIT else xp.index_dtype


#: the sizes of a collective whose useful length changes every step: its capacity, then each size 7/8 of the one
#: above (rounded up); a step sends the smallest that holds what it has (its padding under 1/8 of the message)
SIZE_STEP = (7, 8)


def size_bucket(capacity, need):
    """``(rung, size)``: the smallest size of the ladder ``capacity``, ⌈7/8 of it⌉, ... that holds ``need`` (<=
    ``capacity``) entries, and its rung (0: the capacity): below 8/7 of ``need``, or at most 7. A message whose length
    changes every step travels in one of these few sizes, each under a name of its own (``Communicator.allreduce``'s
    ``bucket``): Horovod's response cache then serves every size after its first step. Integer arithmetic: the same
    on every rank."""
    num, den = SIZE_STEP
    rung, size = 0, capacity
    while True:
        below = (num * size + den - 1) // den
        if below < need or below == size:
            return rung, size
        rung, size = rung + 1, below


# -- (index, value) pairs on the wire: an index and the float32 value's bits, in words of one integer dtype ---------
# Two layouts. Fixed-size messages, whose gathered (P, L) rows split into columns (the opening's payload, Ok-Topk's
# gather): two blocks, [idx_0 .. idx_{m-1}, bits_0 .. bits_{m-1}] (pair_blocks). Messages concatenated across
# senders of different sizes (alltoall rows, TopkDSA, gTopk): pairs side by side (pack_pairs, or (m, 2) rows).
# One collective, one dtype: Horovod fuses only tensors of one dtype, so a grouped allgather of int32 indices and
# float32 values would run as two transfers.
def pack_pairs(xp, idx, vals, wire, like):
    """One flat ``wire`` array of 2·m words: index_0, bits(value_0), index_1, bits(value_1), ...

    One collective moves indices and values together (half the collectives of sending them apart).
    ``vals`` are float32; their bits travel as int32 (sign-extended into int64 words when ``wire`` is
    int64). Indexes are cast to ``wire`` (the caller checks they fit, see :func:`wire_index_dtype`)."""
    bits = xp.bitcast(xp.astype(vals, xp.float32), xp.int32)
    if wire != xp.int32:
        bits = xp.astype(bits, wire)
    return xp.interleave(xp.astype(idx, wire), bits, like=like)


def unpack_pairs(xp, flat):
    """Inverse of :func:`pack_pairs`: (int64 indexes, float32 values). ``flat`` is not modified."""
    idx = xp.astype(flat[0::2], xp.index_dtype)
    bits = xp.copy(xp.astype(flat[1::2], xp.int32))     # own, contiguous buffer before the bit-cast
    return idx, xp.bitcast(bits, xp.float32)


def pair_blocks(xp, idx, vals, wire):
    """``[idx, bits of vals]``: the two pieces of a message of 2·m words of the ``wire`` dtype (int32 while every
    index fits, :func:`wire_index_dtype`; int64 beyond, the value bits sign-extended)."""
    bits = xp.bitcast(xp.astype(vals, xp.float32), xp.int32)
    return [xp.astype(idx, wire), bits if wire == xp.int32 else xp.astype(bits, wire)]


def values_of_bits(xp, bits):
    """The float32 values whose bits :func:`pair_blocks` sent (words of the wire dtype)."""
    return xp.bitcast(xp.astype(bits, xp.int32), xp.float32)


def unpack_pair_rows(xp, rows, at=0):
    """The inverse of :func:`pair_blocks` on the (P, L) rows of a gathered message whose pairs start at word ``at``
    and fill the rest: ``(idx, vals)``, (P, m) each (indices in the wire dtype, float32 values)."""
    m = (rows.shape[1] - at) // 2
    return xp.columns(rows, at, m), values_of_bits(xp, xp.columns(rows, at + m, m))


def allgather_count(xp, m, comm, phase, like):
    """Allgather one count per rank (int64); returns the P counts as Python ints."""
    return [int(c) for c in xp.to_numpy(comm.allgather(xp.asarray([m], xp.index_dtype, like=like), phase))]


def allgather_counts(xp, counts, comm, phase, like):
    """Allgather a vector of counts per rank; returns a P x len(counts) list of lists."""
    flat = xp.to_numpy(comm.allgather(xp.asarray(counts, xp.index_dtype, like=like), phase))
    w = len(counts)
    return [[int(c) for c in flat[r * w:(r + 1) * w]] for r in range(comm.size)]


def sum_in_rank_order(xp, n, all_idx, all_vals, counts, like):
    """u[j] = sum over sources s = 0..P-1 of their value at j (one add per source; indices are unique
    within a source except the padding slot n, which only ever receives zeros and is dropped)."""
    u = xp.zeros(n + 1, xp.float32, like=like)      # slot n takes the padding
    return xp.add_runs_(u, all_idx, all_vals, counts)[:n]


def sum_sparse_in_rank_order(xp, idx, vals, counts, like):
    """The same sums as :func:`sum_in_rank_order`, on their support only: ``(sorted unique indexes, sums)``.

    Costs O(m log m) in the m received pairs instead of O(n) in the length of the vector: the indexes are
    mapped to slots of their sorted distinct values, and the sources are added in rank order 0..P-1 into
    those slots (``0 + v_0 + v_1 + ...``: the very additions of the dense version, so the sums match it bit
    for bit). ``xp.merge_add``: on the CPU, when every source's pairs are in ascending index order (as the
    reducers send them), one pass of the merge kernel does it (the same additions); any number of sources."""
    return xp.merge_add(idx, vals, counts, like=like)


def real_runs(xp, idx_rows, val_rows, counts):
    """The real pairs of padded (P, c) rows (each row's first ``counts[r]``), concatenated in rank order: ``(int64
    indexes, float32 values)``, on the host (where the counts are). Rows without padding (an exact top-k's) are
    read whole, one pass each, without a copy of every row."""
    if len(counts) and min(counts) == xp.numel(idx_rows) // len(counts):
        return xp.reshape(xp.astype(idx_rows, xp.index_dtype), (-1,)), xp.reshape(val_rows, (-1,))
    idx = [idx_rows[r, :counts[r]] for r in range(len(counts))]
    vals = [val_rows[r, :counts[r]] for r in range(len(counts))]
    return (xp.astype(xp.concat(idx, like=idx_rows), xp.index_dtype) if idx else idx_rows[0, :0],
            xp.concat(vals, like=val_rows) if vals else val_rows[0, :0])


@options
class Reducer(Options):
    """Base class. Subclasses (decorated with :func:`~hvd_sparse.core.validate.options`, their options as fields,
    checked once when they are built) set ``name`` and implement :meth:`reduce`."""

    name = "base"
    #: False for reducers that ignore the selection and keep no residual (dense).
    sparse = True
    #: True for reducers that always return a :class:`SparseSum` (Ok-Topk), ``"host"`` for those that return one
    #: where the accumulator is on the host (TopkA, ExDyna): the engine may then zero the output buffers while it
    #: reads the gradient, and only scatter the result into them.
    sparse_result = False
    #: False for reducers that choose their own entries from ``acc`` and use only the budget k (SparDL):
    #: the engine then skips the sparsifier's selection and passes ``idx=None``.
    uses_selection = True
    #: True for reducers whose first collective is the step's opening (``ctx.open``: the agreement's header rides
    #: in front of their first message, ``core/comm.py``); they receive the selection in its fixed size, padded
    #: with index n (values read from ``ctx.padded``). False: the engine opens the step with the header alone, and
    #: the reducer receives the selection's real entries only.
    opens = False

    def initial_state(self):
        return {}

    def reduce(self, xp, acc, idx, k, comm, state, ctx):  # pragma: no cover - interface
        raise NotImplementedError
