"""Per-rank programs for the expert-parallel schedules (kernels/moe): every rank builds every rank's
tokens and routing from seeds, runs its own through `expert_parallel`, and compares its outputs and
gradients with a single-process computation of all experts over all ranks' tokens (float64)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_commopt.kernels.moe.by_expert import by_expert
from torch_commopt.kernels.moe.exchange import exchange_counts
from torch_commopt.kernels.moe.module import PaddedLocal, swiglu_per_expert
from torch_commopt.kernels.moe.schedules import expert_parallel
from torch_commopt.kernels.moe.sync_free import sync_free

D, H, NL = 12, 20, 3  # model dim, expert hidden dim, local experts per rank
# every schedule; by_expert in 2 uneven chunks (2 + 1 experts), in one chunk per expert, and with
# its groups padded to 8 rows as on a GPU
# (and a2a with experts that want padded groups, module.PaddedLocal, padded on the CPU too)
# "by_expert no dx": x needs no gradient (a layer's first input): the backward computes and sends
# none, the weight gradients still right
# "sync_free" (every size on the device) and "sync_free padded" (its groups padded to 8 rows)
CASES = ("a2a", "by_peer", "by_expert", "by_expert:3", "by_expert padded", "a2a padded", "by_expert no dx",
         "sync_free", "sync_free padded")


def _tokens(p: int, world: int, routing: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank p's routed tokens (sorted by expert) and per-expert counts.
    balanced: uniform experts; skewed: most tokens to expert 0, none to expert 1, none to the last
    rank's experts, and rank 0 routes no tokens at all."""
    g = torch.Generator().manual_seed(seed + 101 * p)
    experts = NL * world
    n = 30 + 7 * p
    if routing == "balanced":
        ids = torch.randint(0, experts, (n,), generator=g)
    elif routing == "skewed":
        if p == 0:
            n = 0
        allowed = torch.tensor([e for e in range(experts) if e != 1 and e < NL * (world - 1)])
        ids = torch.where(torch.rand(n, generator=g) < 0.8, torch.zeros(n, dtype=torch.int64),
                          allowed[torch.randint(0, allowed.numel(), (n,), generator=g)])
    else:
        raise ValueError(routing)
    ids = ids.sort().values
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    return x, ids


def _weights(world: int, seed: int) -> list[torch.Tensor]:
    return _weights_of(NL, world, seed)


def _swiglu(rows: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    return (F.silu(rows @ w1.T) * (rows @ w3.T)) @ w2.T


def _local_experts(w1, w2, w3):
    """A GroupedExperts-like callable over these (nl, ...) weights: the package's SwiGLU per expert."""
    return functools.partial(swiglu_per_expert, w1, w2, w3)


class _PlacedByTheSchedule(PaddedLocal):
    """Experts that want padded groups, which a2a must place the rows into itself (unpadded)."""

    def __call__(self, rows, per_expert):
        raise AssertionError("a2a called the padding wrapper instead of placing the rows in padded groups")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, 1e-30) if a.numel() else 0.0


