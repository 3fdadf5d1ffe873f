"""Sparse allreduce algorithms (reducers): how the ranks combine their selections (one file per scheme)."""

from .base import ALL, Reducer
from .dense import Dense
from .topka import TopkA

__all__ = ["ALL", "Reducer", "Dense", "TopkA"]
