"""Per-rank program of the fixed-capacity MoE rewrite on GPUs (passes/moe): the layer compiled in
bf16 with its exchanges in chunks, and kept, each against the same layer in float64 eagerly."""

from __future__ import annotations

import copy


def capacity_bf16(rank: int, world: int):
    """(the moe notes, the chunked run's error, the kept run's error): relative max errors of the
    output and of the input's gradient against float64, fresh random inputs on each rank."""
    import torch
    import torch.distributed as dist

    import torch_commopt
    from torch_commopt.testing.models import CapacityMoE

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    layer = CapacityMoE(256, 384, 8, world, 96, dist.group.WORLD.group_name).to(device)
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(320, 256, device=device, generator=g)
    # each token leans 5 logits towards an expert of its own: bf16's rounding of the router never
    # changes which expert a token goes to, so float64 routes alike and the errors are the experts'
    w = layer.router.weight.detach()
    pick = torch.randint(0, 8, (320,), device=device, generator=g)
    x += 5 * w[pick] / w[pick].square().sum(-1, keepdim=True)
    dy = torch.randn(320, 256, device=device, generator=g)

    def run(model, dtype):
        xi = x.to(dtype).requires_grad_()
        y = model(xi)
        y.backward(dy.to(dtype))
        return y.detach().double(), xi.grad.double()

    ref = run(copy.deepcopy(layer).double(), torch.float64)
    errors, notes = [], []
    for schedule in ("by_expert:2", "a2a"):
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        got = run(torch.compile(copy.deepcopy(layer).bfloat16(), backend="commopt",
                                options={"moe_schedule": schedule}), torch.bfloat16)
        notes += [n for gr in torch_commopt.explain().graphs for n in gr.notes if n.startswith("moe ")]
        errors.append(max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)))
    return notes, errors[0], errors[1]
