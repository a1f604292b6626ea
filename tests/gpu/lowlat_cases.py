"""Per-rank programs for the low-latency one-shot all-reduce on GPUs (kernels/gpu/lowlat.py):
every rank regenerates every rank's partials from seeds, so each can check its result against the
reference's very bits (gather_sum: fp32 sums in rank order) without another collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_commopt.kernels.gpu import lowlat, symm
from torch_commopt.kernels.matmul.reference.matmul_reduce import _rank_order_sum


def _partials(call: int, world: int, n: int, dtype, device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(1000 * call + n)
    return [torch.randn(n, generator=gen, device=device).to(dtype) for _ in range(world)]


def run_oneshot(rank: int, world: int, debug: bool, two_shot: bool = False) -> list[str]:
    """Eager calls back to back (sizes from one element to past a block per grid slot, sum and
    avg, bf16 and fp32), then 8 calls captured in one CUDA graph replayed 20 times on fresh
    partials, eager calls between the replays; [failures]."""
    device = torch.device("cuda", torch.cuda.current_device())
    rt = symm.runtime(dist.group.WORLD.group_name, device)
    ll = lowlat.for_runtime(rt)
    bad = []
    call = 0
    # (sizes: one element, tails, each block size, more blocks than the grid, an unaligned length)
    for n in (1, 7, 1000, 4096, 65 * lowlat.MIN_BLOCK + 3, 1 << 20, 70 * lowlat.MAX_BLOCK + 5):
        for dtype in (torch.bfloat16, torch.float32):
            for op in ("sum", "avg"):
                call += 1
                parts = _partials(call, world, n, dtype, device)
                ll.slot((n,), dtype).copy_(parts[rank])
                out = ll.all_reduce(torch.empty(n, dtype=dtype, device=device), op, debug, two_shot)
                if not torch.equal(out, _rank_order_sum(torch.stack(parts), op)):
                    bad.append(f"eager n={n} {dtype} {op}")
    call += 1  # an `out` off 16 bytes (the kernels' unaligned form)
    parts = _partials(call, world, 5000, torch.bfloat16, device)
    ll.slot((5000,), torch.bfloat16).copy_(parts[rank])
    out = ll.all_reduce(torch.empty(5001, dtype=torch.bfloat16, device=device)[1:], "sum", debug, two_shot)
    if not torch.equal(out, _rank_order_sum(torch.stack(parts), "sum")):
        bad.append("eager, out off 16 bytes")
    # captured: the graph copies its input into the slot and reduces, 8 times
    n, dtype = 4096, torch.bfloat16
    ins = [torch.zeros(n, dtype=dtype, device=device) for _ in range(8)]
    outs = [torch.zeros(n, dtype=dtype, device=device) for _ in range(8)]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for i in range(8):  # warm-up outside the capture (eager calls)
            ll.slot((n,), dtype).copy_(ins[i])
            ll.all_reduce(outs[i], "sum", False, two_shot)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(8):
                ll.slot((n,), dtype).copy_(ins[i])
                ll.all_reduce(outs[i], "sum", False, two_shot=two_shot)
    torch.cuda.current_stream(device).wait_stream(stream)
    for replay in range(20):
        parts = [_partials(10_000 + 8 * replay + i, world, n, dtype, device) for i in range(8)]
        for i in range(8):
            ins[i].copy_(parts[i][rank])
        graph.replay()
        for i in range(8):
            if not torch.equal(outs[i], _rank_order_sum(torch.stack(parts[i]), "sum")):
                bad.append(f"replay {replay} call {i}")
        call += 1  # an eager call between replays
        extra = _partials(call, world, 333, dtype, device)
        ll.slot((333,), dtype).copy_(extra[rank])
        if not torch.equal(ll.all_reduce(torch.empty(333, dtype=dtype, device=device), "sum", debug, two_shot),
                           _rank_order_sum(torch.stack(extra), "sum")):
            bad.append(f"eager between replays {replay}")
    torch.cuda.synchronize(device)
    rest = rt.flags[symm.LL_BAR: symm.LL_BAR + 2 * symm.LL_BLOCKS * symm.MAX_WORLD]
    if rest.any():
        bad.append("barrier flags not at rest")
    return bad


def run_matmul_oneshot(rank: int, world: int, schedule: str = "oneshot") -> list[str]:
    """torch.ops.commopt.matmul_ar with schedule oneshot (or twoshot) at decode-sized rows (1, 8, 32; bias; a
    3-D input), against every rank's partial recomputed here and summed as the reference does."""
    import torch_commopt  # noqa: F401  (registers the ops)

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD.group_name
    bad = []
    for rows in (1, 8, 32):
        for with_bias in (False, True):
            gen = torch.Generator(device=device).manual_seed(rows * 10 + with_bias)
            a_all = [torch.randn(rows, 512, generator=gen, device=device).bfloat16() for _ in range(world)]
            w_all = [torch.randn(512, 1024, generator=gen, device=device).bfloat16() for _ in range(world)]
            bias = torch.randn(1024, generator=gen, device=device).bfloat16() if with_bias else None
            parts = [torch.mm(a, w) if bias is None else torch.addmm(bias, a, w) for a, w in zip(a_all, w_all)]
            want = _rank_order_sum(torch.stack(parts), "sum")
            got = torch.ops.commopt.matmul_ar(a_all[rank].view(1, rows, 512), w_all[rank], bias, "sum", world, group,
                                              schedule)
            if not torch.equal(got.view(rows, 1024), want):
                bad.append(f"rows {rows} bias {with_bias}: {(got.view(rows, 1024).float() - want.float()).abs().max()}")
    return bad


