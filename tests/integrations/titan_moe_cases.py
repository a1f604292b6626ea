"""Per-rank programs: a torchtitan 0.2.2 MoE layer (deepseek_v3's debug flavor: 8 experts, top-3,
2 shared experts) with expert parallelism over every rank, its token exchange swapped for commopt's
schedules (kernels/moe/module.swap_expert_parallel), against the same layer unsharded.

On CPU torchtitan needs the shims of testing/optional.torchtitan_moe_cpu_shims (integer histc, its
EP dispatch's permutation by its own CPU fallback)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _layer(seed: int, grouped: bool):
    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.moe import MoE

    from torch_commopt.testing.optional import torchtitan_moe_cpu_shims

    torchtitan_moe_cpu_shims()
    args = deepseekv3_args["debugmodel"].moe_args
    args.use_grouped_mm = grouped
    torch.manual_seed(seed)
    layer = MoE(args, dim=64, hidden_dim=48)
    with torch.no_grad():
        layer.init_weights(0.02, torch.device("cpu"))
        # a router bias spread over the experts: they are not chosen uniformly
        layer.expert_bias.copy_(torch.linspace(-0.5, 0.5, layer.expert_bias.numel()))
    return layer


def run_moe_layer(rank: int, world: int, schedules=("a2a", "by_peer"), grouped: bool = False):
    """[(case, largest relative error over the output, the input gradient, every parameter's
    gradient)] of the EP layer under each schedule (and under torchtitan's own ExpertParallel, as
    a check of the harness) against the unsharded layer.  A schedule "optimize S": the layer given
    to torch_commopt.optimize with moe_schedule=S."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    import torch_commopt
    from torch_commopt.kernels.moe.module import swap_expert_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 16 + 4 * rank, 64, generator=g)
    go = torch.randn(x.shape, generator=g)

    ref = _layer(5, grouped)
    xr = x.clone().requires_grad_()
    (ref(xr) * go).sum().backward()
    ref_out = ref(x).detach()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for grad in ref_grads.values():  # every rank's tokens reach every parameter: summed over ranks
        dist.all_reduce(grad)

    results = []
    for schedule in ("torchtitan",) + tuple(schedules):
        layer = _layer(5, grouped)
        parallelize_module(layer.experts, mesh, ExpertParallel())
        if schedule.startswith("optimize "):  # the user's way: the whole layer compiled by commopt
            torch_commopt.optimize(layer, moe_schedule=schedule.split()[1])
            assert layer.experts._commopt_moe_schedule == schedule.split()[1]
        elif schedule != "torchtitan":
            torch_commopt.reset_explain()
            assert swap_expert_parallel(layer, schedule) == ["experts"], schedule
            (seen,) = torch_commopt.explain().modules  # explain() names the swap
            assert (seen.module, seen.kind) == ("experts", "moe") and schedule in seen.detail, seen
        xe = x.clone().requires_grad_()
        out = layer(xe)
        (out * go).sum().backward()
        if schedule != "torchtitan":  # the shared experts ran once, early, and the layer is itself again;
            # not when the whole layer is compiled (optimize): a traced forward keeps its own order
            early = layer.experts.forward.early.__self__
            want_runs = 0 if schedule.startswith("optimize ") else 1
            assert early.runs == want_runs and layer.shared_experts is early.shared, (schedule, early.runs)
        errors = [_rel(out.detach(), ref_out), _rel(xe.grad, xr.grad)]
        for name, p in layer.named_parameters():
            grad = p.grad
            if isinstance(grad, DTensor):  # the experts: this rank's shard of the summed gradient
                grad = grad.to_local()
                rows = grad.shape[0]
                want = ref_grads[name][rank * rows:(rank + 1) * rows]
            else:  # replicated (router, shared experts): this rank's tokens only, summed as the ref's
                grad = grad.clone()
                dist.all_reduce(grad)
                want = ref_grads[name]
            errors.append(_rel(grad, want))
        if schedule == "optimize auto":  # the tuner's pick ran, the same on every rank
            picks = [None] * world
            dist.all_gather_object(picks, layer.experts.forward.last)
            assert picks[0] in ("a2a", "by_expert:2", "by_expert:4") and len(set(picks)) == 1, picks
        results.append((f"{schedule} world {world} rank {rank}", max(errors)))
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
