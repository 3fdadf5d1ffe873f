"""The torch backend (CPU or CUDA tensors; torch is imported when the first tensor arrives)."""

from __future__ import annotations

import numpy as np

from .common import _Indexing
from .fixed import MAGNITUDE_BINS, MAGNITUDE_SHIFT, TINY, RegionSums, lower_bounds
from .generic import rule_mask
from .kernels import KernelOps
from .numpy_backend import NumpyBackend


class TorchBackend(KernelOps, _Indexing):
    """torch tensors, CPU or CUDA (the PyTorch adapter's backend)."""

    name = "torch"
    mutable = True

    def __init__(self):
        import torch

        self.torch = torch
        self._dtypes_of(torch)
        self._constants = {}        # small device tensors made once: (what, ..., device) -> tensor

    def _constant(self, key, like, make):
        """The tensor ``make()`` on ``like``'s device, made and uploaded once per ``key`` and device."""
        key = (*key, like.device)
        if key not in self._constants:
            if len(self._constants) > 256:
                self._constants.clear()
            self._constants[key] = self.asarray(make(), None, like=like)
        return self._constants[key]

    def zeros(self, n, dtype, like=None):
        return self.torch.zeros(n, dtype=dtype, device=None if like is None else like.device)

    def empty(self, n, dtype, like=None):
        return self.torch.empty(n, dtype=dtype, device=None if like is None else like.device)

    def arange(self, n, dtype, like=None):
        return self.torch.arange(n, dtype=dtype, device=None if like is None else like.device)

    def full(self, n, value, dtype, like=None):
        return self.torch.full((n,), value, dtype=dtype, device=None if like is None else like.device)

    def asarray(self, values, dtype, like=None):
        """A tensor of ``values`` on ``like``'s device. Host values go to a GPU by a non-blocking copy from pinned
        memory: a plain copy would make the host wait for all the work queued on the device."""
        torch = self.torch
        if like is None or like.device.type == "cpu" or (isinstance(values, torch.Tensor) and values.is_cuda):
            return torch.as_tensor(values, dtype=dtype, device=None if like is None else like.device)
        host = torch.as_tensor(values, dtype=dtype)
        return host.pin_memory().to(like.device, non_blocking=True) if like.is_cuda else host.to(like.device)

    @staticmethod
    def astype(x, dtype):
        return x.to(dtype)

    @staticmethod
    def dtype_of(x):
        return x.dtype

    @staticmethod
    def to_numpy(x):
        return x.detach().cpu().numpy()

    @staticmethod
    def to_list(x):
        return x.tolist()

    def from_numpy(self, a):
        return self.torch.from_numpy(a)

    @staticmethod
    def host(x):
        """The numpy array sharing a CPU tensor's memory, or None (another device)."""
        return x.numpy() if x.device.type == "cpu" else None

    def stream_buffer(self, n, like):
        """An uninitialised float32 buffer of ``n`` values for ``like``'s device that is streamed through every
        step (error feedback's). On the CPU it is numpy's (a tensor sharing it): numpy asks the kernel for
        transparent huge pages on large buffers (``madvise``), torch's allocator does not, and with 4 KiB pages
        the pass is slower (measured on error feedback's add pass: docs/benchmarks.md, "What the Ok-Topk step
        costs (P = 4, 25M)", *Huge pages*)."""
        if like.device.type == "cpu":
            return self.torch.from_numpy(np.empty(n, np.float32))
        return self.torch.empty(n, dtype=self.torch.float32, device=like.device)

    @staticmethod
    def numel(x):
        return int(x.numel())

    @staticmethod
    def itemsize(x):
        return int(x.element_size())

    @staticmethod
    def copy(x):
        return x.clone()

    def concat(self, xs, like=None):
        return self.torch.cat(list(xs))

    def abs(self, x):
        return x.abs()

    @staticmethod
    def mul(x, s):
        return x * s

    def maximum(self, x, y):
        return self.torch.maximum(x, y)

    def add_into(self, a, b, out):
        """``out[:] = a + b`` (``a`` None: ``out[:] = b``), cast to ``out``'s dtype; one pass, returns ``out``."""
        if a is None:
            return out.copy_(b)
        return self.torch.add(a, b, out=out)

    def mul_into(self, x, s, out):
        """``out[:] = x * s`` (``s`` a Python scalar, computed in ``x``'s dtype, then cast to ``out``'s)."""
        if out.dtype == x.dtype:
            return self.torch.mul(x, s, out=out)
        return out.copy_(x * s)

    @staticmethod
    def fill_(x, value):
        return x.fill_(value)

    def count_true(self, masks):
        """int64 tensor of the number of True entries of each mask (on the masks' device; nothing is read)."""
        return self.torch.stack([m.sum() for m in masks])

    def all_finite(self, x):
        # as NumpyBackend.all_finite: the sum first, the elementwise pass only after an overflow
        return bool(self.torch.isfinite(x.sum())) or bool(self.torch.isfinite(x).all())

    def kth_largest(self, x, k):
        # topk's *values* are exact; only the order of tied indices is unspecified, and we do not use it.
        return self.torch.topk(x, k, sorted=False).values.min()

    def nonzero(self, mask):
        host = self.host(mask)              # numpy's is several times faster on the CPU (docs/benchmarks.md)
        if host is not None:
            return self.torch.from_numpy(NumpyBackend.nonzero(host))
        return self.torch.nonzero(mask, as_tuple=False).reshape(-1)

    def take(self, x, idx):
        """``x[idx]``; a 1-D gather by integer indexes is ``index_select`` (the same values, several times faster
        than advanced indexing on the CPU; measured: docs/benchmarks.md, "Measured choices in the code")."""
        if x.dim() == 1 and self._int_index(idx):
            return self.torch.index_select(x, 0, idx)
        return super().take(x, idx)

    def put_(self, dst, idx, value):
        """``dst[idx] = value``; on a 1-D ``dst`` with int64 indexes, ``index_fill_`` / ``index_copy_`` (the same
        writes, faster on the CPU; measured: docs/benchmarks.md, "Measured choices in the code")."""
        if dst.dim() == 1 and self._int_index(idx) and idx.dtype == self.torch.int64:
            if isinstance(value, (int, float)):
                return dst.index_fill_(0, idx, value)
            if isinstance(value, self.torch.Tensor) and value.dtype == dst.dtype and value.shape == idx.shape:
                return dst.index_copy_(0, idx, value)
        return super().put_(dst, idx, value)

    def _int_index(self, idx):
        return isinstance(idx, self.torch.Tensor) and idx.dim() == 1 and idx.dtype in (self.torch.int64,
                                                                                       self.torch.int32)

    @staticmethod
    def scatter_add_(dst, idx, values):
        return dst.index_add_(0, idx, values)

    @staticmethod
    def add_unique_(dst, idx, values):
        return dst.index_add_(0, idx, values)


    @staticmethod
    def sort(x):
        return x.sort().values

    def unique_inverse(self, x):
        if x.device.type == "cpu":          # numpy's stable sort merges the sorted runs (torch's sort does not)
            u, slot = NumpyBackend.unique_inverse(x.numpy())
            return self.torch.from_numpy(u), self.torch.from_numpy(slot)
        return x.unique(sorted=True, return_inverse=True)

    def searchsorted(self, sorted_x, values, right=False):
        return self.torch.searchsorted(sorted_x.contiguous(), values.contiguous(), side="right" if right else "left")

    @staticmethod
    def clamp_max(x, c):
        return x.clamp(max=c)

    @staticmethod
    def bitcast(x, dtype):
        """``x``'s bits as ``dtype`` (a view: of the same item size, any strides do)."""
        return x.view(dtype) if x.element_size() == dtype.itemsize else x.contiguous().view(dtype)


    def nan_to_zero(self, x):
        """A copy of ``x`` with NaN and ±Inf replaced by 0."""
        return self.torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    @staticmethod
    def mean_std(x):
        """(mean, unbiased std) of a float tensor as Python floats, computed in float64."""
        a64 = x.double()
        return float(a64.mean()), (float(a64.std(correction=1)) if x.numel() > 1 else 0.0)

    def argsort_stable(self, x):
        """Stable ascending argsort of a 1-D tensor (int64)."""
        return self.torch.sort(x, stable=True).indices

    def topk_rows(self, X, k):
        """Exact top-k of every row of the 2-D float32 ``X`` (m, c): column indices (m, k), int64, ascending
        (the rule of :meth:`NumpyBackend.topk_rows`)."""
        torch = self.torch
        m, c = X.shape
        if k >= c:
            return torch.arange(c, dtype=torch.int64, device=X.device).expand(m, c)
        mag = X.abs()
        nan = torch.isnan(mag)
        if bool(nan.any()):
            mag = torch.where(nan, torch.full_like(mag, float("inf")), mag)
        vals, cols = torch.topk(mag, k, dim=1, largest=True, sorted=False)  # values exact, tie order not
        th = vals.min(dim=1, keepdim=True).values
        above = (mag > th).sum(dim=1)
        bad = torch.nonzero((mag == th).sum(dim=1) != k - above).reshape(-1)
        if bad.numel():
            sub, tb = mag[bad], th[bad]
            tied = sub == tb
            tied = tied & (tied.cumsum(dim=1) <= (k - above[bad])[:, None])
            cols[bad] = ((sub > tb) | tied).nonzero()[:, 1].reshape(bad.numel(), k)
        return cols.sort(dim=1).values

    # --- fixed-size selections on a device (core/xp/fixed.py): no output size depends on the data, so the host
    # never waits for the device; CPU tensors take the host implementations (the C kernels), with the same bits
    def on_device(self, x):
        """Whether ``x`` has no host view (asked of an empty float32 tensor where ``x`` lives: numpy has no
        bfloat16)."""
        return self.host(x if x.dtype != self.torch.bfloat16 else x.new_empty(0, dtype=self.torch.float32)) is None

    def item(self, x):
        return x.item() if isinstance(x, self.torch.Tensor) else super().item(x)

    def norm_f64(self, pieces):
        """On a device: the L2 norm (float64) of ``pieces`` together as a 0-d device tensor, not read (the norms of
        the pieces, then theirs: ``torch.nn.utils.clip_grad_norm_``'s way); its last bit may differ from the host's."""
        if not self.on_device(pieces[0]):
            return super().norm_f64(pieces)
        vector_norm, f64 = self.torch.linalg.vector_norm, self.torch.float64
        return vector_norm(self.torch.stack([vector_norm(p, dtype=f64) for p in pieces]))

    def nonfinite(self, x):
        """On a device: the bits of ``sum(x·0)`` as an int32 word: ±0 when every entry is finite (no overflow can
        make it otherwise), a NaN's when not (:func:`hvd_sparse.core.comm.finite`)."""
        if self.host(x) is not None:
            return super().nonfinite(x)
        return (x * 0).sum().view(self.torch.int32)

    def stack(self, xs, axis=0):
        return self.torch.stack(list(xs), dim=axis)

    @staticmethod
    def transpose(x):
        return x.t()

    def count_below(self, x, bound):
        if self.host(x) is not None:
            return super().count_below(x, bound)
        return (x < bound).sum(dtype=self.torch.int32)

    def choose(self, cond, a, b):
        torch = self.torch
        if not isinstance(cond, torch.Tensor) or self.host(cond) is not None:
            return super().choose(bool(cond), a, b)

        def scalar(v):          # a Python number as a 0-d tensor of its kind (float64, int64), by a fill
            if isinstance(v, torch.Tensor):
                return v
            return torch.full((), v, dtype=torch.float64 if isinstance(v, float) else torch.int64, device=cond.device)

        return torch.where(cond, scalar(a), scalar(b))

    def first_fit(self, counts, cap, start=0):
        if self.host(counts) is not None:
            return super().first_fit(counts, cap, start)
        fit = counts[start:] <= cap
        return start + self.torch.where(fit.any(), fit.int().argmax(), self.numel(fit) - 1)

    def pick(self, values, j):
        if not isinstance(j, self.torch.Tensor) or self.host(j) is not None:
            return super().pick(values, j)
        if not isinstance(values, self.torch.Tensor):
            values = self.asarray(list(values), self.torch.float64, like=j)
        return values.index_select(0, j.reshape(1).to(values.device))[0]

    def first_unless(self, idx, fill, value):
        if self.host(idx) is not None:
            return super().first_unless(idx, fill, value)
        first = idx[:1]
        empty = first == fill
        first.masked_fill_(empty, value)
        return idx, empty

    def at_least_one(self, count):
        return count.clamp(min=1) if isinstance(count, self.torch.Tensor) else super().at_least_one(count)

    @staticmethod
    def unbind(rows):
        return rows.unbind(0)

    @staticmethod
    def columns(rows, start, length):
        return rows.narrow(1, start, length)

    def masked(self, x, mask):
        return self.torch.where(mask, x, 0)

    def smallest_magnitude(self, x):
        if self.host(x) is not None:
            return super().smallest_magnitude(x)
        mag = x.abs()
        return self.torch.where(mag > 0, mag, float("inf")).min() if x.numel() else float("inf")

    def div(self, x, y):
        return x / y

    def repeat(self, values, counts, total):
        """On a device, without ``repeat_interleave``, whose CUDA kernel gives each segment one thread: a few long
        segments (a model's tensors) are then several times slower than this (measured: docs/gpu.md, "The
        fixed-shape wire on an H100, against the chained collectives"). Instead a marker at each segment's start, a
        running sum and a gather; the markers' positions are uploaded once per layout."""
        counts = [int(c) for c in counts]
        if self.host(values) is not None or len(counts) < 2:
            return self.torch.repeat_interleave(values, self.asarray(counts, self.torch.int64, like=values),
                                                output_size=total)
        starts = np.cumsum(counts[:-1])                     # segment j + 1 starts there (j = 0 starts at 0)
        at, steps = np.unique(starts[starts < total], return_counts=True)   # empty segments: several at once
        key = ("repeat", total, tuple(counts))
        pos = self._constant((*key, "at"), values, lambda: at.astype(np.int64))
        inc = self._constant((*key, "steps"), values, lambda: steps.astype(np.int32))
        mark = self.torch.zeros(total, dtype=self.torch.int32, device=values.device)
        mark.index_put_((pos,), inc)
        return values[mark.cumsum(0, dtype=self.torch.int32)]

    def segment_counts(self, bounds):
        if self.host(bounds) is not None:
            return super().segment_counts(bounds)
        return bounds[1:] - bounds[:-1]

    def compact(self, mask, size, fill):
        if self.host(mask) is not None:
            return super().compact(mask, size, fill)
        return self.torch.nonzero_static(mask, size=size, fill_value=fill).reshape(-1)

    def largest_in_runs(self, x, lengths, caps, fill):
        """On a device: two stable sorts (by descending magnitude, then by run) put every run's entries largest
        first, ties by the lower position; each keeps its first ``caps[j]``; a padded compaction (no read)."""
        if self.host(x) is not None:
            return super().largest_in_runs(x, lengths, caps, fill)
        torch, m = self.torch, self.numel(x)
        run = self.asarray(np.repeat(np.arange(len(lengths)), lengths), torch.int64, like=x)
        by_mag = torch.sort(x.abs(), descending=True, stable=True).indices
        order = by_mag[torch.sort(run[by_mag], stable=True).indices]
        starts = np.cumsum(lengths) - np.asarray(lengths)
        first = self.asarray(np.repeat(starts, lengths), torch.int64, like=x)        # each position's run start
        limit = self.asarray(np.repeat(np.asarray(caps, np.int64), lengths), torch.int64, like=x)
        rank = torch.arange(m, device=x.device) - first               # order's entries are grouped by run, in order
        keep = torch.zeros(m, dtype=torch.bool, device=x.device).index_put_((order,), rank < limit)
        return self.compact(keep, m, fill)

    def topk_padded(self, x, k):
        """The device's exact top-k: the k-th magnitude by ``torch.topk``, then every entry above it and the tied
        ones of the lowest indexes up to k, by masks and a running count (the host's rule, without a sort)."""
        n = self.numel(x)
        if self.host(x) is not None or n == 0:
            return super().topk_padded(x, k)
        torch = self.torch
        mag = x.abs()
        if k >= n:
            keep = mag > 0
            return self.compact(keep, k, n), mag.new_zeros(()), keep.sum(dtype=torch.int32)
        keep, th = self._largest(mag, k)
        return self.compact(keep, k, n), th, keep.sum(dtype=torch.int32)

    def _largest(self, mag, k):
        """``(keep, th)``: the mask of the k largest of the magnitudes ``mag`` (k < numel; zeros never, ties by the
        lower index: :func:`~hvd_sparse.core.xp.fixed.largest`) and the k-th largest (0 when fewer than k are
        nonzero), by ``torch.topk``'s k-th value, then masks and a running count of the ties (no sort, no read)."""
        torch = self.torch
        th = torch.topk(mag, k, sorted=False).values.min()        # 0 when fewer than k are nonzero
        above = mag > th
        tied = (mag == th) & (th > 0)
        running = tied.cumsum(0, dtype=torch.int32 if mag.numel() < 2**31 else torch.int64)  # half int64's bytes
        return above | (tied & (running <= k - above.sum())), th

    def clamp_min(self, x, low):
        if not isinstance(x, self.torch.Tensor):
            return super().clamp_min(x, low)
        return x.clamp(min=low)

    def read(self, *values):
        torch = self.torch
        dev = [v for v in values if isinstance(v, torch.Tensor) and self.host(v) is None]
        if not dev:
            return super().read(*values)
        flat = [v.reshape(-1).to(torch.float64) if isinstance(v, torch.Tensor) else
                torch.full((1,), float(v), dtype=torch.float64, device=dev[0].device) for v in values]
        host = torch.cat([f.to(dev[0].device) for f in flat]).cpu().numpy()
        out, off = [], 0
        for f in flat:
            out.append(host[off:off + f.numel()])
            off += f.numel()
        return out

    def mean_std_values(self, x):
        if self.host(x) is not None:
            return super().mean_std_values(x)
        if x.numel() < 2:
            return x.double().mean(), x.new_zeros((), dtype=self.torch.float64)
        sd, mu = self.torch.std_mean(x.double(), correction=1)
        return mu, sd

    def ladder(self, th, factors, like):
        if not isinstance(th, self.torch.Tensor):
            return super().ladder(th, factors, like)
        factors = tuple(float(f) for f in factors)       # uploaded once per ladder and device
        return th.to(self.torch.float64) * self._constant(("ladder", factors), like,
                                                          lambda: np.asarray(factors, np.float64))

    def _bounds(self, ths, rule, like):
        """The float32 bounds (:func:`~hvd_sparse.core.xp.fixed.lower_bounds`) of the thresholds ``ths``: a host
        list (bounds made on the host, one upload) or a float64 tensor (made on the device)."""
        torch = self.torch
        if not isinstance(ths, torch.Tensor):
            return self.asarray(lower_bounds(ths, rule), torch.float32, like=like)
        t = ths.to(torch.float32)
        if rule in ("gt", "above"):
            up = torch.nextafter(t, torch.full_like(t, float("inf")))
            return up if rule == "gt" else torch.where(t.double() > ths, t, up)
        if rule == "ge_nonzero":
            return torch.where(t > 0, t, TINY)
        if rule != "ge":
            raise ValueError(f"hvd_sparse: rule must be one of ('ge_nonzero', 'gt', 'ge'), got {rule!r}")
        return t

    def _passing(self, mag, bounds):
        """``passing[j]``: how many of ``mag`` reach bound j (non-decreasing bounds), from one sorted search and one
        histogram of the rungs reached. Rung 0 (below every bound: nearly every entry of a gradient) is left out of
        the histogram: a GPU adds its counts by atomic operations, which queue on one address when nearly every key
        is the same, which makes ``torch.bincount`` slow there (measured: docs/gpu.md, "The fixed-shape wire on an
        H100, against the chained collectives"). ``torch.histc`` over the fixed range of rungs 1 .. J skips the
        rest, and, unlike ``bincount``, reads nothing on the host (bincount sizes its output by the largest key: two
        reads on a device). CUDA's histc counts int32 keys, exactly and deterministically; elsewhere histc takes
        floats only (float64: exact). The counts at or above each rung are then a reversed running sum."""
        torch = self.torch
        J = self.numel(bounds)
        if J == 0:
            return torch.zeros(0, dtype=torch.int32, device=mag.device)
        rungs = torch.searchsorted(bounds, mag, right=True, out_int32=True)
        hist = torch.histc(self._histc_keys(rungs), J, 1, J + 1)
        return hist.flip(0).cumsum(0, dtype=torch.int32).flip(0)

    @staticmethod
    def _histc_keys(rungs):
        """int32 rungs as ``torch.histc`` takes them on their device: as they are on CUDA, float64 elsewhere."""
        return rungs if rungs.is_cuda else rungs.double()

    def ladder_counts(self, x, ths, rule):
        if self.host(x) is not None:
            return super().ladder_counts(x, ths, rule)
        return self._passing(x.abs(), self._bounds(ths, rule, x))

    def magnitude_counts(self, x):
        """The host's bins on the device: the keys from the bits, counted by ``torch.histc`` over the fixed range of
        bins (no read; :meth:`_passing` says why not ``bincount``)."""
        if self.host(x) is not None:
            return super().magnitude_counts(x)
        keys = (x.contiguous().view(self.torch.int32) & 0x7FFFFFFF) >> MAGNITUDE_SHIFT
        return self.torch.histc(self._histc_keys(keys), MAGNITUDE_BINS, 0, MAGNITUDE_BINS).to(self.torch.int64)

    def select_capped(self, x, ths, rule, cap, fill, *, base=0, guard=None, counts=0, tally=True, start=0):
        """The host's rule on the device: the counts at every rung in one sorted search (:meth:`_passing`); the
        rungs that still pass more than a limit are a prefix (the counts fall as the threshold rises), so their
        number is the first rung within it; one compare and a padded compaction. Whether the rung taken still
        passes more than ``cap`` is known only on the device, so the ``cap`` largest of what it passes
        (:meth:`_largest`: a ``torch.topk`` and a running count of ties) are computed on every call where ``cap``
        is less than the input, and taken where it does: about twenty operations more, and no read."""
        if self.host(x) is not None:
            return super().select_capped(x, ths, rule, cap, fill, base=base, guard=guard, counts=counts, tally=tally,
                                         start=start)
        mag = x.abs()
        bounds = self._bounds(ths, rule, x)
        J = self.numel(bounds)
        if J == 1:
            mask = mag >= bounds[0]
            j = 0
            count = passed = mask.sum()
        else:
            passing = self._passing(mag, bounds)
            j = (passing > cap).sum()
            if guard is not None:                   # the guard's rung, when the first passes more than its trigger
                trigger, limit, most = guard
                climb = ((passing[1:most + 1] > limit).sum() + 1).clamp_(max=most)
                j = self.torch.maximum(j, climb * (passing[0] > trigger))
            j = self.torch.minimum(j, (passing > 0).sum() - 1).clamp_(min=start)     # not past the last nonempty
            mask = mag >= self.torch.take(bounds, j)
            count = passed = self.torch.take(passing, j)
        if cap < self.numel(x):                 # past the ladder's top the cap largest stay, chosen where it overflows
            keep = self._largest(self.torch.where(mask, mag, 0.0), cap)[0]
            over = passed > cap
            mask = self.torch.where(over, keep, mask)
            count = self.torch.where(over, keep.sum(), count) if tally else None
        idx = self.compact(mask, cap, fill - base)
        found = (idx + base if base else idx), (count if tally else None), j
        if counts:
            found += (passing[:counts] if J > 1 else passed.view(1),)
        return found

    def select_at(self, x, th, rule, cap, fill, count):
        if self.host(x) is not None or count > cap:
            return super().select_at(x, th, rule, cap, fill, count)
        return self.compact(x.abs() >= self._bounds([th], rule, x), cap, fill)

    def keep(self, idx, vals, th, rule, fill):
        if self.host(idx) is not None:
            return super().keep(idx, vals, th, rule, fill)
        drop = ~rule_mask(self, vals.abs(), th, rule)
        return idx.masked_fill(drop, fill), vals.masked_fill(drop, 0.0)

    def members(self, a, b, fill):
        """On a device: ``torch.isin`` (``b`` in any order and shape; sizes fixed, so no wait). ``assume_unique``
        spares it a ``unique`` of each input (a wait each): the real entries of ``a`` and of ``b`` are unique, and
        only ``fill`` repeats, whose answer does not matter (a ``fill`` entry stays ``fill`` either way)."""
        if self.host(a) is not None:
            return super().members(a, b, fill)
        return a.masked_fill(self.torch.isin(a, b, invert=True, assume_unique=True), fill)

    def region_sums(self, idx, vals, pieces, lo, hi, fill):
        """On a device, a dense buffer of the region: the sources added into it in rank order (one ``index_add_``
        each: unique indexes, so the order is fixed)."""
        if self.host(idx) is not None:
            return super().region_sums(idx, vals, pieces, lo, hi, fill)
        dense = vals.new_zeros(hi - lo + 1)                 # + a zero where the padding's positions point
        rel = idx - lo
        for (m, real), i, v in zip(pieces, rel.split([m for m, _ in pieces]), vals.split([m for m, _ in pieces])):
            if real and m:
                dense.index_add_(0, i, v)
        return RegionSums(dense[:hi - lo], None, lo, fill, dense)

    def choose_each(self, cond, a, b):
        if isinstance(a, (int, float)):
            return b.masked_fill(cond, a)
        return self.torch.where(cond, a, b)