def run_schedules(rank: int, world: int, routings=("balanced", "skewed"), device: str = "cpu",
                  staged: bool = False) -> list[tuple[str, float]]:
    """[(case, largest relative error over output, x's gradient and the local experts' weight
    gradients)] for every schedule and routing; the schedules run on `device` ("cuda": this rank's
    GPU), the reference on the CPU.  staged: every transfer through host staging buffers, as gloo
    moves CUDA tensors (exchange.staged)."""
    if staged:
        from torch_commopt.kernels.moe import exchange
        exchange.staged = lambda t, group: True
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    group = dist.group.WORLD
    results = []
    for routing in routings:
        seed = 7 if routing == "balanced" else 11
        full = _weights(world, seed)
        data = [_tokens(p, world, routing, seed) for p in range(world)]
        grads_out = [torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + p), dtype=torch.float64)
                     for p, (x, _) in enumerate(data)]
        # the reference: every expert over every rank's tokens, one process
        ws_ref = [w.clone().requires_grad_() for w in full]
        xs_ref = [x.clone().requires_grad_() for x, _ in data]
        loss = 0
        outs_ref = []
        for (_, ids), xr, go in zip(data, xs_ref, grads_out):
            out = torch.zeros_like(xr)
            for e in range(NL * world):
                rows = (ids == e).nonzero().flatten()
                if rows.numel():
                    out = out.index_add(0, rows, _swiglu(xr[rows], ws_ref[0][e], ws_ref[1][e], ws_ref[2][e]))
            outs_ref.append(out)
            loss = loss + (out * go).sum()
        loss.backward()
        x, ids = data[rank]
        counts = torch.bincount(ids, minlength=NL * world).to(device)
        for schedule in CASES:
            local = [w[rank * NL:(rank + 1) * NL].to(device, copy=True).requires_grad_() for w in full]
            xr = x.to(device, copy=True).requires_grad_(schedule != "by_expert no dx")
            if schedule == "by_expert no dx":
                out = by_expert(xr, exchange_counts(counts, group), local, group, 2)
            elif schedule == "by_expert padded":
                out = by_expert(xr, exchange_counts(counts, group), local, group, 2, align=8)
            elif schedule == "sync_free padded":
                out = sync_free(xr, counts, local, group, align=8)
            elif schedule == "a2a padded":
                experts = _PlacedByTheSchedule(_local_experts(*local), 8, on_cpu=True)
                out = expert_parallel(xr, counts, experts, group, "a2a")
            else:
                out = expert_parallel(xr, counts, _local_experts(*local), group, schedule, weights=local)
            (out * grads_out[rank].to(device)).sum().backward()
            ref_grad = xs_ref[rank].grad if xs_ref[rank].grad is not None else torch.zeros_like(x)  # no tokens
            errors = [_rel(out.detach().cpu(), outs_ref[rank].detach())]
            if xr.requires_grad:
                errors.append(_rel(xr.grad.cpu(), ref_grad))
            elif xr.grad is not None:
                errors.append(float("inf"))  # a gradient nobody asked for
            errors += [_rel(w.grad.cpu(), wr.grad[rank * NL:(rank + 1) * NL]) for w, wr in zip(local, ws_ref)]
            results.append((f"{schedule} {routing} world {world} rank {rank}", max(errors)))
    return results


def _module(local: list, grad: bool = True):
    """A plain GroupedExperts-like module holding these (nl, ...) weights as its parameters."""
    from torch import nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = (nn.Parameter(w.clone(), requires_grad=grad) for w in local)

    return Experts()


def run_install(rank: int, world: int, schedule: str = "by_peer") -> float:
    """A plain GroupedExperts-like module holding this rank's experts, made expert-parallel by
    `install` with `schedule`: its forward against expert_parallel with the same experts (checked
    above against one process); the largest difference over output and weight gradients."""
    from torch_commopt.kernels.moe.module import install

    full = _weights(world, 3)
    x, ids = _tokens(rank, world, "skewed", 3)
    counts = torch.bincount(ids, minlength=NL * world)
    module = _module([w[rank * NL:(rank + 1) * NL] for w in full])
    install(module, dist.group.WORLD, schedule)
    out = module(x, counts)
    out.sum().backward()
    local = [w[rank * NL:(rank + 1) * NL].clone().requires_grad_() for w in full]
    want = expert_parallel(x, counts, _local_experts(*local), dist.group.WORLD, schedule, weights=local)
    want.sum().backward()
    pairs = [(out, want)] + [(p.grad, w.grad) for p, w in zip((module.w1, module.w2, module.w3), local)]
    return max((a - b).abs().max().item() if a.numel() else 0.0 for a, b in pairs)  # rank 0 routes no tokens


