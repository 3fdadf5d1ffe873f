"""What hvd_sparse.torch.recipes, the one module that reads the interpreter's frames, relies on in Horovod 0.28.1 and
PyTorch: each behaviour exercised end to end in one process (tests/hvd_workers/recipes_probe.py, ``hvd.init()`` at
size 1), so that a Horovod or PyTorch that renames a local or a method makes these fail loudly, not the recipes
silently."""

import json
import subprocess
import sys

import horovod.torch.optimizer as horovod_optimizer
import pytest
import torch

from horovod_helpers import HERE, job_env, requires_horovod

pytestmark = requires_horovod


@pytest.fixture(scope="module")
def probe():
    proc = subprocess.run([sys.executable, str(HERE / "hvd_workers" / "recipes_probe.py")], capture_output=True,
                          text=True, timeout=300, env=job_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_horovods_broadcast_optimizer_state_is_recognised_and_runs_no_exchange(probe):
    assert probe["broadcast_optimizer_state"] == {"state_created": True, "exchanges": 0, "engine": False,
                                                  "own_attributes": ["_hvds"]}     # the job in one object


def test_grad_scaler_step_is_found_and_its_skip_recorded(probe):
    assert probe["grad_scaler"] == {"scales": [256.0, 128.0, 128.0], "skipped": 1, "frames": [None] * 3}


def test_hvd_sparse_grad_scaler_records_the_skip_and_reads_no_frame(probe):
    """hvd_sparse.torch.GradScaler hands itself to the optimizer: the same scales and skip as torch's, found from
    its frame (one read of sys._getframe a step, counted from hvd_sparse's code), and no frame read at all."""
    assert probe["hvds_grad_scaler"] == {"scales": [256.0, 128.0, 128.0], "skipped": 1, "frames": [0, 0, 0]}
    assert probe["hvds_grad_scaler_overlap"] == probe["hvds_grad_scaler"]      # backward and step with buckets
    assert probe["torch_grad_scaler"]["scales"] == [256.0, 128.0, 128.0]
    assert all(f >= 1 for f in probe["torch_grad_scaler"]["frames"])        # the counter sees the shim's read


def test_a_step_reads_no_frame_and_horovod_steps_only_optimizers_without_state(probe):
    res = probe["frames_read"]
    assert res["stateless"] == [0, 0, 0] and res["stateful"] == [0, 0, 0]     # plain SGD and momentum SGD
    assert res["broadcast_with_state"] == {"stepped": False, "exchanges": 0}


def test_horovods_optimizer_is_found_from_compress(probe):
    res = probe["compressing_optimizer"]
    assert res["stashed"] == ["bias"]                 # the parameter's name came from Horovod's optimizer
    assert res["outside"] == [True, True] and res["direct"] == [True, True]   # nothing found from elsewhere


def test_horovods_broadcast_steps_only_the_wrapped_class_of_an_optimizer_of_its_module():
    """What ``recipes.step_inner_under_broadcast`` leans on: Horovod compares ``optimizer.__module__`` with its
    DistributedOptimizer's, then steps ``super(optimizer.__class__, optimizer)``."""
    import inspect

    import horovod.torch.functions as horovod_functions

    source = inspect.getsource(horovod_functions.broadcast_optimizer_state)
    assert "optimizer.__module__ == DistributedOptimizer.__module__" in source
    assert "super(optimizer.__class__, optimizer).step()" in source


def test_the_names_the_frames_are_read_by():
    """The locals and attributes read: ``self`` and ``p`` in Horovod's _allreduce_grad_async, its
    ``_parameter_names`` and ``_compression``; ``self`` in GradScaler.step and its per-optimizer record."""
    code = horovod_optimizer._DistributedOptimizer._allreduce_grad_async.__code__
    assert {"self", "p"} <= set(code.co_varnames)
    assert "_parameter_names" in horovod_optimizer._DistributedOptimizer.__init__.__code__.co_names
    assert "self" in torch.amp.GradScaler.step.__code__.co_varnames
    scaler = torch.amp.GradScaler("cpu")
    assert isinstance(scaler._per_optimizer_states, dict)
