"""Sparsifiers: how each rank chooses the entries it sends (one file per scheme; Ok-Topk's, ``ThresholdReuse``, lives
with the rest of Ok-Topk in :mod:`hvd_sparse.core.oktopk`)."""

from .base import Sparsifier
from .dct import DCT
from .exdyna import ExDyna
from .gaussiank import GaussianK
from .topk import TopK

__all__ = ["DCT", "ExDyna", "GaussianK", "Sparsifier", "TopK"]
