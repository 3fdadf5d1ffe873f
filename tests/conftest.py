"""Fixtures shared by the test modules. The shared oracles and test data are plain functions in tests/oracles.py
(``from oracles import ...``), the horovodrun helpers in tests/horovod_helpers.py."""

import pytest


@pytest.fixture(scope="module")
def horovod():
    """Horovod's TensorFlow binding initialised in this process (size 1, no horovodrun): a module's tests take it
    with ``pytestmark = pytest.mark.usefixtures("horovod")``."""
    hvd = pytest.importorskip("horovod.tensorflow")
    hvd.init()
    return hvd
