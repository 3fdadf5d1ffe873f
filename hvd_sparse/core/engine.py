"""One sparse step of one sparsification unit on one rank: where sparsifier, error feedback, reducer and
communicator meet (DESIGN.md "Layers"). Framework adapters and the simulator both drive this class.

    step(grad):
        acc = residual + grad                         # memory.py (float32)
        S   = sparsifier.select(acc, k)               # sparsifiers/<scheme>.py, k = max(1, floor(d·n))
        u, I = reducer.reduce(acc, S, comm)           # reducers/<scheme>.py: global sum, included set
        residual = acc with acc[I] = 0                # memory.py
        return u · prescale · postscale / P           # average (op=Average) or u (op=Sum), grad dtype

The dense reducer skips selection and residual. Per-step statistics (selected count, achieved density,
words and bytes sent and received) are kept in :attr:`Engine.last`.
"""

from __future__ import annotations

from .memory import ErrorFeedback
from .xp import backend_of


class StepStats(dict):
    """Statistics of the last step: ``n, k, selected, density, sent_bytes, recv_bytes, sent_words,
    recv_words, collectives``."""

    __getattr__ = dict.__getitem__


class Engine:
    """State and step of one sparsification unit ("bucket") on one rank.

    Args:
        compression (SparseCompression): the sparsifier/reducer pair and its knobs.
        comm (Communicator): this rank's view of the process set.
        bucket (str): the unit's name, used in collective names and state.
    """

    def __init__(self, compression, comm, bucket="model"):
        self.compression = compression
        self.comm = comm
        self.bucket = bucket
        self.memory = ErrorFeedback()
        self.sparsifier_state = compression.sparsifier.initial_state() if compression.sparsifier else {}
        self.reducer_state = compression.reducer.initial_state()
        self.steps = 0
        self.numel = None
        self.last = StepStats()

    # -- one step ------------------------------------------------------------------------------------
    def step(self, grad, average=True, prescale=1.0, postscale=1.0):
        """Run one step on the flat gradient ``grad`` (1-D numpy array or torch tensor).

        Returns the reduced flat gradient in ``grad``'s dtype, bit-identical on every rank.
        """
        xp = backend_of(grad)
        n = xp.numel(grad)
        if self.numel is None:
            self.numel = n
        elif n != self.numel:
            raise ValueError(f"hvd_sparse engine '{self.bucket}': the gradient has {n} entries, but this "
                             f"compression state was built for {self.numel}; one compression object "
                             "cannot serve two models (create one per model/optimizer)")
        comp = self.compression
        reducer = comp.reducer
        self.comm.meter.reset()
        grad32 = xp.astype(grad, xp.float32)
        if reducer.sparse:
            k = comp.sparsifier.k_for(n)
            acc = self.memory.compensate(xp, grad32)
            idx = comp.sparsifier.select(xp, acc, k, self.sparsifier_state)
            selected = xp.numel(idx)
            u, included = reducer.reduce(xp, acc, idx, k, self.comm, self.reducer_state)
            self.memory.update(xp, acc, included)
        else:
            k = selected = n
            u, _ = reducer.reduce(xp, grad32, None, n, self.comm, self.reducer_state)
        scale = float(prescale) * float(postscale) / (self.comm.size if average else 1)
        out = xp.mul(u, scale) if scale != 1.0 else xp.copy(u)
        self.steps += 1
        self.last = StepStats(n=n, k=k, selected=selected, density=selected / n if n else 0.0,
                              **self.comm.meter.totals())
        return xp.astype(out, xp.dtype_of(grad))

    # -- state -------------------------------------------------------------------------------------
    def residual_norm(self):
        xp = backend_of(self.memory.residual) if self.memory.residual is not None else None
        return 0.0 if xp is None else self.memory.norm(xp)

    def state_dict(self):
        """This rank's state: residual (numpy float32 or None), sparsifier/reducer state, step count."""
        r = self.memory.residual
        return {
            "bucket": self.bucket,
            "numel": self.numel,
            "steps": self.steps,
            "residual": None if r is None else backend_of(r).to_numpy(r).copy(),
            "sparsifier": dict(self.sparsifier_state),
            "reducer": dict(self.reducer_state),
        }