def run_small_message_calibration(rank: int, world: int) -> tuple[dict, list[str]]:
    """calibrate._small_message_times on this group: (the table, [failures]).  The low-latency
    schedules are timed at every size, positive, and every rank holds the same table (NCCL's
    capture fails on ranks sharing a GPU over gloo: then it is missing on every rank alike)."""
    from torch_commopt.tuner import calibrate

    device = torch.device("cuda", torch.cuda.current_device())
    table = calibrate._small_message_times(dist.group.WORLD.group_name, world, device, 3)  # noqa: SLF001
    bad = []
    sizes = [float(r * n * 2) for r, n in calibrate.SMALL_MSG_SHAPES]
    for sched in ("oneshot", "twoshot"):
        got = table.get(sched, [])
        if [b for b, _ in got] != sizes or not all(0 < t < 0.01 for _, t in got):
            bad.append(f"{sched}: {got}")
    tables = [None] * world
    dist.all_gather_object(tables, table)
    if any(t != tables[0] for t in tables):
        bad.append(f"tables differ across ranks: {tables}")
    return table, bad


def run_compiled_decode_projection(rank: int, world: int, calls: int = 6) -> tuple[list[str], list[str], list[str]]:
    """A row-parallel projection at decode rows (matmul -> all-reduce of 8 x 4096 bf16, 64 KiB),
    compiled with backend commopt and mode="reduce-overhead": the rule leaves the region to a
    first-call measurement of NCCL, oneshot and twoshot as replays (pick.LOWLAT_CANDIDATES), and
    Inductor's CUDA-graph trees replay the winner; each call on fresh inputs is checked against
    every rank's partial recomputed here and summed in rank order.  Returns ([failures], notes,
    what the placeholder resolved to)."""
    import torch_commopt
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.matmul import autotune

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(7)
    w_all = [(torch.randn(512, 4096, generator=gen, device=device) / 512 ** 0.5).bfloat16() for _ in range(world)]
    group = dist.group.WORLD

    def proj(x):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x @ w_all[rank], "sum", group)

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(proj, backend="commopt", mode="reduce-overhead")
    bad = []
    for i in range(calls):
        g = torch.Generator(device=device).manual_seed(100 + i)
        xs = [torch.randn(8, 512, generator=g, device=device).bfloat16() for _ in range(world)]
        got = compiled(xs[rank]).clone()
        parts = torch.stack([x @ w for x, w in zip(xs, w_all)])
        want = _rank_order_sum(parts, "sum")
        ref_err = (parts.double().sum(0) - want.double()).abs().max().item()  # the bf16 cast's own error
        err = (got.double() - parts.double().sum(0)).abs().max().item()
        if err > 2 * ref_err + 1e-6:
            bad.append(f"call {i}: error {err:.3e} vs the reference's {ref_err:.3e}")
    graphs = torch_commopt.explain().graphs
    schedules = [r.schedule for g in graphs for r in g.rewritten]
    ran = [autotune.decided(Schedule.parse(s)) for s in schedules if s.startswith("autotune")]
    return bad, [n for g in graphs for n in g.notes], ran


def run_captures_while_watched(rank: int, world: int, rounds: int = 300) -> list[str]:
    """Production waits with a short bound (the watchdog polls every 0.1 s and, once a low-latency
    call registered its runtime, copies its status words at each poll): CUDA graphs of one-shot
    all-reduces captured and replayed back to back, in the default (global) capture mode, while the
    watchdog's thread polls.  Every capture must succeed (a CUDA call of that thread during a
    capture invalidated it) and every replay give the reference's bits; [failures]."""
    import os

    from torch_commopt.core import env

    os.environ.pop(env.DEBUG_WAITS, None)
    os.environ[env.WAIT_TIMEOUT_S] = "2"
    device = torch.device("cuda", torch.cuda.current_device())
    ll = lowlat.for_runtime(symm.runtime(dist.group.WORLD.group_name, device))
    n, dtype = 4096, torch.bfloat16
    src, out = torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
    ll.slot((n,), dtype).copy_(src)
    ll.all_reduce(out, "sum", False)  # eager: the runtime is now watched
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    bad = []
    for i in range(rounds):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                ll.slot((n,), dtype).copy_(src)
                ll.all_reduce(out, "sum", False)
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            return bad + [f"capture {i}: {type(e).__name__}: {e}"[:300]]
        parts = _partials(50_000 + i, world, n, dtype, device)
        src.copy_(parts[rank])
        graph.replay()
        torch.cuda.current_stream(device).wait_stream(stream)
        if not torch.equal(out, _rank_order_sum(torch.stack(parts), "sum")):
            bad.append(f"replay {i}")
    return bad
