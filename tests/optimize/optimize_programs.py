"""Per-rank programs for torch_commopt.optimize on gloo."""

from __future__ import annotations

import torch

import torch_commopt
from torch_commopt.testing.validate import check

SHAPE = {"batch": 2, "seq": 16, "dim": 64, "hidden": 128, "heads": 4}


def only_feed_forward(rank: int, world: int, how: str):
    """A TP+SP Llama block (DTensor) whose feed_forward alone is optimized: (errors of every
    output and gradient vs float64 next to eager's, the weight shapes of the rewritten
    regions, the number of graphs compiled, whether the attention was compiled)."""
    compiled = {}

    def compile_fn(model, backend, options):
        if how == "instance":
            torch_commopt.optimize(model.feed_forward, **options)
        else:  # the function form on the module's forward
            model.feed_forward.forward = torch_commopt.optimize(model.feed_forward.forward, **options)
        compiled["attention"] = model.attention._compiled_call_impl is not None
        return model

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    errors = check("tp_sp_block", {"schedule": "sequential"}, shape=SHAPE, compile_fn=compile_fn)
    graphs = torch_commopt.explain().graphs
    weights = sorted({tuple(w) for g in graphs for r in g.rewritten for w in r.summary.get("weights", [])})
    return [(e.name, e.compiled, e.eager) for e in errors], weights, len(graphs), compiled["attention"]


@torch_commopt.optimize(schedule="sequential")
class _OptimizedMLP(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin(x))


def decorated_class(rank: int, world: int):
    """Instances of a decorated Module subclass compile themselves; a plain one does not."""
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    m, plain = _OptimizedMLP(8), torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    out = m(x)
    ok = torch.allclose(out, torch.relu(m.lin(x)))
    return m._compiled_call_impl is not None, plain._compiled_call_impl is None, ok, len(torch_commopt.explain().graphs)


def self_parallelized_linear(rank: int, world: int):
    """A Linear that ColwiseParallel parallelizes itself (its hooks gather the sequence-sharded
    input, as torchtitan's output projection): optimize compiles the hooks with the forward, so
    the gather meets the matmul.  (the rewritten kinds per graph, the state-dict keys, output and
    input-gradient errors against the same module uncompiled, is_optimized)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from torch_commopt.optimize import is_optimized

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    lins = [torch.nn.Linear(32, 64, bias=False) for _ in range(2)]
    lins[1].load_state_dict(lins[0].state_dict())
    for lin in lins:
        parallelize_module(lin, mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                      use_local_output=False))
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    torch_commopt.optimize(lins[0], fullgraph=True)
    x = torch.randn(2, 16 // world, 32, generator=torch.Generator().manual_seed(rank))
    outs, grads = [], []
    for lin in lins:
        xl = x.clone().requires_grad_()
        y = lin(DTensor.from_local(xl, mesh, [Shard(1)]))
        y.to_local().pow(2).sum().backward()
        outs.append(y.to_local().detach())
        grads.append(xl.grad)
    kinds = [(g.graph_kind, sorted(r.kind for r in g.rewritten)) for g in torch_commopt.explain().graphs]
    err = max(float((outs[0] - outs[1]).abs().max()), float((grads[0] - grads[1]).abs().max()))
    return kinds, list(lins[0].state_dict()), err, is_optimized(lins[0])
