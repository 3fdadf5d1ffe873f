"""Sparsifiers: how each rank chooses the entries it sends (framework-agnostic; one file per scheme in
``hvd_sparse/core/sparsifiers/``). Pair any of them with any sparse allreduce via
``hvd_sparse.Compression.sparse(sparsifier, allreduce="oktopk")``."""

from .core.sparsifiers import DCT, ExDyna, GaussianK, Sparsifier, ThresholdReuse, TopK  # noqa: F401

__all__ = ["DCT", "ExDyna", "GaussianK", "Sparsifier", "ThresholdReuse", "TopK"]
