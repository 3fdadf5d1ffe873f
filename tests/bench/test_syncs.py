"""The fixed costs of a sparse step (``hvd_sparse/bench/syncs.py``), counted on CPU tensors that take the CUDA paths:
host reads (on a GPU each is a wait for the device, ``cudaStreamSynchronize``), negotiated collectives (each one
Horovod negotiation or cache lookup and one wait for its background thread) and aten operations (each Python,
dispatch and on a GPU a kernel launch). Each preset's steady step must make exactly the reads and collectives
docs/algorithms.md gives ("The fixed costs of a step"), and at most the operations: a new ``.item()``, ``nonzero``,
copy to numpy or collective fails this test (and a removed one asks for the table to follow)."""

import pytest
import torch

from hvd_sparse.bench import presets
from hvd_sparse.bench.syncs import STEADY_FROM, HostReads, count

#: a steady step at P = 4, n = 20,000, density 0.01 (docs/algorithms.md): (host reads, negotiated collectives)
STEADY_P4 = {"dense": (1, 2), "topka": (1, 1), "gaussiank": (2, 1), "topk_dsa": (5, 4), "gtopk": (14, 4),
             "oktopk": (5, 3), "exdyna": (1, 2), "dct": (2, 1), "spardl": (8, 4)}
#: the most aten operations a steady step of these presets may dispatch (the fixed-shape wire's budget; a selection
#: capped by a threshold ladder adds the exact cut of its largest, about twenty: ExDyna one, Ok-Topk two)
OPS_AT_MOST = {"topka": 45, "exdyna": 64, "gaussiank": 60, "oktopk": 171}


def steady(values):
    """The most over the steady steps (the first two allocate error feedback's two buffers)."""
    return max(values[STEADY_FROM:])


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_makes_its_documented_reads_and_collectives_per_steady_step(name):
    c = count(presets.make(name, 0.01), 4, 20_000, 6)
    assert (steady(c.reads), steady(c.collectives)) == STEADY_P4[name], (c.reads, c.collectives, c.where)
    assert sum(c.where.values()) == c.reads[-1]
    if name in OPS_AT_MOST:
        assert steady(c.ops) <= OPS_AT_MOST[name], c.ops


def test_oktopk_at_many_entries_per_region_keeps_three_collectives_and_five_reads():
    """k/P >= few_collectives_from: the regions follow the load (no histogram in the opening); the same fixed
    shapes, the same collectives and reads."""
    c = count(presets.make("oktopk", 0.01), 4, 4 * 1024 * 100, 5)
    assert (steady(c.reads), steady(c.collectives)) == STEADY_P4["oktopk"], (c.reads, c.collectives, c.where)
    assert steady(c.ops) <= OPS_AT_MOST["oktopk"]


def test_the_counter_sees_every_kind_of_host_read_and_not_the_device_work():
    x = torch.arange(6.0)
    reads = HostReads()
    with reads:
        y = (x * 2).abs().sum()                 # device work only
        assert reads.reads == 0
        float(y), int(x[1]), bool(x[0]), x[2].item(), x.tolist(), x.numpy()
        torch.nonzero(x), x[x > 2], x.unique()
        i = x.long()                            # on a GPU these read on the host too:
        torch.bincount(i), torch.isin(i, i), torch.repeat_interleave(x, i)
        assert reads.reads == 12
        torch.isin(i, i, assume_unique=True), torch.repeat_interleave(x, i, output_size=15)     # these do not
        with reads.paused():
            float(y)                            # a collective's own copies are not the engine's
    assert reads.reads == 12


def test_the_guard_the_capacity_and_the_ladder_read_nothing_of_their_own():
    """Ok-Topk's guard and capacity climb are one sorted search on the device, and its owners' ladder counts ride in
    the gather's header: a steady step reads neither a count nor a threshold on its own."""
    c = count(presets.make("oktopk", 0.01), 4, 20_000, 4)
    assert not any(k.startswith(("__int__", "__float__", "item")) for k in c.where), c.where


@pytest.mark.parametrize("name", ["topka", "oktopk"])
def test_local_clipping_adds_no_host_read_or_collective(name):
    """The clipping factor stays on the device (``core/recipe.py``): a steady step reads and negotiates as without."""
    c = count(presets.make(name, 0.01, local_clip_norm=1.0), 4, 20_000, 6)
    assert (steady(c.reads), steady(c.collectives)) == STEADY_P4[name], (c.reads, c.collectives, c.where)


def test_the_density_warmups_stages_read_and_negotiate_as_the_preset():
    c = count(presets.make("topka", 0.01, warmup_density=0.04, warmup_stage_steps=2), 4, 20_000, 7)
    assert (max(c.reads[1:]), max(c.collectives)) == STEADY_P4["topka"], (c.reads, c.collectives, c.where)
