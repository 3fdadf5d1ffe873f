"""The fused select-and-compact kernel (hvd_sparse.core.native) against numpy, and the sparsifiers that use it
(ThresholdReuse, Gaussiank, ExDyna) against their generic array path (HVD_SPARSE_NATIVE=0), bit for bit.

Reference semantics (numpy, float32): ge_nonzero = |x| >= t and x != 0 (t <= 0 or NaN: |x| > 0); gt = |x| > t;
ge = |x| >= t; t is the threshold rounded to float32; NaN is never selected.
"""

import dataclasses
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_sparse.core import native
from hvd_sparse.core.native import kernels
from hvd_sparse.core.context import StepContext
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.core.sparsifiers.base import fit_selection
from hvd_sparse.core.sparsifiers.exdyna import ExDyna
from hvd_sparse.core.sparsifiers.gaussiank import GaussianK
from hvd_sparse.core.oktopk.selection import ThresholdReuse
from hvd_sparse.core.xp import backend_of

from oracles import grads

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernel is unavailable")

SPECIALS = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1.1754942e-38,
                     np.finfo(np.float32).max, 1.0, -1.0], np.float32)


def reference(x, th, rule):
    """Ascending indices that ``rule`` selects from float32 ``x`` at ``th``: plain numpy, no bit tricks."""
    a = np.abs(x)
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.float32(th)
        if rule == "gt":
            m = a > t
        elif rule == "ge":
            m = a >= t
        else:
            m = (a >= t) & (a != 0) if t > 0 else a > 0
    return np.flatnonzero(m).astype(np.int64)


def check_select(x, th, rule, threads, base=0):
    ref = reference(x, th, rule)
    idx, val = native.select(x, th, rule, base=base, values=True, threads=threads)
    assert idx.dtype == np.int64 and val.dtype == np.float32
    np.testing.assert_array_equal(idx, ref + base)
    np.testing.assert_array_equal(val.view(np.uint32), x[ref].view(np.uint32))      # bits: -0.0, subnormals
    assert native.count(x, th, rule, threads=threads) == ref.size
    return ref.size


# -- build variants: AVX2 (-march=native here), SSE2 (-O3), portable C (-mno-sse2, x86 only) --------------------
def _variants():
    out = [("native", native.FLAG_SETS[0]), ("baseline", native.FLAG_SETS[1])]
    if os.uname().machine in ("x86_64", "AMD64"):
        out.append(("portable", ("-O3", "-mno-sse2")))
    return out


@pytest.fixture(scope="module", params=_variants(), ids=lambda v: v[0])
def kernel_build(request, tmp_path_factory):
    name, flags = request.param
    path = native.build(flags, directory=tmp_path_factory.mktemp(f"kernel-{name}"))
    return name, native.load(path)


@pytest.fixture
def kernel(kernel_build, monkeypatch):
    """Route the module's calls to one build variant (the module caches one library per process)."""
    name, lib = kernel_build
    monkeypatch.setitem(native.library._state, "lib", lib)
    monkeypatch.setitem(native.library._state, "tried", True)
    return name, lib


def test_build_variants_compile_the_intended_code_path(kernel):
    name, lib = kernel
    simd = lib.hvds_simd().decode()
    if name == "portable":
        assert simd == "scalar"
    elif name == "baseline" and os.uname().machine == "x86_64":
        assert simd == "sse2"
    else:
        assert simd in ("avx2", "sse2", "scalar")


