"""The per-rank state of a sparse preset: one owner for the engines of the units a preset serves.

A :class:`~hvd_sparse.compression.SparseCompression` is configuration (sparsifier, reducer, options); its
``states`` attribute is a :class:`UnitStates`, the state of this rank bound to the model that trains with it --
one engine per unit (``"model"`` for an optimizer or tape, the name of a ``sparse_allreduce``), each with its
residual, thresholds, partitions and step counters. As PyTorch's ``PowerSGDState`` beside its hook, every
framework adapter goes through the public methods below, so checkpoints have one format and one set of checks,
and elastic Horovod's commit/restore/reset are written once:

* :meth:`UnitStates.engine` -- the engine of a unit, created at its first use (a restored state applied then);
* :meth:`UnitStates.state_dict` / :meth:`UnitStates.load_state_dict` -- a checkpoint of this rank, checked for
  rank, number of ranks and preset on load (the layout is checked by the engine at its next step);
* :meth:`UnitStates.snapshot` / :meth:`UnitStates.restore` / :meth:`UnitStates.reset` -- elastic Horovod.
"""

from __future__ import annotations

import copy
import weakref

import numpy as np

from .errors import check_state_origin, state_signature

#: version of the :meth:`UnitStates.state_dict` format
STATE_VERSION = 1


class UnitStates:
    """This rank's engines of one preset, by unit, and the states restored but not yet used by a step.

    Args:
        compression (SparseCompression): the configuration the engines are made from.
    """

    def __init__(self, compression):
        self.compression = compression
        self._engines = {}          # unit -> (owner token, Engine)
        self._pending = {}          # unit -> Engine.state_dict(), applied at the unit's next step
        self._owner = None          # weakref of the optimizer that claimed the preset (claim())

    # -- ownership ------------------------------------------------------------------------------------------
    def in_use(self):
        """True once some unit has an engine (a step ran) or an optimizer claimed the preset."""
        return bool(self._engines) or self.owner() is not None

    def owner(self):
        """The optimizer that :meth:`claim` ed the preset (None when none did, or it is gone)."""
        return None if self._owner is None else self._owner()

    def claim(self, owner):
        """Bind the preset to ``owner`` (an optimizer). Raises ValueError when another live one holds it."""
        held = self.owner()
        if held is not None and held is not owner:
            raise already_used(self.compression)
        self._owner = weakref.ref(owner)

    # -- engines --------------------------------------------------------------------------------------------
    def engine(self, unit, owner, make_comm):
        """The engine of ``unit`` for ``owner``, created on first use over ``make_comm()``; a state restored or kept
        for the unit (load_state_dict, restore, reset) is loaded into it then.

        An owner is an object (an optimizer, a model: the same object) or a name (``sparse_allreduce``'s: an equal
        string, however it was built). Raises ValueError when a second owner (another optimizer or model) claims
        the same unit: its residuals and thresholds would mix with the first one's."""
        entry = self._engines.get(unit)
        if entry is None:
            entry = self._engines[unit] = (owner, self.compression.new_engine(make_comm(), unit))
            if unit in self._pending:
                entry[1].load_state_dict(self._pending.pop(unit))
        elif not _same_owner(entry[0], owner):
            raise already_used(self.compression, unit)
        return entry[1]

    def get(self, unit, owner=None):
        """The engine of ``unit`` if it exists (and belongs to ``owner``, when given), else None; creates nothing."""
        entry = self._engines.get(unit)
        if entry is None or (owner is not None and not _same_owner(entry[0], owner)):
            return None
        return entry[1]

    def residual_norm(self, unit):
        """L2 norm of the residual of ``unit``: its engine's, or the one restored for its next step; 0.0 if none."""
        engine = self.get(unit)
        if engine is not None:
            return engine.residual_norm()
        r = self._pending.get(unit, {}).get("residual")
        return 0.0 if r is None else float((np.asarray(r, dtype=np.float64) ** 2).sum() ** 0.5)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def snapshot(self):
        """A copy of this rank's state of every unit (engine ``state_dict()`` s, states restored but not yet used
        included): what an elastic commit keeps. No collective and no check, so that it can be restored while
        Horovod is down (after a failure, before the reset)."""
        units = {unit: engine.state_dict() for unit, (_, engine) in self._engines.items()}
        for unit, state in self._pending.items():
            units.setdefault(unit, copy.deepcopy(state))
        return units

    def restore(self, units):
        """Roll every unit back to ``units`` (a :meth:`snapshot`): loaded into the engines that exist, applied at
        their first step for the others; an engine created after the snapshot is dropped (it starts afresh)."""
        for unit in [u for u in self._engines if u not in units]:
            del self._engines[unit]
        pending = {}
        for unit, state in units.items():
            entry = self._engines.get(unit)
            if entry is not None:
                entry[1].load_state_dict(copy.deepcopy(state))
            else:
                pending[unit] = copy.deepcopy(state)
        self._pending = pending

    def reset(self, keep_residuals):
        """After an elastic reset (ranks left or joined): every unit starts afresh at its next step -- a new engine
        over the new process set, partitions, thresholds and step counters from scratch, as at step 0 of a run --
        with this rank's residual carried over (``keep_residuals``) or zero."""
        units = self.snapshot()
        self._engines.clear()
        pending = {}
        for unit, state in units.items():
            if keep_residuals and state.get("residual") is not None:
                fresh = self.compression.new_engine(None, unit).state_dict()       # the state of step 0
                fresh.update(numel=state["numel"], residual=state["residual"])
                pending[unit] = fresh
        self._pending = pending

    def state_dict(self, rank, size):
        """This rank's checkpoint: ``{"version", "rank", "size", "compression", "units": {unit:
        Engine.state_dict()}}`` (numpy arrays and Python values), the same for every framework."""
        return {"version": STATE_VERSION, "rank": rank, "size": size,
                "compression": state_signature(self.compression), "units": self.snapshot()}

    def load_state_dict(self, state, rank, size, api):
        """Restore :meth:`state_dict`: at once into the units that exist, at their first step into the others.
        Raises ValueError (and restores nothing) for something else, or a state of another rank, another number
        of ranks or another preset."""
        check_state_format(state, api)
        check_state_origin(state, rank, size, self.compression, api)
        pending = {}
        for unit, state_u in state["units"].items():
            engine = self.get(unit)
            if engine is not None:
                engine.load_state_dict(state_u)
            else:
                pending[unit] = state_u
        self._pending = pending


def _same_owner(a, b):
    """Objects by identity (two optimizers are two owners even when equal), names by value."""
    return a is b or (isinstance(a, str) and a == b)


def already_used(compression, unit=None, api=None):
    """The ValueError for a preset that a second optimizer or model tries to use (its per-model state would mix)."""
    where = f" (unit '{unit}')" if unit else ""
    return ValueError(f"{api + ': ' if api else ''}{compression!r} is already used by another optimizer or model"
                      f"{where}; a sparse preset keeps per-model state (residuals, thresholds): create one per "
                      f"optimizer or model, e.g. Compression.{compression.preset.split('(')[0]}(...) again")


def check_state_format(state, api):
    """Raise ValueError unless ``state`` is a :meth:`UnitStates.state_dict`."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "units" not in state:
        keys = sorted(state) if isinstance(state, dict) else ""
        raise ValueError(f"{api}: not a sparse state saved by hvd_sparse (sparse_state_dict() or SparseState), got "
                         f"{type(state).__name__} with keys {keys}")
