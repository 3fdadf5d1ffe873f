"""Benchmarks: ``python -m hvd_sparse.bench <command> ...`` (see ``--help``)."""
