"""The host reads of a sparse step (``hvd_sparse/bench/syncs.py``): on a GPU each is a wait for the device
(``cudaStreamSynchronize``). Counted here on CPU tensors that take the CUDA paths; each preset's steady step must
make exactly the number docs/algorithms.md gives ("Host reads per step"): a new ``.item()``, ``float(t)``,
``nonzero`` or copy to numpy in the step fails this test (and a removed one asks for the table to follow)."""

import pytest
import torch

from hvd_sparse.bench import presets
from hvd_sparse.bench.syncs import HostReads, count

#: the steady step's host reads at P = 4 (docs/algorithms.md, "Host reads per step"); the sizes of the
#: variable-size collectives and the agreement's table are needed, the rest is the algorithm's
STEADY_P4 = {"dense": 2, "topka": 5, "gaussiank": 7, "topk_dsa": 8, "gtopk": 17, "oktopk": 14, "exdyna": 4,
             "dct": 4, "spardl": 9}


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_makes_its_documented_host_reads_per_steady_step(name):
    counts, where, _ = count(presets.make(name, 0.01), 4, 20_000, 6)
    assert max(counts[1:]) == STEADY_P4[name], (counts, where)
    assert sum(where.values()) == counts[-1]


def test_the_counter_sees_every_kind_of_host_read_and_not_the_device_work():
    x = torch.arange(6.0)
    reads = HostReads()
    with reads:
        y = (x * 2).abs().sum()                 # device work only
        assert reads.reads == 0
        float(y), int(x[1]), bool(x[0]), x[2].item(), x.tolist(), x.numpy()
        torch.nonzero(x), x[x > 2], x.unique()
        with reads.paused():
            float(y)                            # a collective's own copies are not the engine's
    assert reads.reads == 9


def test_the_ladder_and_the_guard_read_their_counts_once():
    """Ok-Topk's 9 ladder counts go to the allreduce on the device and the guard's raised thresholds are counted
    in one read: a step reads neither once per threshold."""
    _, where, _ = count(presets.make("oktopk", 0.01), 4, 20_000, 4)
    assert not any(k.startswith("__int__") for k in where), where
