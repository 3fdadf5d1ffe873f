"""Fixtures shared by the test modules. The shared oracles and test data are plain functions in tests/oracles.py
(``from oracles import ...``), the horovodrun helpers in tests/horovod_helpers.py."""
