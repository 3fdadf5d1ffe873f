"""Every preset's results against a reference recorded before the core was restructured (tests/data/reference.json):
the same bits, not just the same invariants. Each case runs the simulator on fixed gradient-like data and hashes the
updates, residuals and volume; a case that changes is a change of behaviour (say so in CHANGELOG.md and record the
reference again with ``python tests/core/test_reference.py --record``, only for an intended change). Through real
horovodrun the presets equal the simulator bit for bit (tests/torch/test_torch_horovod.py), so this covers them too."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.bench.data import SyntheticGradients
from hvd_sparse.testing import simulate

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference.json"
STEPS, N, DENSITY = 12, 3000, 0.02
#: case name -> (preset, P, backend, training options, preset options)
CASES = {f"{p}.P{P}": (p, P, "numpy", {}, {}) for p in presets.names() for P in (1, 3, 4)}
CASES.update({f"{p}.P3.torch": (p, 3, "torch", {}, {}) for p in presets.names()})
CASES.update({
    "oktopk.P4.warmup_momentum": ("oktopk", 4, "numpy", {"warmup_dense_steps": 3, "momentum_correction": 0.9}, {}),
    "topka.P3.momentum": ("topka", 3, "numpy", {"momentum_correction": 0.5}, {}),
    "exdyna.P4.warmup": ("exdyna", 4, "numpy", {"warmup_dense_steps": 2}, {}),
    "oktopk.P4.paper": ("oktopk", 4, "numpy", {}, {"variant": "paper"}),
    "oktopk.P4.reused": ("oktopk", 4, "numpy", {}, {"global_threshold_period": 32}),
    "oktopk.P4.few": ("oktopk", 4, "numpy", {}, {"few_collectives_from": 1, "threshold_period": 4}),
    "oktopk.P5.periods": ("oktopk", 5, "numpy", {}, {"threshold_period": 3, "repartition_period": 5}),
    "spardl.P4.groups": ("spardl", 4, "numpy", {}, {"groups": 2}),
    "gaussiank.P3.adjust": ("gaussiank", 3, "numpy", {}, {"adjust": "vgg"}),
    "dct.P4.paper": ("dct", 4, "numpy", {}, {"drift": None}),
})


def _digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:32]


def run_case(name):
    preset, P, backend, options, knobs = CASES[name]
    source = SyntheticGradients(N, P, seed=11)
    grads = np.stack([np.stack([source.grad(t, r) for r in range(P)]) for t in range(STEPS)])
    grads[5, P - 1, 17] = np.nan                              # one non-finite step, skipped on every rank
    comp = presets.make(preset, DENSITY, **options, **knobs)
    res = simulate(comp, grads, shapes=[(m,) for m in source.layout], backend=backend)
    volume = [[res.volume[t][r][k] for r in range(P) for k in sorted(res.volume[t][r])] for t in range(STEPS)]
    return {"updates": _digest(res.updates), "residuals": _digest(res.residuals),
            "selected": res.selected.tolist(), "volume": volume}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_preset_gives_the_recorded_bits(name):
    want = json.loads(REFERENCE.read_text())[name]
    assert run_case(name) == want


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    lines = [f"{json.dumps(name)}: {json.dumps(run_case(name), sort_keys=True)}" for name in sorted(CASES)]
    REFERENCE.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"recorded {len(CASES)} cases in {REFERENCE}")
