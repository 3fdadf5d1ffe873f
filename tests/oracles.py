"""The simulator tests' shared oracles: test gradients, independent references of the algorithms (plain numpy,
written from docs/algorithms.md), the invariants every scheme is checked for, and the harness that runs a
compression on P virtual ranks and lays out what it recorded.

pytest puts tests/ on sys.path, so a test module imports them as ``from oracles import ...``.
"""

import math

import numpy as np
import pytest
from hypothesis import strategies as st
from scipy.special import ndtri

from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.context import StepContext
from hvd_sparse.core.oktopk.exchange import OkTopk
from hvd_sparse.core.sparsifiers.base import CLIMB
from hvd_sparse.core.oktopk.selection import ThresholdReuse
from hvd_sparse.core.xp import backend_of
from hvd_sparse.testing import RECORDS, simulate

#: the world sizes the simulator tests sweep
PS = [1, 2, 3, 4, 5, 8]
#: the numpy backend, for calling sparsifiers and reducers directly
NP = backend_of(np.zeros(1, np.float32))
#: hypothesis cases of the schemes' property tests: (P, n, density, seed, scale of int_grads)
cases = st.tuples(st.integers(1, 6), st.integers(1, 160), st.floats(0.005, 1.0), st.integers(0, 2**16),
                  st.sampled_from([3, 100, 4096]))


