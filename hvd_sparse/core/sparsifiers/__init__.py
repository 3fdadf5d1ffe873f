"""Sparsifiers: how each rank chooses the entries it sends (one file per scheme)."""

from .base import Sparsifier
from .dct import DCT
from .exdyna import ExDyna
from .gaussiank import GaussianK
from .threshold_reuse import ThresholdReuse
from .topk import TopK

__all__ = ["DCT", "ExDyna", "GaussianK", "Sparsifier", "ThresholdReuse", "TopK"]
