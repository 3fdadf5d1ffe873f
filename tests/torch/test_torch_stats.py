"""``hvd_sparse.torch.DistributedOptimizer.sparse_stats(average=True)`` through real `horovodrun -np 2`: the
statistics of the exchanges since the previous call, averaged over the ranks, identical on every rank, as floats
(what ``SummaryWriter.add_scalars`` takes); the shared window arithmetic of hvd_sparse.core.state."""

import json

import numpy as np
import pytest

from hvd_sparse.core.state import KEYS, SparsityWindow, averaged, dense_bytes

from horovod_helpers import horovodrun, requires_horovod

P = 2


def test_window_and_average_arithmetic():
    a, b = SparsityWindow(), SparsityWindow()
    for d, s, r in [(0.1, 100, 300), (0.3, 200, 500)]:
        a.add({"density": d, "sent_bytes": s, "recv_bytes": r})   # flat steps: all their bytes count as across
    a.add({})                                                     # no sparse step: not counted
    b.add({"density": 0.5, "sent_bytes": 40, "recv_bytes": 60, "across_sent_bytes": 10, "across_recv_bytes": 20})
    total = np.add(a.local(2.0), b.local(4.0))
    out = averaged(total, 2)
    assert out == pytest.approx({"density": 0.35, "sent_bytes": 95.0, "recv_bytes": 230.0, "across_sent_bytes": 80.0,
                                 "across_recv_bytes": 210.0, "residual_norm": 3.0})
    a.clear()
    assert a.local(0.0) == [0.0] * 7
    dense = averaged(np.add(a.local(), SparsityWindow().local()), 4, numel=lambda: 1000)
    assert dense == {"density": 1.0, "sent_bytes": dense_bytes(1000, 4), "recv_bytes": 6000.0,
                     "across_sent_bytes": 6000.0, "across_recv_bytes": 6000.0, "residual_norm": 0.0}


@pytest.mark.horovod
@requires_horovod
def test_sparse_stats_average_over_ranks_and_steps(tmp_path):
    horovodrun(P, "torch_stats_worker.py", tmp_path, timeout=300)
    ranks = [json.loads((tmp_path / f"stats.rank{r}.json").read_text()) for r in range(P)]
    for rec in ranks[1:]:
        assert rec["reports"] == ranks[0]["reports"]                  # identical on every rank
    for i, (lo, hi) in enumerate([(0, 3), (3, 8)]):                  # the window since the previous call
        report = ranks[0]["reports"][i]
        assert sorted(report) == sorted(KEYS) and all(type(v) is float for v in report.values())
        local = [np.array(rec["local"][lo:hi]) for rec in ranks]
        expected = np.mean([x.mean(axis=0) for x in local], axis=0)
        assert [report["density"], report["sent_bytes"], report["recv_bytes"]] == pytest.approx(expected, rel=1e-12)
        assert report["residual_norm"] == pytest.approx(np.mean([rec["norms"][i] for rec in ranks]), rel=1e-12)
        assert report["residual_norm"] > 0 and 0 < report["density"] <= 0.05
    # the ranks sent different amounts in some step (not a vacuous average), and no step since the last call: {}
    assert ranks[0]["local"] != ranks[1]["local"] or ranks[0]["norms"] != ranks[1]["norms"]
    assert all(rec["empty"] == {} for rec in ranks)
    # log_stats_every=3: rank 0 logs the average of steps 1-3 and 4-6 over the ranks; the other ranks log nothing
    logged = ranks[0]["logged"]
    assert [line.split(":")[0] for line in logged] == ["hvd_sparse step 3", "hvd_sparse step 6"]
    assert not ranks[1]["logged"]
    for line, (lo, hi) in zip(logged, [(0, 3), (3, 6)]):
        density = np.mean([np.mean(rec["local_logged"][lo:hi]) for rec in ranks])
        assert f"density {density:.4f}," in line and "residual norm" in line