@pytest.mark.parametrize("rule", native.RULES)
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_kernel_equals_numpy_on_sizes_that_are_not_multiples_of_the_chunk(kernel, rule, n, threads):
    rng = np.random.default_rng(n * 31 + threads)
    x = rng.standard_normal(n).astype(np.float32)
    if n:
        x[rng.integers(0, n, size=max(1, n // 5))] = 0.0
        x[rng.integers(0, n, size=max(1, n // 50))] = SPECIALS[rng.integers(0, SPECIALS.size, max(1, n // 50))]
    for th in [0.0, -0.0, -1.0, 0.5, 1.5, 1e-45, np.inf, np.nan] + ([float(abs(x[n // 2]))] if n else []):
        check_select(x, th, rule, threads)
    check_select(x, 0.5, rule, threads, base=1 << 40)


@pytest.mark.parametrize("rule", native.RULES)
def test_ties_at_the_threshold_and_every_special_value(kernel, rule):
    x = np.tile(np.concatenate([SPECIALS, -SPECIALS, np.float32([0.25, -0.25, 0.25000003, 0.24999999])]), 50)
    for th in [0.25, np.float32(0.25), 0.0, 1e-45, float(np.finfo(np.float32).max), np.inf, np.nan, -np.inf]:
        for threads in (1, 4):
            check_select(x, th, rule, threads)
    # a threshold between two floats is rounded to the nearest float32 first (as numpy and torch compare)
    lo = np.float32(0.1)
    hi = np.nextafter(lo, np.float32(1))
    x = np.array([lo, hi, -lo, -hi], np.float32)
    near_hi = float(lo) + 0.6 * (float(hi) - float(lo))           # rounds to hi
    assert native.select(x, near_hi, rule)[0].tolist() == ([] if rule == "gt" else [1, 3])
    near_lo = float(lo) + 0.4 * (float(hi) - float(lo))           # rounds to lo
    assert native.select(x, near_lo, rule)[0].tolist() == ([1, 3] if rule == "gt" else [0, 1, 2, 3])


def test_nan_is_never_selected_and_nan_threshold_follows_the_generic_rules(kernel):
    x = np.array([np.nan, 1.0, -np.nan, 0.0, np.inf, np.float32("nan")], np.float32)
    for rule in native.RULES:
        for th in (-1.0, 0.0, 0.5):
            assert 0 not in native.select(x, th, rule)[0] and 2 not in native.select(x, th, rule)[0]
    assert native.select(x, np.nan, "gt")[0].size == 0
    assert native.select(x, np.nan, "ge")[0].size == 0
    assert native.select(x, np.nan, "ge_nonzero")[0].tolist() == [1, 4]       # rule_mask: t <= 0 -> |x| > 0
    assert native.select(x, 0.5, "ge", nan=True)[0].tolist() == [0, 1, 2, 4, 5]   # asked for: the NaNs too
    assert native.select(x, np.inf, "gt", nan=True)[0].tolist() == [0, 2, 5]     # whatever the threshold


_F32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pool=st.lists(_F32, min_size=1, max_size=8), n=st.integers(0, 700),
       seed=st.integers(0, 2**32 - 1), threads=st.integers(1, 5), rule=st.sampled_from(native.RULES),
       base=st.integers(0, 2**40))
def test_property_kernel_equals_numpy(data, pool, n, seed, threads, rule, base):
    # a few distinct values (ties, signed zeros, NaN, inf, subnormals) spread over n positions; the
    # threshold is one of them or any float. Runs on the process's own (native) build.
    x = np.array(pool, np.float32)[np.random.default_rng(seed).integers(0, len(pool), n)]
    th = data.draw(st.one_of(st.sampled_from(pool), _F32, st.floats(allow_nan=True)))
    check_select(x, th, rule, threads, base=base)


def test_workspace_overflow_grows_and_a_spike_does_not_pin_memory():
    n = 3 * 70_000
    x = np.zeros(n, np.float32)
    x[-60_000:] = 2.0                       # every match in the last thread's chunk: its segment overflows
    x[::1000] = 3.0
    for threads in (1, 3):
        kernels._tls.ws = kernels._Workspace()
        idx, val = native.select(x, 1.0, "gt", values=True, threads=threads, expect=10)
        np.testing.assert_array_equal(idx, reference(x, 1.0, "gt"))
        assert np.all(val >= 2.0)
        assert kernels._tls.ws.cap >= 60_000 // 2
        # a small selection afterwards releases the large segments
        idx, _ = native.select(x, 2.5, "gt", threads=threads)
        assert idx.size == n // 1000 and kernels._tls.ws.cap == 0
    # results are fresh arrays: the next call does not overwrite them
    a, _ = native.select(x, 1.0, "gt")
    b, _ = native.select(x, 2.5, "gt")
    np.testing.assert_array_equal(a, reference(x, 1.0, "gt"))
    assert not np.shares_memory(a, b)


def test_views_only_for_contiguous_1d_float32_cpu_arrays():
    import torch

    xp_np = backend_of(np.zeros(1, np.float32))
    a = np.arange(10, dtype=np.float32)
    assert native.f32_view(xp_np, a) is a
    assert native.f32_view(xp_np, a[::2]) is None
    assert native.f32_view(xp_np, a.astype(np.float64)) is None
    assert native.f32_view(xp_np, a.reshape(2, 5)) is None
    assert native.f32_view(xp_np, a.astype(">f4")) is None
    t = torch.arange(10, dtype=torch.float32, requires_grad=True)
    xp_t = backend_of(t)
    v = native.f32_view(xp_t, t)
    assert isinstance(v, np.ndarray) and v.ctypes.data == t.data_ptr()                # no copy
    assert native.f32_view(xp_t, t.detach()[::2]) is None
    assert native.f32_view(xp_t, t.detach().double()) is None
    idx = native.wrap(xp_t, native.select(v, 4.5, "gt")[0])
    assert isinstance(idx, torch.Tensor) and idx.dtype == torch.int64 and idx.tolist() == [5, 6, 7, 8, 9]


def test_thread_settings(monkeypatch):
    monkeypatch.setenv("HVD_SPARSE_NATIVE_THREADS", "3")
    assert native.default_threads() == 3
    assert native.threads_for(10) == 1 and native.threads_for(10 * native.MIN_PER_THREAD) == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("HVD_SPARSE_NATIVE_THREADS", bad)
        with pytest.raises(ValueError, match="HVD_SPARSE_NATIVE_THREADS must be a positive integer"):
            native.default_threads()


def test_bad_rule_is_named():
    with pytest.raises(ValueError, match="rule must be one of"):
        native.select(np.zeros(3, np.float32), 1.0, ">=")
    with pytest.raises(TypeError, match="1-D contiguous numpy float32"):
        native.count(np.zeros(3, np.float64), 1.0, "gt")


# -- build, cache and fallback -------------------------------------------------------------------------------
def test_cache_honours_xdg_and_concurrent_builders_do_not_clash(tmp_path):
    """Four processes build into one empty cache at once (as horovodrun ranks do): all load the same file."""
    code = ("import sys; from hvd_sparse.core import native; p = native.build(('-O1',)); "
            "native.load(p); print(p)")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-500:] for o in outs]
    paths = {o[0].decode().strip() for o in outs}
    assert len(paths) == 1
    path = paths.pop()
    assert path.startswith(str(tmp_path / "hvd_sparse" / "native"))
    assert os.listdir(tmp_path / "hvd_sparse" / "native") == [os.path.basename(path)]   # no temp files left
    other = native.build(("-O2",), directory=tmp_path / "hvd_sparse" / "native")
    assert str(other) != path                                      # flags are part of the cache key


def test_no_compiler_falls_back_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native.library, "_state", {"lib": None, "tried": False, "path": None, "flags": None,
                                           "reason": None})
    with pytest.warns(RuntimeWarning, match="native selection kernel could not be built"):
        assert not native.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                             # only once
        assert native.f32_view(backend_of(np.zeros(1, np.float32)), np.zeros(4, np.float32)) is None
        assert native.info()["enabled"] is False and "no-such-cc" in native.info()["reason"]
        sp = ThresholdReuse(0.1)
        x = np.arange(1, 101, dtype=np.float32)
        idx, count, _ = sp.select(backend_of(x), x, 10, {"threshold": 95.0}, _ctx(1))
        np.testing.assert_array_equal(idx[:count], np.arange(94, 100))


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4099])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_add_kernel_equals_numpy_bit_for_bit_and_counts_the_non_finite_sums(kernel, n, threads):
    rng = np.random.default_rng(n + 7 * threads)
    r = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    if n:
        r[rng.integers(0, n, max(1, n // 20))] = SPECIALS[rng.integers(0, SPECIALS.size, max(1, n // 20))]
        g[rng.integers(0, n, max(1, n // 20))] = SPECIALS[rng.integers(0, SPECIALS.size, max(1, n // 20))]
        g[0], r[0] = np.finfo(np.float32).max, np.finfo(np.float32).max          # finite + finite overflows
        g[np.isnan(r) & np.isnan(g)] = 1.0      # NaN + NaN: IEEE 754 leaves open which payload comes out
    with np.errstate(over="ignore", invalid="ignore"):
        want = r + g
    out = np.empty(n, np.float32)
    bad = native.add(r, g, out, threads=threads)
    assert out.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()       # -0.0, NaN payloads, subnormals
    assert bad == int(np.count_nonzero(~np.isfinite(want)))
    assert native.add(None, g, out, threads=threads) == int(np.count_nonzero(~np.isfinite(g)))
    assert out.view(np.uint32).tobytes() == g.view(np.uint32).tobytes()          # a copy: -0.0 stays -0.0
    g2, out2 = g.copy(), np.empty(n + 3, np.float32)[3:]                           # unaligned out: scalar head
    assert native.add(r, g2, out2, threads=threads, zero_g=True) == bad
    assert out2.view(np.uint32).tobytes() == want.view(np.uint32).tobytes() and not g2.view(np.uint32).any()
    native.add(r, g, r, threads=threads)                                          # out may alias an input
    assert r.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    with pytest.raises(ValueError, match="zero_g"):
        native.add(None, g, g, zero_g=True)
    with pytest.raises(ValueError, match="differ in size"):
        native.add(None, g, np.empty(n + 1, np.float32))


@pytest.mark.parametrize("rule", native.RULES)
@pytest.mark.parametrize("n", [0, 1, 65, 4099, 50_000])
@pytest.mark.parametrize("threads", [1, 3])
def test_add_select_is_add_then_select_in_one_pass(kernel, rule, n, threads):
    """The fused pass returns exactly add()'s sum and non-finite count and select()'s indices and values on the
    sum, for every rule, special values and thresholds at ties; a small ``expect`` overflows the segments (the
    fallback selects from the finished sum, the gradient already zeroed), a large one does not."""
    rng = np.random.default_rng(n + threads)
    r = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    if n:
        g[rng.integers(0, n, max(1, n // 20))] = SPECIALS[rng.integers(0, SPECIALS.size, max(1, n // 20))]
        g[np.isnan(r) & np.isnan(g)] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        want = r + g
    for th in (0.5, float(np.abs(want[0])) if n else 1.0, 0.0, -1.0, float("nan"), 3.0):
        for expect in (0, n):                                    # 0: the 4096-entry segments overflow at n = 50k
            g2, out = g.copy(), np.empty(n, np.float32)
            bad, idx, val = native.add_select(r, g2, out, th, rule, base=5, expect=expect, threads=threads,
                                              zero_g=True)
            assert out.view(np.uint32).tobytes() == want.view(np.uint32).tobytes() and not g2.view(np.uint32).any()
            assert bad == int(np.count_nonzero(~np.isfinite(want)))
            ref = reference(want, th, rule)
            np.testing.assert_array_equal(idx, ref + 5)
            assert val.dtype == np.float32
            assert val.view(np.uint32).tobytes() == want[ref].view(np.uint32).tobytes()
    out = np.empty(n, np.float32)
    bad, idx, _ = native.add_select(None, g, out, 0.5, rule, threads=threads)       # no residual: out = g
    assert out.view(np.uint32).tobytes() == g.view(np.uint32).tobytes()
    np.testing.assert_array_equal(idx, reference(g, 0.5, rule))


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_merge_add_sums_sources_in_rank_order_bit_for_bit(kernel, P):
    """merge_add of P ascending runs = a dense "dst = 0; dst[idx_s] += val_s for s = 0..P-1" on the support, bit
    for bit (sums that depend on the order, -0.0, inf, runs that are empty); an unsorted run gives None."""
    rng = np.random.default_rng(P)
    n = 5000
    runs = [np.sort(rng.choice(n, rng.integers(0, 900), replace=False)).astype(np.int64) for _ in range(P)]
    if P > 1:
        runs[1] = runs[1][:0]                                                      # an empty source
    vals = [(rng.standard_normal(r.size) * 10.0 ** rng.integers(-8, 8, r.size)).astype(np.float32) for r in runs]
    if runs[0].size > 3:
        vals[0][:3] = [-0.0, np.inf, 1e-45]
    idx, val = np.concatenate(runs), np.concatenate(vals)
    dense = np.zeros(n, np.float32)
    with np.errstate(invalid="ignore"):
        for r, v in zip(runs, vals):
            dense[r] += v
    support = np.unique(idx)
    got_idx, got_val = native.merge_add(idx, val, [r.size for r in runs])
    np.testing.assert_array_equal(got_idx, support)
    assert got_val.view(np.uint32).tobytes() == dense[support].view(np.uint32).tobytes()
    if idx.size > 2 and runs[0].size > 2:
        bad = idx.copy()
        bad[0], bad[1] = bad[1], bad[0]
        assert native.merge_add(bad, val, [r.size for r in runs]) is None
    top = np.array([5, np.iinfo(np.int64).max, np.iinfo(np.int64).max], np.int64)      # the largest index too
    got_idx, got_val = native.merge_add(top, np.array([1, 2, 3], np.float32), [2, 1])
    np.testing.assert_array_equal(got_idx, top[:2])
    np.testing.assert_array_equal(got_val, [1, 5])
    with pytest.raises(ValueError, match="counts"):
        native.merge_add(idx, val, [idx.size + 1])


def test_intersect_is_the_sorted_intersection(kernel):
    rng = np.random.default_rng(2)
    for na, nb in ((0, 5), (5, 0), (300, 2000), (2000, 300), (1000, 1000)):
        a = np.sort(rng.choice(4000, na, replace=False)).astype(np.int64)
        b = np.sort(rng.choice(4000, nb, replace=False)).astype(np.int64)
        np.testing.assert_array_equal(native.intersect(a, b), np.intersect1d(a, b))
    assert native.intersect(np.array([3, 1], np.int64), np.array([1], np.int64)) is None
    with pytest.raises(TypeError, match="int64"):
        native.intersect(np.array([1], np.int32), np.array([1], np.int64))


def test_members_keeps_what_occurs_in_b(kernel):
    """members(a, b, fill) = where(isin(a, b) and a != fill, a, fill) for ascending a and b with repeats, padding
    (fill) and the largest int64; None when one is not ascending."""
    rng = np.random.default_rng(3)
    top = np.iinfo(np.int64).max
    for na, nb in ((0, 5), (5, 0), (300, 2000), (2000, 300), (1000, 1000)):
        a = np.sort(np.concatenate([rng.integers(0, 3000, na), [4000] * 3, [top]])).astype(np.int64)
        b = np.sort(np.concatenate([rng.integers(0, 3000, nb), [4000]])).astype(np.int64)
        want = np.where(np.isin(a, b) & (a != 4000), a, 4000)
        np.testing.assert_array_equal(native.members(a, b, 4000), want)
    for _ in range(400):        # short runs around the kernel's blocks of four, repeats, a fill among the values
        a, b = (np.sort(rng.integers(0, 20, rng.integers(0, 13))).astype(np.int64) for _ in range(2))
        fill = int(rng.integers(0, 21))
        np.testing.assert_array_equal(native.members(a, b, fill), np.where(np.isin(a, b) & (a != fill), a, fill))
    assert native.members(np.array([3, 1], np.int64), np.array([1], np.int64), 9) is None


def _topk_cases():
    n = 1 << 18                                       # >= TOPK_KERNEL_MIN; the sample takes every 1st value
    rng = np.random.default_rng(4)
    normal = rng.standard_normal(n).astype(np.float32)
    ints = rng.integers(-20, 21, n).astype(np.float32)                  # ties at the k-th magnitude
    sparse = np.zeros(n, np.float32)
    sparse[rng.choice(n, 1000, replace=False)] = 1.0                    # fewer nonzeros than k
    big = np.ones(4 * n, np.float32)                                    # stride 4: the sample sees only 3.0
    big[::4] = 3.0                                                      # -> too few candidates, lowered once
    nan = normal.copy()
    nan[77] = np.nan
    return {"normal": (normal, 2500), "ties": (ints, 30_000), "few_nonzeros": (sparse, 5000),
            "resample": (big, int(0.3 * big.size)), "nan": (nan, 2500), "k1": (normal, 1)}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("case", list(_topk_cases()))
def test_exact_topk_native_path_equals_the_generic_one(monkeypatch, backend, case):
    """topk_indices on large CPU buffers takes two kernel passes instead of a full selection: the same indexes
    (ties by the lower index) and threshold; NaN and fewer-than-k nonzeros go to the generic path."""
    import torch

    from hvd_sparse.core import selection as xpm
    from hvd_sparse.core.xp.kernels import KernelOps

    x, k = _topk_cases()[case]
    acc = torch.from_numpy(x) if backend == "torch" else x
    took = []
    original = KernelOps._topk_fast
    monkeypatch.setattr(KernelOps, "_topk_fast", lambda *a: took.append(original(*a)) or took[-1])
    got = xpm.topk_indices(backend_of(acc), acc, k)
    monkeypatch.setenv("HVD_SPARSE_NATIVE", "0")
    want = xpm.topk_indices(backend_of(acc), acc, k)
    assert type(got[0]) is type(want[0]) and backend_of(got[0]).dtype_of(got[0]) == backend_of(want[0]).dtype_of(want[0])
    np.testing.assert_array_equal(backend_of(got[0]).to_numpy(got[0]), backend_of(want[0]).to_numpy(want[0]))
    np.testing.assert_equal(got[1], want[1])                           # (NaN == NaN here: both generic)
    assert (took[0] is None) == (case in ("few_nonzeros", "nan"))       # the fast path ran where it can


def test_error_feedback_collects_the_selection_in_its_add_pass(monkeypatch):
    """compensate(select=...) returns what native.select finds in acc afterwards, across pieces (global
    indices), and None when a piece cannot take the kernel (an fp16 piece) or the kernel is off."""
    import torch

    from hvd_sparse.core.state import ErrorFeedback

    rng = np.random.default_rng(5)
    res = rng.standard_normal(3000).astype(np.float32)
    pieces = [torch.from_numpy(rng.standard_normal(m).astype(np.float32)) for m in (1000, 1500, 500)]
    mem = ErrorFeedback()
    mem.residual = torch.from_numpy(res.copy())
    acc, finite, found = mem.compensate(backend_of(pieces[0]), pieces, select=(1.5, "ge_nonzero", 300))
    assert finite is True
    idx, val = native.select(acc.numpy(), 1.5, "ge_nonzero", values=True)
    np.testing.assert_array_equal(found[0], idx)
    assert found[1].tobytes() == val.tobytes() and idx.size > 100
    assert mem.compensate(backend_of(pieces[0]), pieces)[2] is None                     # not asked for
    half = pieces[:2] + [pieces[2].half()]
    assert mem.compensate(backend_of(pieces[0]), half, select=(1.5, "ge_nonzero", 300))[2] is None
    monkeypatch.setenv("HVD_SPARSE_NATIVE", "0")
    assert mem.compensate(backend_of(pieces[0]), pieces, select=(1.5, "ge_nonzero", 300))[2] is None


def test_engine_hands_threshold_reuse_its_candidates_from_the_add_pass(monkeypatch):
    """Ok-Topk's reuse steps take their candidates from the add pass (no selection pass over acc), with the
    same bits as the generic path: the whole run, outputs and residuals, equals HVD_SPARSE_NATIVE=0's."""
    import hvd_sparse
    from hvd_sparse.testing import simulate

    n, P, T = 6000, 3, 8
    calls = {"select": 0, "add_select": 0}          # passes over n-sized buffers (the guard selects on C too)
    for name in calls:
        fn = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _fn=fn, _name=name, **k: (calls.__setitem__(
            _name, calls[_name] + (a[-3 if _name == "add_select" else 0].size == n)), _fn(*a, **k))[1])
    rng = np.random.default_rng(11)
    grads = rng.standard_normal((T, P, n)).astype(np.float32)

    def run():
        res = simulate(hvd_sparse.Compression.oktopk(density=0.02), grads, backend="torch")
        return res.updates, res.residuals

    (o1, r1), (o2, r2) = _both_paths(monkeypatch, run)
    assert o1.tobytes() == o2.tobytes() and r1.tobytes() == r2.tobytes()
    # steps 1..T-1 reuse the threshold (step 0 re-evaluates) on every rank: their candidates came from add_select
    assert calls["add_select"] == P * (T - 1) and calls["select"] == 0


def test_error_feedback_pieces_native_equals_generic(monkeypatch):
    """acc = residual + pieces (float32 pieces with the kernel, an fp16 piece generic) and its finiteness verdict
    are the same with and without the kernel, and the residual is not touched before update()."""
    import torch

    from hvd_sparse.core.state import ErrorFeedback

    rng = np.random.default_rng(3)
    res = rng.standard_normal(300).astype(np.float32)

    def run(pieces):
        mem = ErrorFeedback()
        mem.residual = torch.from_numpy(res.copy())
        acc, finite, _ = mem.compensate(backend_of(pieces[0]), pieces)
        assert np.array_equal(mem.residual.numpy(), res)
        return acc.clone(), finite

    f32 = [torch.from_numpy(rng.standard_normal(m).astype(np.float32)) for m in (100, 150)]
    half = torch.from_numpy(rng.standard_normal(50).astype(np.float16))
    for pieces, verdict in (([*f32, half], None), (f32 + [half.float()], True)):
        (a1, v1), (a2, v2) = _both_paths(monkeypatch, lambda: run(pieces))
        assert a1.numpy().tobytes() == a2.numpy().tobytes() and v1 == verdict and v2 is None
    f32[1][7] = float("inf")
    (_, v1), (_, v2) = _both_paths(monkeypatch, lambda: run(f32 + [half.float()]))
    assert v1 is False and v2 is None


def test_switch_off_with_the_environment(monkeypatch):
    x = np.ones(10, np.float32)
    assert native.f32_view(backend_of(x), x) is x
    monkeypatch.setenv("HVD_SPARSE_NATIVE", "0")
    assert native.f32_view(backend_of(x), x) is None and not native.available()
    assert native.info()["reason"] == "HVD_SPARSE_NATIVE=0"


def test_algorithms_reach_the_kernels_only_through_the_backend():
    """No sparsifier, reducer or error feedback module holds the kernel package: they call backend methods
    (``xp.scan``, ``xp.accumulate_``, ``xp.merge_add``, ``xp.intersect``), which take the kernel or the generic
    path; the numpy and torch backends do."""
    import importlib
    import pkgutil

    import hvd_sparse.core.reducers as reducers
    import hvd_sparse.core.sparsifiers as sparsifiers

    mods = [importlib.import_module("hvd_sparse.core.state")]
    for pkg in (reducers, sparsifiers):
        mods += [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
    assert len(mods) > 10
    assert [m.__name__ for m in mods if any(v is native for v in vars(m).values())] == []
    x = np.ones(10, np.float32)
    assert type(backend_of(x).scan(x)).__name__ == "KernelScan"
    assert type(backend_of(x).scan(x[::2])).__name__ == "Scan"                      # strided: generic path


# -- the sparsifiers: native path == generic path ----------------------------------------------------------
_COMM = SimulatedWorld(1).communicators()[0]


def _ctx(step, rank=0, size=1):
    return StepContext(rank, size, step, None, _COMM, False)


def _both_paths(monkeypatch, fn):
    """fn() with the kernel, then with HVD_SPARSE_NATIVE=0; asserts the kernel really ran (and then didn't)."""
    c0 = native.calls()
    got = fn()
    assert native.calls() > c0, "the native path was not taken"
    monkeypatch.setenv("HVD_SPARSE_NATIVE", "0")
    c1 = native.calls()
    want = fn()
    assert native.calls() == c1
    monkeypatch.delenv("HVD_SPARSE_NATIVE")
    return got, want


def _assert_same(got, want):
    assert len(got) == len(want)
    for (i1, s1), (i2, s2) in zip(got, want):
        assert type(i1) is type(i2)
        np.testing.assert_array_equal(backend_of(i1).to_numpy(i1), backend_of(i2).to_numpy(i2))
        assert backend_of(i1).dtype_of(i1) == backend_of(i2).dtype_of(i2)
        assert s1 == s2                                            # thresholds bit-equal as Python floats


def _steps(sp, xs, backend, P=1, rank=0, state=None, update=True):
    """Steps of ``sp`` as the engine makes them: the selection in its capacity, its count and note back to
    ``update``; per step the real entries and the state."""
    import torch

    state = dict(state) if state is not None else sp.initial_state()
    out = []
    for t, x in enumerate(xs):
        acc = torch.from_numpy(x.copy()) if backend == "torch" else x.copy()
        xp, k, ctx = backend_of(acc), sp.k_for(x.size), _ctx(t + 1, rank, P)
        idx, count, note = fit_selection(xp, sp.select(xp, acc, k, state, ctx), x.size, sp.capacity(k, x.size, P),
                                         acc)
        count, note = int(xp.item(count)), int(xp.item(note))
        if update:
            sp.update(xp, state, {"counts": [count] * P}, dataclasses.replace(ctx, selected=count, note=note))
        out.append((idx[:count], {k: v for k, v in state.items()}))
    return out


#: growing steps (step t ~ N(0, (1 + t)^2)), a fifth of the entries zero; boost=(10, 30) adds the overshoot
#: (the first tenth times 30) the guard has to raise L for
DRIFT = dict(normal=True, grow=True, zeros=0.2)


THRESHOLD_CONFIGS = {
    "library": dict(guard_ratio=1.15, guard_factor=1.03, guard_iters=30, guard_target=1.05, band_lo=0.95,
                    band_relax=1.03),
    "ref_lstm_gt": dict(select_rule="gt", guard_ratio=1.5, guard_iters=5),
    "no_guard": dict(guard_ratio=None),
    "guard_zero_iters": dict(guard_iters=0),
    "cap": dict(guard_ratio=1.5, guard_iters=2, max_select_ratio=1.2),
    "cap_gt": dict(select_rule="gt", guard_ratio=None, max_select_ratio=1.0),
}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("cfg", list(THRESHOLD_CONFIGS))
def test_threshold_reuse_native_equals_generic(monkeypatch, backend, cfg):
    sp = ThresholdReuse(0.02, threshold_period=1000, **THRESHOLD_CONFIGS[cfg])
    xs = grads(6, 1, 20_011, seed=len(cfg), boost=(10, 30), **DRIFT)[:, 0]
    start = {"threshold": float(np.sort(np.abs(xs[0]))[-40 * 20_011 // 1000]) / 3, "size": 1}   # too low
    got, want = _both_paths(monkeypatch, lambda: _steps(sp, xs, backend, state=start))
    _assert_same(got, want)
    raises = sum(s["guard_raises"] for _, s in got)
    if cfg in ("library", "ref_lstm_gt", "cap"):
        assert raises > 0                                          # the candidate-only guard was exercised
    if cfg.startswith("cap"):                                      # the cap is the capacity: the threshold climbs
        assert raises > 0 and all(len(i) <= int(sp.max_select_ratio * sp.k_for(20_011)) for i, _ in got)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), density=st.sampled_from([0.01, 0.05, 0.3, 1.0]),
       rule=st.sampled_from(["ge_nonzero", "gt"]), guard=st.sampled_from([None, 1.0, 1.5]),
       scale=st.sampled_from([0.1, 0.5, 1.0, 3.0]), ints=st.booleans())
def test_property_threshold_reuse_native_equals_generic(monkeypatch, n, seed, density, rule, guard, scale, ints):
    rng = np.random.default_rng(seed)
    xs = [(rng.integers(-3, 4, n) if ints else rng.standard_normal(n)).astype(np.float32) for _ in range(3)]
    k = max(1, int(density * n))
    mags = np.sort(np.abs(xs[0]))[::-1]
    start = {"threshold": float(mags[min(k, n) - 1]) * scale + 1e-30, "size": 1}
    sp = ThresholdReuse(density, threshold_period=1000, select_rule=rule, guard_ratio=guard, guard_iters=4)
    got, want = _both_paths(monkeypatch, lambda: _steps(sp, xs, "numpy", state=start))
    _assert_same(got, want)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("adjust", ["lstm", "bert", "vgg"])
def test_gaussiank_native_equals_generic(monkeypatch, backend, adjust):
    sp = GaussianK(0.01, adjust=adjust)
    if adjust == "vgg":                                            # heavy tail: the fit selects too many
        xs = grads(3, 1, 30_000, seed=7, boost=(10, 30), **DRIFT)[:, 0]
    else:                                                          # light tail (uniform): too few
        rng = np.random.default_rng(7)
        xs = [rng.uniform(-1, 1, 30_000).astype(np.float32) for _ in range(3)]
    xs[1][:5] = 0.0
    got, want = _both_paths(monkeypatch, lambda: _steps(sp, xs, backend))
    _assert_same(got, want)
    assert any(s["iterations"] > 0 for _, s in got)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("P,rank", [(1, 0), (3, 1), (4, 3)])
def test_exdyna_native_equals_generic(monkeypatch, backend, P, rank):
    sp = ExDyna(0.01, num_blk=64, init_threshold=0.7, threshold_rule="proportional", freeze_tau_on_empty=False)
    xs = grads(5, 1, 40_000, seed=P, **DRIFT)[:, 0]
    xs[2][:] = 0.0                                                 # an empty partition: the fallback index
    got, want = _both_paths(monkeypatch, lambda: _steps(sp, xs, backend, P=P, rank=rank, update=P == 1))
    _assert_same(got, want)
    assert any(s["fallback"] for _, s in got) and not all(s["fallback"] for _, s in got)


def test_exdyna_zero_partition_flag_uses_the_kernel_count(monkeypatch):
    sp = ExDyna(0.01, num_blk=64, init_threshold=100.0, freeze_tau_on_empty=True)
    x = np.zeros(10_000, np.float32)
    x[5000] = 1.0                                                  # below tau: fallback, but not all-zero
    for xs, zero in (([x], False), ([np.zeros(10_000, np.float32)], True)):
        got, want = _both_paths(monkeypatch, lambda: _steps(sp, xs, "numpy"))
        _assert_same(got, want)
        assert got[0][1]["fallback"] and got[0][1]["zero_partition"] is zero
