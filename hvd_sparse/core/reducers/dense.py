"""Dense allreduce (docs/algorithms.md#dense): the baseline every sparse scheme is compared with.

    u = sum_r g^r          (one allreduce of the whole flat buffer; Horovod/Gloo runs a ring)

No selection, no residual. Cost 2n(P-1)/P words per rank (Table 1).
"""

from __future__ import annotations

from ..comm import SUM
from .base import ALL, Reducer


class Dense(Reducer):
    name = "dense"
    sparse = False

    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        if comm.size == 1:
            return xp.copy(acc), ALL, {}
        return comm.allreduce(acc, SUM, "dense"), ALL, {}