# == test gradients =============================================================================================
def grads(steps, P, n, seed=0, *, normal=False, scale=None, grow=False, zeros=0.0, boost=None, zero_ranks=()):
    """Float32 gradients (steps, P, n) from ``np.random.default_rng(seed)``.

    By default integer-valued: uniform integers in [-scale, scale] (scale 2^12), so every sum is exact in float32
    (|values| <= 2^20). ``normal=True``: standard normal draws, row by row (step t, rank r), times ``scale``
    (default 1; a number or n per-entry scales) and, with ``grow``, times 1 + t; ``zeros``: that fraction of each
    row set to 0 (drawn right after the row). ``boost=(d, f)``: the first n // d entries of every row times f (a
    few large entries, as real gradients have). ``zero_ranks``: ranks whose gradients are all zero."""
    rng = np.random.default_rng(seed)
    if not normal:
        hi = 2**12 if scale is None else scale
        g = rng.integers(-hi, hi + 1, size=(steps, P, n)).astype(np.float32)
    else:
        g = np.empty((steps, P, n), np.float32)
        for t in range(steps):
            for r in range(P):
                g[t, r] = rng.standard_normal(n) * (1 if scale is None else scale) * ((1 + t) if grow else 1)
                if zeros:
                    g[t, r][rng.random(n) < zeros] = 0.0
    if boost:
        g[:, :, : n // boost[0]] *= boost[1]
    for r in zero_ranks:
        g[:, r, :] = 0
    return g


def int_grads(steps, P, n, seed=0, scale=2**12, zero_ranks=()):
    """Integer-valued float32 gradients (steps, P, n): every sum is exact in float32 (|values| <= 2^20)."""
    return grads(steps, P, n, seed, scale=scale, zero_ranks=zero_ranks)


def distinct_grads(steps, P, n, seed, spread=False):
    """Integer data with distinct |values| within each (step, rank) row (a permutation of 1..n with random signs):
    no ties in any local top-k. ``spread``: rank r's row times 2r + 1 (distinct magnitudes across ranks too)."""
    rng = np.random.default_rng(seed)
    g = np.empty((steps, P, n), np.float32)
    for t in range(steps):
        for r in range(P):
            g[t, r] = rng.permutation(np.arange(1, n + 1)) * rng.choice([-1, 1], n) * (2 * r + 1 if spread else 1)
    return g


def drifting_grads(steps, P, n, seed):
    """Integer data whose scale jumps between steps (exercises guard, band relax and band tighten)."""
    g = int_grads(steps, P, n, seed=seed, scale=2**8)
    scale = np.random.default_rng(seed).choice([1, 1, 2, 4, 8, 16], size=steps).astype(np.float32)
    return g * scale[:, None, None]


# == references ===================================================================================================
def k_of(density, n):
    return max(1, int(density * n))


def ref_topk(x, k):
    """Independent reference: min(k, nnz) largest |x|, ties by lower index, as a boolean mask."""
    order = np.lexsort((np.arange(x.size), -np.abs(x)))
    chosen = [i for i in order[:k] if x[i] != 0]
    mask = np.zeros(x.size, dtype=bool)
    mask[chosen] = True
    return mask


def allgather_reference(g, select):
    """TopkA-style exchange (Gaussiank, TopkA): u = sum_r a^r[S^r], eps[S] = 0; returns (updates, residuals,
    selections) for g of shape (steps, P, n)."""
    steps, P, n = g.shape
    eps = np.zeros((P, n), np.float32)
    ups, res, sels = [], [], []
    for t in range(steps):
        u = np.zeros(n, np.float32)
        masks = []
        for r in range(P):
            a = eps[r] + g[t, r]
            m = select(a)
            u[m] += a[m]
            eps[r] = np.where(m, 0, a)
            masks.append(m)
        ups.append(u)
        res.append(eps.copy())
        sels.append(masks)
    return np.array(ups), np.array(res), sels


def topka_reference(g, density, average=False):
    """TopkA written out directly (docs/algorithms.md#topka): per rank a = eps + g, S = TopK(a), u = sum_r a[S]
    (divided by P with ``average``), eps[S] = 0; returns (updates, residuals, selections)."""
    ups, res, sels = allgather_reference(g, lambda a: ref_topk(a, k_of(density, a.size)))
    return (ups / g.shape[1] if average else ups), res, sels


def gaussian_select_ref(a, density, adjust="lstm", descend=True):
    """Gaussiank's steps 1-4 (hvd_sparse/core/sparsifiers/gaussiank.py) in float64 (comparisons exact): the loop's
    thresholds th0·f^-j (th0·f^j up: vgg), then up the ladder (the loop's and ``CLIMB``) while more than the capacity 2k
    pass, but not to none; past the last rung, cut to the 2k largest magnitudes (ties by the lower index). With
    ``descend``, where the loop ran all the way down and selects fewer than 3k/4, on down by 1.03 a rung (at most
    300) to the first that selects 3k/4. Returns (mask, th0, th, iterations)."""
    n = a.size
    k = k_of(density, n)
    a64 = a.astype(np.float64)
    mu = a64.mean()
    sd = a64.std(ddof=1) if n > 1 else 0.0
    th0 = float(mu + ndtri(1 - density / 2) * sd)
    mag = np.abs(a64)

    def cnt(f):
        return int(((mag > max(th0 * f, 0.0)) & (a != 0)).sum())

    f, iters = (1.02, 20) if adjust == "vgg" else (1.012, 50 if adjust == "lstm" else 20)
    down, up = [1.0], [1.0]
    for _ in range(iters):
        down.append(down[-1] / f)
        up.append(up[-1] * f)
    it, k34 = 0, max(1, (3 * k) // 4)          # at least one entry (k = 1), as the library does
    fac = 1.0
    if adjust in ("lstm", "bert"):
        goal = k34 if adjust == "lstm" or cnt(1.0) >= k34 else max(1, (5 * k) // 6)
        if adjust == "lstm" or th0 > 0 and cnt(1.0) < k34:
            while it < iters and th0 * down[it] > 0 and cnt(down[it]) < goal:
                it += 1
            fac = down[it]
    elif th0 > 0 and cnt(1.0) < k34:
        while it < iters and cnt(down[it]) < k34:
            it += 1
        fac = down[it]
    elif th0 > 0 and cnt(1.0) > (5 * k) // 4:
        while it < iters and cnt(up[it]) > (5 * k) // 4:
            it += 1
        fac = up[it]
    descent = [down[-1] * 1.03 ** -j for j in range(1, 301)] if descend else []
    if descent and fac == down[-1] and th0 > 0 and cnt(fac) < k34:
        fac = next((f for f in descent if cnt(f) >= k34), descent[-1])
    cap = int(2 * k)
    tried = set(down) | (set(up) if adjust == "vgg" else set()) | set(descent)      # only vgg's loop goes up
    above = sorted(x for x in tried | set(CLIMB) if x >= fac)
    fit = next((i for i, x in enumerate(above) if cnt(x) <= cap), len(above) - 1)
    if fit and cnt(above[fit]) == 0:
        fit -= 1
    th = th0 * above[fit]
    mask = (mag > max(th, 0.0)) & (a != 0)
    passing = np.flatnonzero(mask)
    mask[:] = False
    mask[sorted(passing.tolist(), key=lambda i: (-mag[i], i))[:cap]] = True     # the cap largest, ties by index
    return mask, th0, th, it


def tree_merge_ref(A, B, k):
    D = dict(A)
    for j, v in B.items():
        D[j] = np.float32(D[j] + v) if j in D else v
    best = sorted(D.items(), key=lambda t: (-abs(float(t[1])), t[0]))[:k]
    return dict(sorted(best))


def gtopk_tree_ref(lists, k):
    """The gTopk tree with the fold-in pre-round: the list rank 0 ends up with."""
    P = len(lists)
    L = [dict(x) for x in lists]
    m = 1 << (P.bit_length() - 1)
    for r in range(m, P):
        L[r - m] = tree_merge_ref(L[r - m], L[r], k)
    step = 1
    while step < m:
        for r in range(0, m, 2 * step):
            L[r] = tree_merge_ref(L[r], L[r + step], k)
        step *= 2
    return L[0]


def gtopk_reference(g, density):
    steps, P, n = g.shape
    k = k_of(density, n)
    eps = np.zeros((P, n), np.float32)
    ups, res, Gs = [], [], []
    for t in range(steps):
        acc = eps + g[t]
        masks = [ref_topk(acc[r], k) for r in range(P)]
        G = gtopk_tree_ref([{int(j): acc[r][j] for j in np.flatnonzero(masks[r])} for r in range(P)], k)
        u = np.zeros(n, np.float32)
        inG = np.zeros(n, bool)
        for j, v in G.items():
            u[j] = v
            inG[j] = True
        for r in range(P):
            eps[r] = np.where(masks[r] & inG, 0, acc[r])
        ups.append(u)
        res.append(eps.copy())
        Gs.append(G)
    return np.array(ups), np.array(res), Gs


# -- Ok-Topk, centrally (no regions) ------------------------------------------------------------------------------
def f32(x):
    return np.float32(x)


def rule_mask(a, th, rule):
    mag = np.abs(a)
    if rule == "gt":
        return mag > f32(th)
    return (mag >= f32(th)) & (a != 0)


def band(th, cnt, k, lo, hi, relax, tighten):
    return th / relax if cnt < lo * k else th * tighten if cnt > hi * k else th


def kth_abs(a, k):
    """k-th largest |a| with the library's convention (0.0 when k >= n or fewer than k nonzeros)."""
    if k >= a.size:
        return 0.0
    return float(np.sort(np.abs(a))[::-1][k - 1])


def ref_exact(a, k, rule):
    """Exact re-evaluation: ge_nonzero = deterministic top-k; gt = |a| > k-th largest |a|."""
    if rule == "ge_nonzero":
        return ref_topk(a, k), kth_abs(a, k)
    th = float(np.sort(np.abs(a))[::-1][min(k, a.size) - 1])
    return rule_mask(a, th, "gt"), th


def oktopk_reference(g, density, tp=32, sp=None, rd=None, global_tp=None):
    """The step of docs/algorithms.md#oktopk written out centrally with dense masks (no regions); the global
    threshold re-evaluated every ``global_tp`` steps (None: ``tp``, as the local one). Returns
    dict(updates (sum), residuals, S, G, L_used, gamma_used, K) for g of shape (steps, P, n)."""
    spk = dict(select_rule="ge_nonzero", guard_ratio=1.5, guard_factor=1.03, guard_iters=5, band_lo=0.75,
               band_hi=1.25, band_relax=1.012, band_tighten=1.012, max_select_ratio=None, guard_target=None)
    spk.update(sp or {})
    rdk = dict(global_band_lo=0.75, global_band_hi=1.25, global_relax=1.01, global_tighten=1.008,
               select_rule="ge_nonzero", max_select_ratio=None, global_control="band", ladder_factor=1.1,
               global_fill=False)
    rdk.update({k: v for k, v in (rd or {}).items() if k in rdk})
    rule = spk["select_rule"]
    steps, P, n = g.shape
    k = max(1, int(density * n))
    eps = np.zeros((P, n), np.float32)
    L = [None] * P
    gam = None
    out = {"updates": [], "residuals": [], "S": [], "G": [], "L_used": [], "gamma_used": [], "K": []}
    for t in range(steps):
        a = eps + g[t]
        masks, Lu = [], []
        for r in range(P):
            th = L[r]
            if t % tp == 0 or th is None or not th > 0:
                m, th = ref_exact(a[r], k, rule)
            else:                                   # the ladder L·f^j: the guard's climb, then the capacity's
                F = [1.0]
                for _ in range(max(spk["guard_iters"], 60)):
                    F.append(F[-1] * spk["guard_factor"])
                counts = [int(rule_mask(a[r], th * f, rule).sum()) for f in F]
                cap = max(1, min(n, int(1.25 * k)))
                if spk["max_select_ratio"] is not None:
                    cap = max(1, min(cap, int(spk["max_select_ratio"] * k)))
                j = next((j for j, c in enumerate(counts) if c <= cap), len(F) - 1)
                if spk["guard_ratio"] is not None and spk["guard_iters"] and counts[0] > spk["guard_ratio"] * k:
                    limit = (spk["guard_target"] or spk["guard_ratio"]) * k
                    j = max(j, next((i for i in range(1, spk["guard_iters"] + 1) if counts[i] <= limit),
                                    spk["guard_iters"]))
                j = min(j, max(0, sum(c > 0 for c in counts) - 1))         # not to an empty rung (ties)
                th = th * F[j]
                m = rule_mask(a[r], th, rule)
                if m.sum() > cap:                                           # past the top: the cap largest
                    m = ref_topk(np.where(m, a[r], 0), cap)
            masks.append(m)
            Lu.append(th)
            L[r] = band(th, int(m.sum()), k, spk["band_lo"], spk["band_hi"], spk["band_relax"],
                        spk["band_tighten"])
        rho = np.zeros(n, np.float32)
        for r in range(P):
            rho += np.where(masks[r], a[r], 0)
        if t % (global_tp or tp) == 0 or gam is None or not math.isfinite(gam):
            G = ref_topk(rho, k)
            gam = float(np.abs(rho[G]).min()) if G.any() else math.inf
            used = gam
        else:
            used = gam
            G = None
            if rdk["global_control"] == "ladder":      # smallest gam·f^j (j = -1..7) with count <= k
                ladder = [gam * rdk["ladder_factor"] ** j for j in range(-1, 8)]
                counts = [int((rule_mask(rho, th, rdk["select_rule"]) & (rho != 0)).sum()) for th in ladder]
                j = next((j for j, c in enumerate(counts) if c <= k), len(ladder) - 1)
                at = max(j, 1)                          # the owners send from gam (rung 1) up: G keeps those
                used = ladder[at]
                if at > 1 and counts[at] < k < counts[at - 1] and (rdk["global_fill"] or counts[at] == 0):
                    G = ref_topk(np.where(rule_mask(rho, ladder[at - 1], rdk["select_rule"]), rho, 0), k)  # fill
                # gam takes the rung (below gam: for the next step), one below gam where gam's own holds none
                nxt = ladder[0] if j == 1 and counts[1] == 0 else ladder[j]
            total = counts[at] if G is not None else None       # what passed at the rung, before a fill or cut
            if G is None:
                G = rule_mask(rho, used, rdk["select_rule"]) & (rho != 0)
                total = int(G.sum())
            if rdk["max_select_ratio"] is not None and total > rdk["max_select_ratio"] * k:
                G = ref_topk(np.where(G, rho, 0), k)
                gam = float(np.abs(rho[G]).min())
            elif rdk["global_control"] == "ladder":
                gam = nxt
            else:
                gam = band(gam, int(G.sum()), k, rdk["global_band_lo"], rdk["global_band_hi"],
                           rdk["global_relax"], rdk["global_tighten"])
        for r in range(P):
            eps[r] = np.where(masks[r] & G, 0, a[r])
        out["updates"].append(np.where(G, rho, 0).astype(np.float32))
        out["residuals"].append(eps.copy())
        out["S"].append(masks)
        out["G"].append(G)
        out["L_used"].append(Lu)
        out["gamma_used"].append(used)
        out["K"].append(int(G.sum()))
    return out


# == invariants ===================================================================================================
def on_backend(backend, *arrays):
    """``arrays`` as they are (``"numpy"``), or as torch tensors sharing their memory (``"torch"``; the test is
    skipped without torch)."""
    if backend != "torch":
        return arrays
    torch = pytest.importorskip("torch")
    return tuple(torch.from_numpy(a) for a in arrays)


def assert_mass_conserved(g, res):
    """Error feedback loses nothing: after every step t, what was applied (the sums, rank 0's copy) plus what the
    ranks keep equals the sum of all gradients so far, exactly (float64; integer data). ``res``: a ``simulate``
    result or a table of ``run_oktopk`` (``updates`` and ``residuals``)."""
    updates, residuals = (res["updates"], res["residuals"]) if isinstance(res, dict) else (res.updates,
                                                                                            res.residuals)
    for t in range(g.shape[0]):
        applied = updates[: t + 1, 0].sum(axis=0, dtype=np.float64)
        kept = residuals[t].sum(axis=0, dtype=np.float64)
        np.testing.assert_array_equal(applied + kept, g[: t + 1].sum(axis=(0, 1), dtype=np.float64))


def acc_of(g, res, t):
    """a_t^r = eps_{t-1}^r + g_t^r (exact on integer data)."""
    return g[t] + (res["residuals"][t - 1] if t else 0)


def mean_density_ratio(compression, data, steps, partitioned=False):
    """Run ``compression`` on ``data.grad(t, r)`` (a benchmark gradient source) for ``steps`` steps on its
    P virtual ranks; returns the achieved density over the target, averaged over steps (and ranks, or summed
    over ranks for partitioned sparsifiers such as ExDyna)."""
    sel = simulate(compression, data.grad, steps=steps, size=data.workers, record=("selected",)).selected
    per_step = sel.sum(axis=1) if partitioned else sel.mean(axis=1)
    return per_step.mean() / int(0.01 * data.n)


# == harness ======================================================================================================
def real(out):
    """The real entries of what a sparsifier's ``select`` returned: ``(indices padded with n, count[, note])``
    (the built-in ones), or the indices alone; as a numpy array (ascending)."""
    if not isinstance(out, tuple):
        return np.asarray(out)
    idx, count = out[0], out[1]
    xp = backend_of(idx)
    return np.asarray(xp.to_numpy(idx))[:int(xp.item(count))]



def comp(sparsifier, reducer):
    return SparseCompression(sparsifier, reducer)


def ctx_of(rank=0, size=1, step=0, layout=None, comm=None):
    return StepContext(rank, size, step, layout, comm, False)


def run_world(comp, g, shapes=None, backend="numpy", average=False):
    """``simulate`` ``comp`` on g (steps, P, n); per step and rank: u, residual, sparsifier state, info, phases."""
    steps, P, _ = g.shape
    res = simulate(comp, g, shapes=shapes, average=average, backend=backend, record=RECORDS)
    return [[{"u": res.updates[t, r], "res": res.residuals[t, r], "state": res.sparsifier_states[t][r],
              "info": res.info[t][r], "phases": res.phases[t][r], "collectives": res.volume[t][r]["collectives"]}
             for r in range(P)] for t in range(steps)]


class Recording(ThresholdReuse):
    """ThresholdReuse that also leaves its selection (its real entries) in the state (test instrument only)."""

    def select(self, xp, acc, k, state, ctx):
        out = super().select(xp, acc, k, state, ctx)
        state["_sel"] = xp.to_numpy(out[0])[:int(xp.item(out[1]))].copy()
        return out


def make_oktopk(density, tp=32, rp=64, sp=None, rd=None, record=True):
    """Ok-Topk: ThresholdReuse (``Recording`` with ``record``) + OkTopk, with the periods and the arguments given;
    unless ``rd`` says otherwise, every owner may send k pairs (``gather_capacity=None``: nothing is cut, as the
    central reference assumes)."""
    cls = Recording if record else ThresholdReuse
    return SparseCompression(cls(density, threshold_period=tp, **(sp or {})),
                             OkTopk(threshold_period=tp, repartition_period=rp,
                                    **{"gather_capacity": None, **(rd or {})}))


def run_oktopk(comp, g, average=False, torch_backend=False, before_step=None, device=False):
    """``simulate`` ``comp`` on g (steps, P, n) with every record, as a dict of per-step, per-rank tables: the
    sparsifier's state ("sp"), its selection ("sel", left there by ``Recording``) and the reducer's state ("rd").
    ``device``: on torch tensors that take the device paths (as on a GPU; ``bench.syncs.as_if_on_a_device``)."""
    if device:
        from hvd_sparse.bench.syncs import as_if_on_a_device
        with as_if_on_a_device():
            return run_oktopk(comp, g, average, True, before_step)
    res = simulate(comp, g, average=average, backend="torch" if torch_backend else "numpy", record=RECORDS,
                   before_step=before_step)
    sel = [[sp.pop("_sel", None) for sp in row] for row in res.sparsifier_states]
    return {"updates": res.updates, "residuals": res.residuals, "info": res.info, "sp": res.sparsifier_states,
            "rd": res.reducer_states, "phases": res.phases, "sel": sel}