def run_bf16(rank: int, world: int, routings=("balanced", "skewed")) -> list[tuple[str, float, float]]:
    """On this rank's GPU in bf16, where by_expert and sync_free run torch._grouped_mm over padded
    groups: [(case, by_expert's largest relative error, a2a's, sync_free's)] over output, x's gradient and the local
    weight gradients, both against one process in float64 on the CPU; a2a runs the experts as
    torchtitan's grouped GEMM does (bf16 grouped_mm, groups padded), so its error is the bf16
    reference's own."""
    from torch_commopt.kernels.moe.module import padded

    device = f"cuda:{torch.cuda.current_device()}"
    group = dist.group.WORLD
    d, h, nl = 256, 384, 4
    results = []
    for routing in routings:
        g = torch.Generator().manual_seed(5 if routing == "balanced" else 9)
        experts = nl * world
        full = [torch.randn(experts, h, d, generator=g, dtype=torch.float64) / d ** 0.5,
                torch.randn(experts, d, h, generator=g, dtype=torch.float64) / h ** 0.5,
                torch.randn(experts, h, d, generator=g, dtype=torch.float64) / d ** 0.5]
        data = []
        for p in range(world):
            n = 0 if (routing == "skewed" and p == 0) else 600 + 37 * p
            if routing == "balanced":
                ids = torch.randint(0, experts, (n,), generator=g)
            else:  # most to expert 0, none to expert 1 nor to the last rank's experts
                allowed = torch.tensor([e for e in range(experts) if e != 1 and e < nl * (world - 1)])
                ids = torch.where(torch.rand(n, generator=g) < 0.8, torch.zeros(n, dtype=torch.int64),
                                  allowed[torch.randint(0, allowed.numel(), (n,), generator=g)])
            data.append((torch.randn(n, d, generator=g, dtype=torch.float64), ids.sort().values,
                         torch.randn(n, d, generator=g, dtype=torch.float64)))
        ws_ref = [w.clone().requires_grad_() for w in full]
        x, ids, go = data[rank]
        xr = x.clone().requires_grad_()
        loss = 0
        for p, (xp, idp, gp) in enumerate(data):
            xp = xr if p == rank else xp
            out = torch.zeros_like(xp)
            for e in range(experts):
                rows = (idp == e).nonzero().flatten()
                if rows.numel():
                    out = out.index_add(0, rows, _swiglu(xp[rows], ws_ref[0][e], ws_ref[1][e], ws_ref[2][e]))
            if p == rank:
                out_ref = out.detach()
            loss = loss + (out * gp).sum()
        loss.backward()
        counts = torch.bincount(ids, minlength=experts).to(device)
        errs = {}
        for schedule in ("a2a", "by_expert", "sync_free"):
            local = [w[rank * nl:(rank + 1) * nl].to(device, torch.bfloat16).requires_grad_() for w in full]
            xb = x.to(device, torch.bfloat16).requires_grad_()

            def grouped(rows, per, ws=local):
                offs = torch.cumsum(per, 0, dtype=torch.int32)
                a = F.silu(torch._grouped_mm(rows, ws[0].transpose(-2, -1), offs=offs))
                a = a * torch._grouped_mm(rows, ws[2].transpose(-2, -1), offs=offs)
                return torch._grouped_mm(a, ws[1].transpose(-2, -1), offs=offs)

            if schedule == "by_expert":  # itself, also on one rank (expert_parallel runs one rank's experts alone)
                out = by_expert(xb, exchange_counts(counts, group), local, group, 2)
            elif schedule == "sync_free":
                out = sync_free(xb, counts, local, group)
            else:
                out = expert_parallel(xb, counts, padded(grouped), group, schedule)
            out.backward(go.to(device, torch.bfloat16))
            gx = xr.grad if xr.grad is not None else torch.zeros_like(x)
            e = [_rel(out.detach().double().cpu(), out_ref), _rel(xb.grad.double().cpu(), gx)]
            e += [_rel(w.grad.double().cpu(), wr.grad[rank * nl:(rank + 1) * nl]) for w, wr in zip(local, ws_ref)]
            errs[schedule] = max(e)
        from torch_commopt.kernels.moe.ce_exchange import CEExchange

        results.append((f"{routing} world {world} rank {rank} ce passes {CEExchange.passes}", errs["by_expert"],
                        errs["a2a"], errs["sync_free"]))
    return results


def run_sync_free_errors(rank: int, world: int) -> dict:
    """sync_free past its capacity, and with one rank's counts not adding up to its rows: the
    outputs NaN on every rank, check() raising on every rank; then a right call, right again.
    {case: (all outputs NaN, check's message or "")}."""
    from torch_commopt.kernels.moe import sync_free as sf

    group = dist.group.WORLD
    sf.reset()
    full = _weights(world, 7)
    x, ids = _tokens(rank, world, "balanced", 7)
    local = [w[rank * NL:(rank + 1) * NL] for w in full]
    counts = torch.bincount(ids, minlength=NL * world)
    got = {}
    for case, cap, extra in (("over capacity", 5, 0), ("counts off on the last rank", 1000, 1), ("right", 1000, 0)):
        sf.set_capacity(group, cap)
        mine = counts.clone()
        if rank == world - 1:
            mine[0] += extra
        xr, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in local]
        out = sf.sync_free(xr, mine, ws, group)
        out.backward(torch.randn_like(out))
        try:
            sf.check(group)
            told = ""
        except RuntimeError as e:
            told = str(e)
        # a flagged call's gradients are zero (its outputs NaN): nothing of it reaches the weights
        zero_grads = all(bool((t.grad == 0).all()) for t in [xr, *ws])
        got[case] = (bool(torch.isnan(out).all()), told, _rel(out, expert_parallel(x, counts, _local_experts(*local),
                                                                                     group, "a2a")) if not extra and
                     cap > 5 else None, zero_grads)
    return got


