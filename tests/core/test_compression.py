"""``hvd_sparse/compression.py`` and the algorithms' options (``core/validate.py``): every ``Compression.<preset>``
has a plain Python signature, its name lists the arguments that differ from the defaults, the options are frozen
dataclasses checked once with one error wording, and Ok-Topk's variants are instances."""

import dataclasses
import inspect

import pytest

import hvd_sparse
from hvd_sparse.compression import REDUCERS, SparseCompression
from hvd_sparse.core.oktopk import OKTOPK_PRESETS, OkTopk, ThresholdReuse
from hvd_sparse.core.reducers import SparDL, TopkA
from hvd_sparse.core.sparsifiers import DCT, ExDyna, GaussianK, TopK

C = hvd_sparse.Compression
SPARSE_PRESETS = ("oktopk", "topka", "topk_dsa", "gtopk", "gaussiank", "exdyna", "dct", "spardl", "sparse")


@pytest.mark.parametrize("name", SPARSE_PRESETS)
def test_every_preset_has_a_plain_signature_with_the_training_options(name):
    factory = getattr(C, name)
    assert not hasattr(factory, "__signature__") and not hasattr(factory, "__wrapped__")
    params = inspect.signature(factory).parameters
    assert params["warmup_dense_steps"].default == 0 and params["momentum_correction"].default == 0.0
    assert params["warmup_dense_steps"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "warmup_dense_steps (int)" in factory.__doc__
    assert params["byte_budget"].default is None and params["byte_budget"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "byte_budget (float)" in factory.__doc__
    if name != "sparse":                                    # density or byte_budget (tests/core/test_budget.py)
        assert params["density"].default is None


@pytest.mark.parametrize("call, name", [
    (lambda: C.oktopk(0.01), "oktopk(density=0.01)"),
    (lambda: C.oktopk(0.01, 16), "oktopk(density=0.01, threshold_period=16)"),
    (lambda: C.oktopk(0.01, few_collectives_from=None, variant="library"),
     "oktopk(density=0.01, few_collectives_from=None)"),
    (lambda: C.oktopk(0.02, variant="paper", boundaries="load"),
     "oktopk(density=0.02, variant='paper', boundaries='load')"),
    (lambda: C.gaussiank(0.1, "vgg"), "gaussiank(density=0.1, adjust='vgg')"),
    (lambda: C.dct(0.1), "dct(density=0.1)"),
    (lambda: C.dct(0.1, 10, momentum_correction=0.5), "dct(density=0.1, lifespan=10, momentum_correction=0.5)"),
    (lambda: C.exdyna(0.1, threshold_rule="reference"), "exdyna(density=0.1, threshold_rule='reference')"),
    (lambda: C.spardl(0.1, 2, pack="two"), "spardl(density=0.1, groups=2, pack='two')"),
    (lambda: C.sparse(TopK(0.1), "topka"), "sparse(sparsifier=TopK(density=0.1), allreduce='topka')"),
    (lambda: SparseCompression(TopK(0.1), TopkA(), warmup_dense_steps=2),
     "sparse(sparsifier=TopK(density=0.1), allreduce='topka', warmup_dense_steps=2)"),
])
def test_names_list_the_arguments_that_differ_from_the_defaults(call, name):
    assert repr(call()) == f"Compression.{name}"


def test_the_name_is_a_call_that_rebuilds_the_same_configuration():
    for c in (C.oktopk(0.01, 16, 8, boundaries="load", warmup_dense_steps=3),
              C.spardl(0.1, 2, sag="recursive"), C.exdyna(0.05, init_threshold=None)):
        again = eval(repr(c), {"Compression": C})
        assert (again.sparsifier, again.reducer, again.warmup_dense_steps) == \
            (c.sparsifier, c.reducer, c.warmup_dense_steps)


def test_a_variant_that_fixes_the_periods_rejects_other_periods():
    with pytest.raises(ValueError, match="variant='paper' fixes threshold_period"):
        C.oktopk(0.05, 2, variant="paper")
    with pytest.raises(ValueError, match="global_threshold_period"):
        C.oktopk(0.05, variant="paper", global_threshold_period=1)
    with pytest.raises(ValueError, match="global_threshold_period must be an integer"):
        C.oktopk(0.05, global_threshold_period=0)
    with pytest.raises(ValueError, match="global_fill"):             # no reuse step to fill
        C.oktopk(0.05, global_fill=True, global_threshold_period=1)
    assert C.oktopk(0.05, 8, global_fill=True).reducer.threshold_period == 8      # fill reuses Γ for τ' steps
    with pytest.raises(ValueError, match="variant must be one of"):
        C.oktopk(0.05, variant="fast")


def test_variants_are_instances_and_the_preset_applies_the_call_on_top():
    for name, v in OKTOPK_PRESETS.items():
        c = C.oktopk(0.03, variant=name, max_select_ratio=2.0)
        assert c.sparsifier == dataclasses.replace(v.sparsifier, density=0.03, max_select_ratio=2.0)
        assert c.reducer == dataclasses.replace(v.reducer, max_select_ratio=2.0)
    lib = C.oktopk(0.01, 8, 16)
    assert (lib.sparsifier.threshold_period, lib.reducer.threshold_period, lib.reducer.repartition_period) == \
        (8, 1, 16)                                   # the library's global selection: exact on every step
    reused = C.oktopk(0.01, 8, 16, global_threshold_period=8)
    assert (reused.sparsifier.threshold_period, reused.reducer.threshold_period) == (8, 8)


def test_oktopk_refuses_a_balance_policy_with_the_reason():
    """The gather sends a fixed number of pairs per owner: no balancing step is left for a policy to steer."""
    assert C.oktopk(0.01, 32, 64, "auto").reducer == C.oktopk(0.01).reducer
    for policy in ("never", "always"):
        with pytest.raises(ValueError, match="balance='{}' does not apply.*nothing is left to balance".format(policy)):
            C.oktopk(0.01, balance=policy)


# one bad value per option class: (class, positional arguments, the bad keyword, the message's rule)
BAD = [
    (ThresholdReuse, (0.1,), {"guard_iters": -1}, "guard_iters must be an integer >= 0"),
    (ThresholdReuse, (0.1,), {"select_rule": "ge"}, "select_rule must be one of ('ge_nonzero', 'gt')"),
    (ThresholdReuse, (0.1,), {"band_lo": 1.5}, "band_hi must be a finite number >= 1.5"),
    (OkTopk, (), {"load_smoothing": 1.0}, "load_smoothing must be a finite number >= 0 and < 1"),
    (OkTopk, (), {"few_collectives_from": 0}, "few_collectives_from must be an integer >= 1"),
    (OkTopk, (), {"boundaries": "even"}, "boundaries must be one of ('periodic', 'result', 'load', 'measured')"),
    (SparDL, (3,), {"sag": "recursive"}, "groups must be a power of two with sag='recursive'"),
    (SparDL, (), {"pack": "one"}, "pack must be one of ('bitcast', 'two')"),
    (GaussianK, (0.1,), {"adjust": "lsmt"}, "adjust must be one of ('lstm', 'bert', 'vgg')"),
    (DCT, (0.1,), {"zero_tau_guard": 1}, "zero_tau_guard must be a bool"),
    (DCT, (0.1,), {"drain_seed": -1}, "drain_seed must be an integer >= 0"),
    (ExDyna, (0.1,), {"tol_hi": 0.9}, "tol_lo <= 1 <= tol_hi must hold"),
    (ExDyna, (0.1,), {"init_threshold": "top"}, "init_threshold (None, 'topk_once' or a float) must be a finite"),
    (TopK, (1.5,), {}, "density must be in (0, 1]"),
]


@pytest.mark.parametrize("cls, args, kwargs, rule", BAD, ids=[f"{b[0].__name__}-{i}" for i, b in enumerate(BAD)])
def test_every_option_is_checked_when_built_with_one_wording(cls, args, kwargs, rule):
    with pytest.raises((ValueError, TypeError)) as e:
        cls(*args, **kwargs)
    assert str(e.value).startswith(f"hvd_sparse.{cls.__name__}: {rule}"), str(e.value)


@pytest.mark.parametrize("cls", [ThresholdReuse, TopK, GaussianK, ExDyna, DCT, *REDUCERS.values()])
def test_options_are_frozen_values(cls):
    args = (0.1,) if any(f.name == "density" for f in dataclasses.fields(cls)) else ()
    a, b = cls(*args), cls(*args)
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    for f in dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(a, f.name, getattr(a, f.name))


def test_a_replaced_option_is_checked_again():
    with pytest.raises(ValueError, match="hvd_sparse.OkTopk: threshold_period must be an integer >= 1"):
        dataclasses.replace(OkTopk(), threshold_period=0)
    with pytest.raises(ValueError, match="hvd_sparse.ThresholdReuse: density must be in"):
        dataclasses.replace(ThresholdReuse(0.1), density=0)
