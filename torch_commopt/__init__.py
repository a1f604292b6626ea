"""torch_commopt: a torch.compile backend that overlaps communication with computation.

    model = torch.compile(model, backend="commopt", options={"schedule": "chunked", "chunks": 4})
    model.mlp = torch_commopt.optimize(model.mlp, mode="model")   # or only the modules named
    print(torch_commopt.explain())
    layout = torch_commopt.balance.choose(block_mask, world)      # context parallelism: deal tokens by work

Importing registers the custom ops (`torch.ops.commopt.*`) and the backend; it touches
neither CUDA nor any process group.
"""

from torch_commopt.backend import commopt_backend
from torch_commopt.backend import register as _register
from torch_commopt.config import Config
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.attention import balance
from torch_commopt.kernels.attention import ops as _attention_ops  # noqa: F401  (and commopt.cp_attention_*)
from torch_commopt.kernels.matmul import ops as _ops  # noqa: F401  (registers torch.ops.commopt.*)
from torch_commopt.kernels.mesh2d import ops as _mesh2d_ops  # noqa: F401  (and commopt.gemm_2d)
from torch_commopt.optimize import optimize
from torch_commopt.report import ExplainReport, explain, reset_explain

_register()

__all__ = ["Config", "ExplainReport", "Schedule", "balance", "commopt_backend", "explain", "optimize", "reset_explain"]
__version__ = "0.1.0"
