"""The torch adapter: every use of torch internals lives in this package, so a torch upgrade
touches only it. ``shapes`` (fake tensors, ShapeEnvs, symbols, guards, Dynamo's scalar inputs made
constants), ``dynamo`` (marks, sources, trace errors, locks), ``inductor`` (compiles, generated code,
artifacts), ``retrace`` (Dynamo traces refused before they start), ``ops``
(torch's operator objects), ``cuda`` (the caching allocator's private pools), ``distributed``
(DTensor's mesh, placements and spec as plain values), ``hf`` (transformers' generation loop, imported
only when used).

Supported: torch >= 2.11 (GPU machine: 2.11.0; CPU machines: 2.13.0).
"""

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._sympy.functions import CeilDiv, FloorDiv, Max, Min, Mod, PythonMod

from shapewise._compat.cuda import *  # noqa: F403 - one flat adapter namespace
from shapewise._compat.cuda import __all__ as _cuda_all
from shapewise._compat.distributed import *  # noqa: F403
from shapewise._compat.distributed import __all__ as _distributed_all
from shapewise._compat.dynamo import *  # noqa: F403
from shapewise._compat.dynamo import __all__ as _dynamo_all
from shapewise._compat.hf import *  # noqa: F403
from shapewise._compat.hf import __all__ as _hf_all
from shapewise._compat.inductor import *  # noqa: F403
from shapewise._compat.inductor import __all__ as _inductor_all
from shapewise._compat.ops import *  # noqa: F403
from shapewise._compat.ops import __all__ as _ops_all
from shapewise._compat.precompile import *  # noqa: F403
from shapewise._compat.precompile import __all__ as _precompile_all
from shapewise._compat.retrace import *  # noqa: F403
from shapewise._compat.retrace import __all__ as _retrace_all
from shapewise._compat.shapes import *  # noqa: F403
from shapewise._compat.shapes import TORCH_VERSION
from shapewise._compat.shapes import __all__ as _shapes_all

__all__ = [
    "TORCH_VERSION",
    "CeilDiv",
    "FakeTensor",
    "FakeTensorMode",
    "FloorDiv",
    "Max",
    "Min",
    "Mod",
    "PythonMod",
    *_shapes_all,
    *_cuda_all,
    *_distributed_all,
    *_dynamo_all,
    *_hf_all,
    *_precompile_all,
    *_retrace_all,
    *_inductor_all,
    *_ops_all,
]
