"""Sparsifiers: how each rank chooses the entries it sends (one file per scheme)."""

from .base import Sparsifier
from .topk import TopK

__all__ = ["Sparsifier", "TopK"]
