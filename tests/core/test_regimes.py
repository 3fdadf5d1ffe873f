"""The threshold presets through gradients that strain their capacity (hvd_sparse/bench/regimes.py): a mean far from
zero, a x64 jump of the scale, a return from 199 all-zero steps, heavy tails, a dominant layer, signs that flip. No
entry may starve: against TopkA on the same data, at least half as many distinct entries are sent after the event,
and the largest residual entry stays within the bound of ``regimes.bounds``; a threshold that must follow a new scale
gets there within a few steps; and what a step reports (Ok-Topk's K) is what it applied."""

import functools

import numpy as np
import pytest

from hvd_sparse import Compression
from hvd_sparse.bench import regimes
from hvd_sparse.bench.syncs import as_if_on_a_device
from hvd_sparse.testing import simulate

P = 2


@functools.lru_cache(maxsize=None)
def row_of(regime, preset):
    return regimes.compare(preset, regime, P)


@pytest.mark.parametrize("preset", sorted(regimes.PRESETS))
@pytest.mark.parametrize("regime", sorted(regimes.REGIMES))
def test_no_entry_starves(regime, preset):
    row = row_of(regime, preset)
    assert regimes.bounds(row, P) == {"distinct": True, "residual": True}, row


@pytest.mark.parametrize("preset", sorted(regimes.PRESETS))
@pytest.mark.parametrize("regime", ["scale_jump", "after_zeros"])
def test_a_threshold_follows_a_new_scale_within_a_few_steps(regime, preset):
    """A x64 jump, or gradients again after 199 zero steps (the threshold decayed meanwhile, by up to 10^7): within
    8 steps the threshold stays within 2x of where the run ends (docs/algorithms.md, "Capacities", per preset)."""
    row = row_of(regime, preset)
    assert row["absorbed"] is not None and row["absorbed"] <= 8, row


def test_settled_is_where_a_series_stays_near_its_end():
    assert regimes.settled([1, 100, 3, 60, 90, 100, 100, 100, 100, 100]) == 3
    assert regimes.settled([1, 2, 4, 8, 16, 32, 64, 128, 256, 512]) is None      # never settles: it still climbs
    assert regimes.settled([0.0] * 8) is None


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("regime", ["scale_jump", "mean_dominated"])
def test_oktopk_reports_the_k_it_applied(regime, device):
    """Ok-Topk's K is what G holds on every step, also where an owner climbed past the Γ ladder to fit its c pairs
    (after the jump; the first steps of a dominant mean), on the host's gather and a device's."""
    reg = regimes.REGIMES[regime]
    kw = dict(steps=reg.steps, size=4, record=("updates", "info"))
    if device:
        with as_if_on_a_device():
            res = simulate(Compression.oktopk(0.01), reg.grad, backend="torch", **kw)
    else:
        res = simulate(Compression.oktopk(0.01), reg.grad, **kw)
    applied = [int(np.count_nonzero(res.updates[t, 0])) for t in range(reg.steps)]
    assert [res.info[t][0]["K"] for t in range(reg.steps)] == applied


def test_the_command_prints_every_row_and_writes_its_json(tmp_path, capsys):
    from hvd_sparse.bench.__main__ import main
    out = tmp_path / "regimes.json"
    assert main(["regimes", "--regimes", "sign_flip,scale_jump", "--presets", "exdyna", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sign_flip" in text and "scale_jump" in text
    import json
    rows = json.loads(out.read_text())["rows"]
    assert [r["regime"] for r in rows] == ["sign_flip", "scale_jump"] and all(r["within_bounds"] for r in rows)
    with pytest.raises(SystemExit):
        main(["regimes", "--presets", "topka"])                  # not a threshold preset: argparse names it