class _Bf16Experts:
    """This rank's bf16 experts (nl of them, d -> h -> d) on `device`, new routings of n rows a
    call, and a2a over torchtitan's grouped GEMM as the reference: what the sync_free GPU cases share."""

    d, h, nl, n = 256, 384, 4, 512

    def __init__(self, rank: int, world: int, seed: int, device, grad: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        nl, d, h = self.nl, self.d, self.h
        self.rank, self.world, self.device = rank, world, device
        self.ws = [(torch.randn(nl * world, *shape, generator=g) / shape[1] ** 0.5)[rank * nl:(rank + 1) * nl]
                   .to(device, torch.bfloat16).requires_grad_(grad) for shape in ((h, d), (d, h), (h, d))]

    def routed(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x (n, d) sorted by expert, counts (E,)) of a new routing."""
        gen = torch.Generator().manual_seed(seed + self.rank)
        ids = torch.randint(0, self.nl * self.world, (self.n,), generator=gen).sort().values
        return (torch.randn(self.n, self.d, generator=torch.Generator().manual_seed(seed)).to(self.device, torch.bfloat16),
                torch.bincount(ids, minlength=self.nl * self.world).to(self.device))

    def a2a(self, x: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
        """a2a with the experts as torchtitan's grouped GEMM runs them (groups padded)."""
        from torch_commopt.kernels.moe.module import padded

        ws = self.ws

        def grouped(rows, per):
            offs = torch.cumsum(per, 0, dtype=torch.int32)
            a = F.silu(torch._grouped_mm(rows, ws[0].transpose(-2, -1), offs=offs))
            return torch._grouped_mm(a * torch._grouped_mm(rows, ws[2].transpose(-2, -1), offs=offs),
                                     ws[1].transpose(-2, -1), offs=offs)

        return expert_parallel(x, counts, padded(grouped), group, "a2a")


def run_sync_free_unsynced(rank: int, world: int, calls: int = 3) -> dict:
    """sync_free in bf16 on this rank's GPU with torch.cuda.set_sync_debug_mode("error") after its
    first call (which fixes the capacity: one host read): `calls` forward and backward passes, a
    new routing each, against a2a's outputs in the same dtype.  {"error": a sync's message or
    "", "rel": the largest relative difference from a2a's output}."""
    from torch_commopt.kernels.moe import sync_free as sf

    group = dist.group.WORLD
    case = _Bf16Experts(rank, world, 3, f"cuda:{torch.cuda.current_device()}", grad=True)
    sf.reset()
    x, counts = case.routed(0)
    sf.sync_free(x, counts, case.ws, group).sum().backward()  # fixes the capacity
    rels, error = [], ""
    for call in range(1, calls + 1):
        x, counts = case.routed(call)
        xr = x.clone().requires_grad_()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = sf.sync_free(xr, counts, case.ws, group)
            out.float().square().sum().backward()
        except RuntimeError as e:
            error = error or str(e)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if not error:
            rels.append(_rel(out.detach().float(), case.a2a(x, counts, group).detach().float()))
    return {"error": error, "rel": max(rels) if rels else float("nan")}


def _captured(run):
    """(graph, its output) of run() captured in a CUDA graph after two calls on a side stream (as
    CUDA graphs ask)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def run_sync_free_graphed(rank: int, world: int, calls: int = 3) -> dict:
    """sync_free's forward (inference) captured once in a CUDA graph on this rank's GPU, replayed on
    `calls` new routings copied into its static inputs: {"same": the replays equal to the eager
    calls bit for bit, "rel": the largest relative difference from a2a's output}."""
    from torch_commopt.kernels.moe import sync_free as sf

    group = dist.group.WORLD
    case = _Bf16Experts(rank, world, 4, f"cuda:{torch.cuda.current_device()}", grad=False)
    ws = case.ws
    sf.reset()
    x, counts = case.routed(0)
    with torch.no_grad():
        graph, out = _captured(lambda: sf.sync_free(x, counts, ws, group))
        same, rels = True, []
        for call in range(1, calls + 1):
            new_x, new_counts = case.routed(call)
            x.copy_(new_x)
            counts.copy_(new_counts)
            graph.replay()
            eager = sf.sync_free(new_x, new_counts, ws, group)
            same = same and torch.equal(out, eager)
            rels.append(_rel(out.float(), case.a2a(new_x, new_counts, group).float()))
    sf.check(group)
    return {"same": same, "rel": max(rels)}


def run_capture_switch(rank: int, world: int, schedule: str = "a2a") -> dict:
    """An installed module (`schedule`) called eagerly, then as inside a CUDA-graph capture
    (sync_free.capturing patched: gloo has none): the captured call runs sync_free with the
    capacity the eager call's counts gave, its output the eager one's; and a capture before any
    eager call raises the reason.  {"diff", "last", "capacity", "peak", "refused"}."""
    from torch_commopt.kernels.moe import sync_free as sf
    from torch_commopt.kernels.moe.module import install

    group = dist.group.WORLD
    full = _weights(world, 5)
    x, ids = _tokens(rank, world, "balanced", 5)
    counts = torch.bincount(ids, minlength=NL * world)
    module = _module([w[rank * NL:(rank + 1) * NL] for w in full])
    install(module, group, schedule)
    real, got = sf.capturing, {}
    try:
        sf.reset()
        sf.capturing = lambda device: True
        try:
            module(x, counts)
            got["refused"] = ""
        except RuntimeError as e:
            got["refused"] = str(e)
        sf.capturing = real
        eager = module(x, counts)
        got["capacity"], got["peak"] = sf._CAPACITY.get(group.group_name), 30 + 7 * (world - 1)  # noqa: SLF001
        sf.capturing = lambda device: True
        captured = module(x, counts)
        got["last"] = module.forward.last
    finally:
        sf.capturing = real
    got["diff"] = (captured - eager).abs().max().item()
    return got


def run_module_graphed(rank: int, world: int, calls: int = 3) -> dict:
    """A module installed with a2a, called eagerly (its capacity for a capture), then its forward
    captured in a CUDA graph (it runs sync_free there) and replayed on new routings:
    {"last": the schedule the captured call ran, "rel": the replays' largest relative difference
    from a2a's output}."""
    from torch_commopt.kernels.moe import sync_free as sf
    from torch_commopt.kernels.moe.module import install

    group = dist.group.WORLD
    case = _Bf16Experts(rank, world, 6, f"cuda:{torch.cuda.current_device()}", grad=False)
    module = _module(case.ws, grad=False)
    install(module, group, "a2a")
    sf.reset()
    x, counts = case.routed(0)
    with torch.no_grad():  # the eager warm-up runs a2a, whose exchanged peak sizes the capture
        graph, out = _captured(lambda: module(x, counts))
        rels = []
        for call in range(1, calls + 1):
            new_x, new_counts = case.routed(call)
            x.copy_(new_x)
            counts.copy_(new_counts)
            graph.replay()
            rels.append(_rel(out.float(), case.a2a(new_x, new_counts, group).float()))
    sf.check(group)
    return {"last": module.forward.last, "rel": max(rels)}


def run_sync_free_shapes(rank: int, world: int) -> list[tuple[str, float]]:
    """sync_free against a2a (output, x's and the weights' gradients, float64) over routings of
    every kind: 1, 2 and 5 local experts, groups padded to 1 and 8 rows, ranks routing nothing,
    every row to one expert, a capacity well above the rows; [(case, largest relative error)]."""
    from torch_commopt.kernels.moe import sync_free as sf

    group, out = dist.group.WORLD, []
    for nl in (1, 2, 5):
        for align in (1, 8):
            for kind in ("random", "one expert", "nothing on rank 0"):
                sf.reset()
                if kind == "random":
                    sf.set_capacity(group, 200)  # above every rank's rows
                g = torch.Generator().manual_seed(17 * nl + align + len(kind) + 1000 * rank)
                n = 0 if (kind == "nothing on rank 0" and rank == 0) else int(torch.randint(1, 40, (1,), generator=g))
                ids = (torch.randint(0, nl * world, (n,), generator=g) if kind != "one expert"
                       else torch.full((n,), nl * world - 1)).sort().values
                full = _weights_of(nl, world, 23 * nl)
                x = torch.randn(n, D, generator=g, dtype=torch.float64)
                counts = torch.bincount(ids, minlength=nl * world)
                grads = []
                for schedule in ("a2a", "sync_free"):
                    local = [w[rank * nl:(rank + 1) * nl].clone().requires_grad_() for w in full]
                    xr = x.clone().requires_grad_()
                    y = (expert_parallel(xr, counts, _local_experts(*local), group, "a2a") if schedule == "a2a"
                         else sf.sync_free(xr, counts, local, group, align=align))
                    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).cos()).sum().backward()
                    grads.append([y.detach(), xr.grad] + [w.grad for w in local])
                errs = [_rel(a, b) for a, b in zip(grads[1], grads[0])]
                out.append((f"nl {nl} align {align} {kind} rank {rank}", max(errs)))
    return out


def _weights_of(nl: int, world: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    e = nl * world
    return [torch.randn(e, H, D, generator=g, dtype=torch.float64) / D ** 0.5,
            torch.randn(e, D, H, generator=g, dtype=torch.float64) / H ** 0.5,
            torch.randn(e, H, D, generator=g, dtype=torch.float64) / D ** 0.5]
