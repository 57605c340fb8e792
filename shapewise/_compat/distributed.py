"""torch.distributed objects that a traced graph carries (a DTensor's ``DeviceMesh``, its
placements, its spec), as plain values for content keys: the same on every rank, and different
wherever the compiled code differs (the process groups its collectives name)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["distributed_fields"]


def distributed_fields(obj: Any, rank: bool = True) -> tuple | None:
    """``obj`` as a tuple of plain values (strings, ints, tuples and the objects this describes
    again), or None when it is no distributed object this knows. ``rank``: a mesh with this
    rank's coordinate in it. DTensor's sharding rules can compile a rank's coordinate into the
    code (a vocab-parallel embedding masks the ids outside the rank's own rows), so only a
    caller that knows the code cannot depend on it (a weight the graph only takes ``to_local``
    of) may leave it out."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import Placement

    real = getattr(obj, "real_obj", obj)  # Dynamo lifts a mesh as an opaque input: a FakeScriptObject around it
    if isinstance(real, DeviceMesh):
        try:
            groups = tuple(real.get_group(d).group_name for d in range(real.ndim))
        except RuntimeError:  # a mesh made without process groups: its code names none
            groups = ()
        where = tuple(real.get_coordinate() or ()) if rank else "any rank"
        return ("DeviceMesh", real.device_type, tuple(real.mesh.flatten().tolist()), tuple(real.mesh.shape),
                tuple(real.mesh_dim_names or ()), groups, where)
    if isinstance(real, Placement):
        return ("Placement", repr(real))
    if isinstance(real, DTensorSpec):
        return ("DTensorSpec", *(getattr(real, f.name) for f in dataclasses.fields(real)))
    return None
