"""Sparse allreduce algorithms (reducers): how the ranks combine their selections (one file per scheme; Ok-Topk's,
``OkTopk``, lives with the rest of Ok-Topk in :mod:`hvd_sparse.core.oktopk`)."""

from .base import ALL, Reducer
from .dense import Dense
from .exdyna import ExDynaReducer
from .gtopk import GTopk
from .spardl import SparDL
from .topk_dsa import TopkDSA
from .topka import TopkA

__all__ = ["ALL", "Reducer", "Dense", "ExDynaReducer", "GTopk", "SparDL", "TopkA", "TopkDSA"]
