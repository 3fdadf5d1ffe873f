"""Dense inside a host, sparse across hosts: the two-level step (docs/algorithms.md#two-levels).

A job of P = N·L ranks, L on each of N hosts: a host's ranks share fast links (NVLink, PCIe, a CPU host's shared
memory), the hosts slow ones. A flat step sends every rank's selection across the slow links. The two-level step
sends one selection per host and shard, and runs the preset's own algorithm unchanged on the shard:

    1. inside the host (:meth:`TwoLevelEngine._scatter`): every rank sends shard i of its flat gradient, the entries
       [i·m, (i+1)·m) with m = ceil(n / L), to local rank i, behind the agreement's header (its non-finite flag, the
       step, a fingerprint of the unit: ``core/comm.py``), in one alltoall; local rank j adds the L pieces it
       received in local-rank order: s_j, shard j of the host's sum. Every rank reads the L headers in one transfer:
       a difference raises on every rank of the host, and a NaN or Inf on any of them flags the host;
    2. across the hosts: an :class:`~hvd_sparse.core.engine.Engine` of the preset runs its step on s_j among the N
       ranks of local rank j, one per host (their communicator: ``cross``): error feedback (the residual and the
       accumulator of shard j, m entries, live on local rank j only), selection, exchange, controllers, agreement;
       its result u_j is shard j of the sum over every rank. A flagged host makes the step non-finite on every rank
       (the engine's ``flagged``), where the preset's policy skips it or raises;
    3. inside the host: one allgather of u_0 .. u_{L-1}: every rank holds the same bits, scaled by 1/P for an
       average.

The density keeps its meaning: local rank j selects d·m of its shard, a host's ranks d·n together. L = 1 is the
flat step (callers build the :class:`Engine` itself); N = 1 is a dense allreduce inside the host (step 2 is the
one host's sum); ``last["seconds"]`` has each part's wall time (``scatter``, ``across``, ``gather``; on a device the
time to queue it) and, of ``across``, the time inside the collectives between the hosts (``across_collectives``:
the wire and the wait; the rest is the shard's selection and error feedback). The sums of step 1 are added by the
receiving rank in local-rank order, so a simulator and a Horovod job give the same bits; the volume meter counts
what crosses inside the host (``local``) apart from what crosses between the hosts (``cross``): ``Engine.last``
reports both.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import NamedTuple

from .comm import AGREE_WORDS, Agreement, agreement_words, agreed, explain, finite, header
from .context import StepStats
from .engine import Engine, fresh_start, gather_over
from .errors import NonFiniteGradientError, RankDisagreementError, disagreement_message
from .recipe import clip_local
from .reducers.base import values_of_bits
from .state import ErrorFeedback
from .xp import backend_of

#: the words of the step's traffic (``VolumeMeter.totals``)
TRAFFIC = ("sent_words", "recv_words", "sent_bytes", "recv_bytes", "collectives")


class Topology(NamedTuple):
    """A rank's place in a two-level job: the communicators of its host's L ranks (``local``) and of the N ranks
    of its local rank, one per host (``cross``)."""

    local: object
    cross: object


def shard_of(n, L, j):
    """``(lo, hi)``: the entries of shard j when n entries are cut into L shards of m = ceil(n / L) (the last ones
    shorter, or empty)."""
    m = -(-n // L) if n else 0
    return min(j * m, n), min((j + 1) * m, n)


def clipped(layout, lo, hi):
    """The numels of the tensors of ``layout`` (numels in flat order) inside [lo, hi), in order: a shard's layout
    (a tensor cut by the shard's bounds counts as the part of it inside)."""
    out, start = [], 0
    for size in layout:
        part = min(hi, start + size) - max(lo, start)
        if part > 0:
            out.append(part)
        start += size
    return out or [hi - lo]


class TwoLevelEngine:
    """One unit's two-level step on one rank (module docstring): :class:`Engine`'s interface (``step``,
    ``declare``, ``last``, ``layout``) over a :class:`Topology`, with an :class:`Engine` of the preset across the
    hosts for its shard (``inner``; None on a single host, where the step is dense).

    Args:
        compression (SparseCompression): the preset; across the hosts it runs for N ranks (a byte budget's density
            is the one for N).
        topology (Topology): this rank's local and cross communicators (L > 1).
        name (str): the unit's name, in messages and state.
    """

    def __init__(self, compression, topology, name="model", comm=None):
        local, cross = topology
        if local.size < 2:
            raise ValueError("TwoLevelEngine: a host of one rank is the flat step; build an Engine instead")
        if getattr(compression, "dense_share", 0.0):
            raise ValueError(f"hvd_sparse unit '{name}': dense_share does not apply to the two-level step (a host "
                             "shard cuts the tensors it would choose among): set dense_share=0, or hierarchical=False "
                             "(or leave HOROVOD_HIERARCHICAL_ALLREDUCE unset)")
        self.compression = compression
        self.topology = topology
        self.name = name
        self.comm = comm            # the whole job's communicator (rank and size), when the caller has one
        # the preset's local clipping acts on each rank's whole gradient, before the host's sum (step)
        self.inner = Engine(compression.for_size(cross.size), cross, name, clip=False) if cross.size > 1 else None
        self.last = StepStats()
        self.shard = (0, 0)
        self.entries = None
        self.notes = ()
        self.steps = 0
        self.skipped_steps = 0
        self._layout = None
        self._agreement = Agreement()

    # -- what the simulator and the adapters read -----------------------------------------------------------------
    @property
    def dense(self):
        """Whether every step is dense across the hosts (:attr:`Engine.dense` of the shard's engine)."""
        return self.inner is not None and self.inner.dense

    @dense.setter
    def dense(self, value):
        if self.inner is not None:
            self.inner.dense = value

    @property
    def share(self):
        """The factor on the density across the hosts (:meth:`Engine.set_share` of the shard's engine)."""
        return self.inner.share if self.inner is not None else 1.0

    def set_share(self, share):
        if self.inner is not None:
            self.inner.set_share(share)

    @property
    def tally(self):
        """Whether the shard's step counts its accumulator's magnitudes (``last["tally"]``: the shard's)."""
        return self.inner is not None and self.inner.tally

    @tally.setter
    def tally(self, value):
        if self.inner is not None:
            self.inner.tally = value

    @property
    def memory(self):
        """The error feedback of this rank's shard (the inner engine's; empty on a single host)."""
        return self.inner.memory if self.inner is not None else ErrorFeedback()

    @property
    def sparsifier_state(self):
        return self.inner.sparsifier_state if self.inner is not None else {}

    @property
    def reducer_state(self):
        return self.inner.reducer_state if self.inner is not None else {}

    @property
    def layout(self):
        return self._layout

    @layout.setter
    def layout(self, layout):
        self._layout = None if layout is None else [int(x) for x in layout]

    def declare(self, entries, notes=(), fixed=False):
        """:meth:`Engine.declare` of the whole flat gradient: the shard's part goes to the inner engine (each tensor
        cut by the shard's bounds, ``name[a:b]``), with the topology among the notes every rank agrees on."""
        self.entries = tuple((str(a), tuple(int(d) for d in s), str(t)) for a, s, t in entries)
        self.notes = tuple(notes)
        self._layout = [math.prod(s) for _, s, _ in self.entries]
        if self.inner is not None:
            lo, hi = shard_of(sum(self._layout), self.topology.local.size, self.topology.local.rank)
            self.inner.declare(self._shard_entries(lo, hi), self.notes + self._where(), fixed)

    def _shard_entries(self, lo, hi):
        out, start = [], 0
        for name, shape, dtype in self.entries:
            size = math.prod(shape)
            a, b = max(lo, start), min(hi, start + size)
            if b > a:
                out.append((f"{name}[{a - start}:{b - start}]", (b - a,), dtype))
            start += size
        return tuple(out)

    def _where(self):
        local, cross = self.topology
        return (("hosts", cross.size), ("ranks_per_host", local.size))

    def gather(self, obj, like):
        """:meth:`Engine.gather` over the whole job (``comm``): every rank's ``obj``, in rank order."""
        if self.comm is None:
            raise ValueError(f"hvd_sparse unit '{self.name}': a gather needs the job's communicator (comm=)")
        return gather_over(self.comm, self._agreement, self.name, self.compression, self.entries, self.steps, obj,
                           like)

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def where(self):
        """The topology a state is saved under: hosts, ranks per host and this rank's local rank."""
        local, cross = self.topology
        return {"hosts": cross.size, "ranks_per_host": local.size, "local_rank": local.rank}

    def residual_norm(self):
        """L2 norm of this rank's residual (its shard's)."""
        return self.inner.residual_norm() if self.inner is not None else 0.0

    def state_dict(self):
        """:meth:`Engine.state_dict` of the shard, with the topology it was saved under (``"topology"``)."""
        base = self.inner.state_dict() if self.inner is not None else {
            "unit": self.name, "numel": None, "entries": None, "steps": self.steps, "residual": None,
            "sparsifier": {}, "reducer": {}}
        return dict(base, steps=self.steps, topology=self.where())

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`. A state saved under another topology (another shard, or a flat step's,
        which holds the whole residual) starts the error feedback afresh, as every rank of the job then does alike
        (:func:`fresh_start`)."""
        if state.get("topology") != self.where():
            fresh_start(self.name, state.get("topology"), self.where())
            return
        if self.inner is not None:
            self.inner.load_state_dict({k: v for k, v in state.items() if k != "topology"})
        self.steps = state["steps"]

    # -- one step ----------------------------------------------------------------------------------------------------
    def step(self, grad, average=True, prescale=1.0, postscale=1.0, nonfinite="skip", out=None):
        """The two-level step (module docstring) on the flat gradient ``grad`` (or its pieces), with
        :meth:`Engine.step`'s arguments and result: the same bits on every rank of the job."""
        pieces = list(grad) if isinstance(grad, (list, tuple)) else [grad]
        xp = backend_of(pieces[0])
        local, cross = self.topology
        local.meter.reset()
        flat = xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32)
        if self.compression.local_clip_norm is not None:       # this rank's gradient, over all P = N·L ranks
            flat = clip_local(xp, [flat], self.compression.local_clip_norm, local.size * cross.size)[0]
        n = xp.numel(flat)
        self.shard = shard_of(n, local.size, local.rank)
        options = (("average", bool(average)), ("prescale", float(prescale)), ("postscale", float(postscale)),
                   ("nonfinite", nonfinite)) + self.notes + self._where()
        start = time.perf_counter()
        shard, flagged = self._scatter(xp, flat, n, options)
        scattered = time.perf_counter()
        if self.inner is None:
            u = self._one_host(xp, shard, flagged, nonfinite)
        else:
            if self.inner.entries is None:
                self.inner.layout = clipped(self._layout or [n], *self.shard)
            u = self.inner.step(shard, average=False, nonfinite=nonfinite, flagged=bool(flagged))
        across = time.perf_counter()
        full = local.allgather(u, "gather")
        self.last = self._stats(n, flagged)
        inner = self.inner.last["seconds"]["collectives"] if self.inner is not None else 0.0
        self.last["seconds"] = {"scatter": scattered - start, "across": across - scattered,
                                "across_collectives": inner, "gather": time.perf_counter() - across}
        if self.last.get("skipped"):
            self.skipped_steps += 1
        else:
            self.steps += 1
        scale = float(prescale) * float(postscale) / (local.size * cross.size if average else 1)
        return Engine._emit(xp, full, scale, pieces, out)

    def _scatter(self, xp, flat, n, options):
        """Step 1: ``(s_j, flagged)``: shard j of the host's sum (local-rank order) and the local ranks whose gradient
        holds a NaN or Inf (their header says so). One alltoall of ``[header | shard i's value bits]`` to each local
        rank i; the headers read in one transfer; a difference of size, step or fingerprint raises on every rank of
        the host (:class:`RankDisagreementError`)."""
        local = self.topology.local
        L = local.size
        entries = self.entries or ((self.name, (n,), "float32"),)
        desc, fp = self._agreement.describe(self.name, self.compression, entries, options)
        head = header(xp, flat, xp.nonfinite(flat), 0, 0, agreement_words(False, self.steps, fp), xp.int32)
        bits = xp.bitcast(flat, xp.int32)
        parts, splits = [], []
        for i in range(L):
            lo, hi = shard_of(n, L, i)
            parts += head + [bits[lo:hi]]
            splits.append(AGREE_WORDS + hi - lo)
        recv, got = local.alltoall(xp.concat(parts, like=flat), splits, "scatter",
                                   parts=lambda w: (("scatter.head", AGREE_WORDS), ("scatter.values", w - AGREE_WORDS)))
        m = self.shard[1] - self.shard[0]
        table = None
        if all(g == AGREE_WORDS + m for g in got):
            rows = xp.reshape(recv, (L, AGREE_WORDS + m))
            table = xp.to_list(xp.columns(rows, 0, AGREE_WORDS))
        if table is None or not agreed(table):
            per_rank = explain(xp, local, dict(desc, step=self.steps, ranks_per_host=L), flat)
            raise RankDisagreementError(disagreement_message(per_rank) + " (ranks of one host: local ranks)")
        values = xp.columns(rows, AGREE_WORDS, m)
        shard = values_of_bits(xp, values[0])
        for i in range(1, L):                                   # local-rank order: the same bits on every job
            shard = xp.add(shard, values_of_bits(xp, values[i]))
        return shard, [i for i, row in enumerate(table) if not finite(row[0])]

    def _one_host(self, xp, shard, flagged, nonfinite):
        """Step 2 on a single host (N = 1): the host's sum itself, or, where a rank is flagged, the policy's answer:
        :class:`NonFiniteGradientError` (``"raise"``) or an all-NaN shard (the step skipped)."""
        if not flagged:
            return shard
        where = f"local rank{'s' if len(flagged) > 1 else ''} {', '.join(map(str, flagged))}"
        if nonfinite == "raise":
            raise NonFiniteGradientError(f"hvd_sparse unit '{self.name}': non-finite gradient (NaN or Inf) on {where} "
                                         f"at step {self.steps}; raised on every rank (nonfinite='raise')")
        warnings.warn(f"hvd_sparse unit '{self.name}': non-finite gradient on {where} at step {self.steps}: this step "
                      "is skipped on every rank (nonfinite='skip')", RuntimeWarning, stacklevel=3)
        return xp.full(xp.numel(shard), float("nan"), xp.float32, like=shard)

    def _stats(self, n, flagged):
        """:attr:`last`: the inner engine's statistics of the shard (or a dense step's), its traffic as ``across``,
        the host's as ``inside``, and their sums as the step's traffic."""
        inside = self.topology.local.meter.totals()
        if self.inner is not None:
            base = dict(self.inner.last)
        else:
            base = dict(n=n, k=n, selected=n, density=1.0, info={}, skipped=bool(flagged),
                        nonfinite_ranks=list(flagged), **{key: 0 for key in TRAFFIC}, control_bytes=0,
                        control_collectives=0)
        across = {key: base.get(key, 0) for key in TRAFFIC}
        base.update({key: across[key] + inside[key] for key in TRAFFIC}, across=across, inside=inside,
                    across_sent_bytes=across["sent_bytes"], across_recv_bytes=across["recv_bytes"])
        return StepStats(base)
