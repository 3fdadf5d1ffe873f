"""Algorithm names of the benchmarks -> fresh compression objects (one factory, configured by strings)."""

from __future__ import annotations

from .. import compression as _c


def names():
    """Every preset name ``make`` accepts, in a stable order."""
    return [n for n in ("dense", "topka", "gaussiank", "topk_dsa", "gtopk", "oktopk", "exdyna", "dct", "spardl")
            if hasattr(_c.Compression, n)]


#: a preset's name with this suffix runs it on two levels (``hierarchical=True``): ``topka@h``
TWO_LEVELS = "@h"


def two_level_names():
    """The sparse presets' names with :data:`TWO_LEVELS`."""
    return [n + TWO_LEVELS for n in names() if n != "dense"]


#: a preset's name with this suffix runs it with ``overlap=True`` (buckets launched during backward): ``topka+o``
OVERLAP = "+o"


def overlap_names():
    """The sparse presets' names with :data:`OVERLAP`."""
    return [n + OVERLAP for n in names() if n != "dense"]


def overlapped(name):
    """``(name without OVERLAP, whether it had it)``."""
    return (name[:-len(OVERLAP)], True) if name.endswith(OVERLAP) else (name, False)


def make(name, density, **options):
    """``Compression.<name>(density, **options)`` (``dense`` takes no density and no options; the options are
    the presets' training options, e.g. ``warmup_dense_steps``, ``momentum_correction``); ``<name>@h``: the same
    with ``hierarchical=True``; ``<name>+o``: the same compression (the optimizer's ``overlap=True``: see
    :func:`overlapped`)."""
    name = overlapped(name)[0]
    if name in two_level_names():
        return make(name[:-len(TWO_LEVELS)], density, hierarchical=True, **options)
    if name not in names():
        raise ValueError(f"hvd_sparse.bench: unknown algorithm {name!r}; choose from {', '.join(names())}")
    factory = getattr(_c.Compression, name)
    return factory() if name == "dense" else factory(density, **options)


def torch_compression(name, density, horovod=("dense",)):
    """What a torch benchmark worker passes as ``compression=`` to ``hvd_sparse.torch.DistributedOptimizer``:
    ``Compression.none`` for the names in ``horovod`` (the dense baseline is Horovod's own optimizer and fused ring
    allreduce, not the engine's Dense reducer), else ``make(name, density)``."""
    import hvd_sparse.torch as hvds

    return hvds.Compression.none if name in horovod else make(name, density)
