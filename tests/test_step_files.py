"""scripts/step_files.py, the files of hvd_sparse that one steady Ok-Topk ``optimizer.step()`` runs in (README,
"Where is what"): at most 10 with an optimizer that keeps state, which reads no frame (torch/recipes.py only for an
optimizer without state), and every one of them named in README's list of the hops."""

import re

import pytest

from horovod_helpers import HERE, horovodrun, requires_horovod

pytestmark = requires_horovod


@pytest.fixture(scope="module")
def paths():
    """{momentum: [file, ...]} as rank 0 of ``horovodrun -np 2 python scripts/step_files.py`` prints them."""
    proc = horovodrun(2, HERE.parent / "scripts" / "step_files.py")      # an absolute path: not in hvd_workers/
    found = [re.search(r"SGD\(momentum=([0-9.]+)\): (.*)$", line) for line in proc.stdout.splitlines()]
    return {float(m.group(1)): m.group(2).split(" -> ") for m in found if m}


def test_a_steady_step_runs_in_at_most_ten_files_and_only_a_stateless_one_asks_who_is_calling(paths):
    stateful, stateless = paths[0.9], paths[0.0]
    assert len(stateful) <= 10 and "torch/recipes.py" not in stateful, stateful
    assert "torch/recipes.py" in stateless and [f for f in stateless if f != "torch/recipes.py"] == stateful
    assert stateful[0] == "torch/optimizer.py" and "core/reducers/oktopk.py" in stateful


def test_readme_names_every_file_of_the_step(paths):
    row = next(line for line in (HERE.parent / "README.md").read_text().splitlines()
               if line.startswith("| one Ok-Topk `optimizer.step()`"))
    assert [f for f in paths[0.0] if f"`{f}`" not in row] == []
    assert f"{len(paths[0.9])} files with an optimizer that keeps state" in row
