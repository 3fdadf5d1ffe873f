"""Sparse allreduce algorithms (reducers): how the ranks combine their selections (one file per scheme)."""

from .base import ALL, Reducer
from .dense import Dense
from .exdyna import ExDynaReducer
from .gtopk import GTopk
from .oktopk import OkTopk
from .spardl import SparDL
from .topk_dsa import TopkDSA
from .topka import TopkA

__all__ = ["ALL", "Reducer", "Dense", "ExDynaReducer", "GTopk", "OkTopk", "SparDL", "TopkA", "TopkDSA"]
