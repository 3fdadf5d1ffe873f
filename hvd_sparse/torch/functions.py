"""Horovod's broadcast functions for every dtype: ``hvds.broadcast_parameters``, ``hvds.broadcast_optimizer_state`` and
``hvds.broadcast_object``, with Horovod's signatures.

Horovod 0.28.1 broadcasts uint8, int8, int16, int32, int64, float16, float32 and float64 tensors only: its
``broadcast_parameters(model.state_dict(), 0)`` raises ``ValueError: Tensor type torch.BFloat16Tensor is not
supported`` for a bf16 model, and 0.28.1 is its last release. These functions do what Horovod's do and carry every
other dtype as its bit pattern: a tensor is broadcast in place through a view of its memory as the integer type of
its item size (bfloat16 as int16, bool and the float8 types as uint8, complex64 as int64), so the bits arrive
unchanged. Scripts start as Horovod's do:

    hvds.broadcast_parameters(model.state_dict(), root_rank=0)
    hvds.broadcast_optimizer_state(optimizer, root_rank=0)

``broadcast_optimizer_state`` also works for ``hvd_sparse.torch.DistributedOptimizer``: on a rank without optimizer
state it creates the state by stepping the *inner* optimizer on zero gradients (no exchange: the other ranks are not
stepping), as Horovod does for its own optimizer, and then puts the parameters back as they were (Horovod's step
leaves weight decay -- or NaN, for fp16 Adam -- in the parameters of those ranks only). ``broadcast_object`` is Horovod's (it pickles, so every dtype
already travels).
"""

from __future__ import annotations

import torch
from horovod.torch.functions import broadcast_object
from horovod.torch.mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]

#: dtypes Horovod 0.28.1's torch broadcast takes as they are
HOROVOD_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                            torch.float32, torch.float64})
#: the integer dtype of each item size: what a tensor of another dtype travels as
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def wire_view(tensor):
    """``tensor`` as Horovod can broadcast it in place: itself for a dtype Horovod has, else a view of the same memory
    as the integer dtype of its item size (bfloat16 -> int16), or of float64 pairs for complex128."""
    t = tensor.detach()
    if t.dtype in HOROVOD_DTYPES:
        return t
    if t.is_complex() and t.element_size() not in _BITS:
        return torch.view_as_real(t)
    return t.view(_BITS[t.element_size()])


def _named(params):
    if isinstance(params, dict):
        return sorted(params.items())
    if isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise ValueError(f"invalid params of type: {type(params)}")
    return [p if isinstance(p, tuple) else (None, p) for p in params]


def broadcast_parameters(params, root_rank):
    """Broadcast ``params`` from ``root_rank`` to every rank, in place, whatever their dtype.

    Args:
        params: ``model.state_dict()`` (a dict, broadcast in sorted key order as Horovod does), or a list or iterable
            of tensors or of ``(name, tensor)`` pairs (``model.named_parameters()``, ``model.parameters()``).
        root_rank (int): the rank whose values every rank ends with.
    """
    handles = [broadcast_async_(wire_view(p), root_rank, name) for name, p in _named(params)]
    for handle in handles:
        synchronize(handle)


def _create_state(optimizer, model):
    """Give ``optimizer`` its state if it has none, without communicating: one step of the torch optimizer itself on
    zero gradients (sparse ones for sparse embeddings of ``model`` and for SparseAdam), as Horovod does -- but the
    parameters are put back afterwards. Horovod leaves that step's update in them: weight decay, or fp16 Adam
    (whose eps rounds to 0, so 0/0), moves the parameters of the ranks without state only, after they were
    broadcast."""
    if optimizer.state_dict()["state"]:
        return
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    kept = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
        if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
            p.grad = p.grad.to_sparse()
    inner = getattr(optimizer, "_hvds_inner", None)        # hvd_sparse's optimizer: its torch class
    if inner is None and type(optimizer).__module__ == "horovod.torch.optimizer":
        inner = type(optimizer).__mro__[1]                   # Horovod's: the class it wraps
    if inner is not None:
        inner.step(optimizer)
    else:
        optimizer.step()
    with torch.no_grad():
        for p, value in zip(params, kept):
            p.copy_(value)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Broadcast ``optimizer``'s state (its ``param_groups`` options and per-parameter state) from ``root_rank``.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or one returned by Horovod's or hvd_sparse's ``DistributedOptimizer``.
        root_rank (int): the rank whose state every rank ends with.
        model (torch.nn.Module, optional): to find sparse embeddings, whose state is created with sparse gradients.

    Tensors of the state are broadcast in place (every dtype, as :func:`broadcast_parameters`); the other values
    (learning rate, betas, step counts held as numbers) travel in one :func:`broadcast_object`. hvd_sparse's own
    per-rank state (residuals: ``sparse_state_dict``) is not touched.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    _create_state(optimizer, model)
    state_dict = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    tensors, values = [], {}
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                values[("group", index, key)] = value
        for pid in group["params"]:
            for key, value in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(value):
                    tensors.append((f"optimizer_state.{pid}.{key}", value))
                else:
                    values[("state", pid, key)] = value
    broadcast_parameters(tensors, root_rank)
    for (kind, where, key), value in broadcast_object(values, root_rank, name="optimizer_state.values").items():
        if kind == "group":
            optimizer.param_groups[where][key] = value
        else:
            optimizer.state[params[where]][key] = value
