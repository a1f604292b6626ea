"""Per-rank programs checking every GPU schedule against its reference twin and NCCL + torch.mm.

Every rank draws the same global tensors from a shared seed (fresh per case) and keeps its
shard, so the float64 truth is computed locally.  Errors are relative Frobenius norms
against that truth; a GPU schedule passes when its error is within the tolerance of the
worse of its reference twin's and NCCL sequential's own errors (validate.within_tolerance).
Outputs are allocated where NaN was just freed, so an unwritten element shows as NaN.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import torch_commopt  # noqa: F401  (registers the ops)
from torch_commopt.core.schedule import Schedule

AG_SCHEDULES = ["local_first", "ce_push:1", "ce_push:3", "ce_push:1:par=1", "ce_push:3:par=1", "ce_push:1:gemm=whole",
                "ce_push:2:gemm=whole", "fused:1", "fused:4", "fused:2:bk=64,bm=64,bn=128,stages=3,warps=4", "fused:1:tma=1",
                "fused:3:tma=1", "fused:2:flat=0,tma=1", "fused:1:impl=sm90", "fused:3:impl=sm90"]
RS_SCHEDULES = ["ce_push:1", "ce_push:3", "ce_pull:1", "ce_pull:3", "direct:1", "direct:2", "fused:2:store=direct",
                "fused:3:store=ce",
                "fused:1:bm=64,bn=128,store=ce,warps=4", "fused:2:store=direct,tma=1", "fused:1:store=ce,tma=1",
                "fused:2:impl=sm90,store=direct", "fused:3:impl=sm90,store=ce"]
AR_SCHEDULES = ["ce_push:2", "ce_pull:2", "direct:1", "direct:3"]

# (shard shape, gather dim, weight widths, bias, return_gathered)
AG_CASES = [
    ((128, 512), 0, [384], False, False),       # M_global 256
    ((1024, 1024), 0, [1024], True, False),     # M_global 2048
    ((500, 520), 0, [300], False, True),        # nothing a tile multiple
    ((2, 96, 256), 1, [320, 64, 64], True, False),  # 3-D, gather dim 1, q/k/v-like
    ((64, 3, 256), 0, [200, 200], False, True),  # 3-D, gather dim 0, w1/w3-like
    ((4, 48, 256), 1, [192, 128], False, True),  # batch 4, gather dim 1 (SP): strided row blocks, gathered kept
]
# (full A shape, scatter dim, N, bias, reduce op)
RS_CASES = [
    ((256, 512), 0, 384, False, "sum"),
    ((2048, 1024), 0, 1024, True, "sum"),
    ((1002, 520), 0, 300, False, "avg"),
    ((2, 192, 256), 1, 320, False, "sum"),
    ((4, 50, 136), 0, 72, True, "avg"),
    ((1200, 520), 0, 300, True, "sum"),         # rows that split 2, 3 and 4 ways, no tile multiple
    ((4, 96, 256), 1, 192, True, "avg"),        # batch 4, scatter dim 1 (SP): strided row blocks of A
]
AR_CASES = [((256, 512), 384, False), ((1002, 520), 300, True), ((2, 96, 256), 200, False)]


def _group_name() -> str:
    return dist.group.WORLD.group_name


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _poison(nbytes: int) -> None:
    """Free a NaN-filled block so the next allocations likely land on NaNs."""
    torch.full((nbytes // 2 + 1024,), float("nan"), dtype=torch.float16, device="cuda")


def _global(seed: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _compare(label: str, error_of, schedules) -> list:
    """[(name, GPU schedule's error, worse of its reference twin's and NCCL sequential's)]."""
    seq = error_of("sequential")
    return [(f"{label} {sched}", error_of(sched), max(error_of(str(Schedule.parse(sched).reference_twin())), seq))
            for sched in schedules]


def _ag_case(case, dtype, schedules, seed, rank, world):
    shard_shape, dim, ns, bias, keep = case
    gshape = list(shard_shape)
    gshape[dim] *= world
    full = _global(seed, gshape, dtype)
    shard = full.chunk(world, dim=dim)[rank].contiguous()
    k = shard_shape[-1]
    ws = [_global(seed + 1 + i, (k, n), dtype) / math.sqrt(k) for i, n in enumerate(ns)]
    ws[0] = ws[0].t().contiguous().t()  # a transposed (column-major) weight, as nn.Linear gives
    bs = [_global(seed + 7 + i, (n,), dtype) if bias else None for i, n in enumerate(ns)]
    truth = [full.double() @ w.double() + (b.double() if b is not None else 0) for w, b in zip(ws, bs)]

    def run(sched):
        _poison(sum(t.numel() for t in truth) * 2 + full.numel() * 2)
        return torch.ops.commopt.ag_matmul(shard, ws, bs, dim, world, _group_name(), sched, keep)

    def errors(outs):
        errs = [_rel(o, t) for o, t in zip(outs, truth)]
        if keep:
            errs.append(0.0 if torch.equal(outs[-1], full) else float("inf"))
        return max(errs)

    return _compare(f"ag {shard_shape} dim{dim} n{ns} {dtype}", lambda s: errors(run(s)), schedules)


def _k_parts(a, w, cuts):
    """(a, w, kwargs) of the op for the product a @ w cut along K at `cuts` (K parts, the
    first contiguous, the others strided views of a); cuts=None: (a, w, {})."""
    if not cuts:
        return a, w, {}
    bounds = list(zip((0, *cuts), (*cuts, a.shape[-1])))
    (a0, w0), *more = [(a[..., lo:hi], w[lo:hi]) for lo, hi in bounds]
    return a0.contiguous(), w0, {"more_a": [x for x, _ in more], "more_w": [y for _, y in more]}


def _rs_case(case, dtype, schedules, seed, rank, world, cuts=None):
    a_shape, dim, n, bias, op = case
    k = a_shape[-1]
    a_all = [_global(seed + 100 * r, a_shape, dtype) for r in range(world)]
    w_all = [_global(seed + 100 * r + 1, (k, n), dtype) / math.sqrt(k) for r in range(world)]
    b = _global(seed + 3, (n,), dtype) if bias else None
    total = sum(a.double() @ w.double() for a, w in zip(a_all, w_all))
    if b is not None:
        total = total + world * b.double()
    if op == "avg":
        total = total / world
    truth = total.chunk(world, dim=dim)[rank]

    a, w, parts = _k_parts(a_all[rank], w_all[rank], cuts)

    def run(sched):
        _poison(total.numel() * 2)
        return torch.ops.commopt.matmul_rs(a, w, b, dim, op, world, _group_name(), sched, **parts)

    label = f"rs {a_shape} dim{dim} n{n} {op} {dtype}" + (f" K parts at {cuts}" if cuts else "")
    return _compare(label, lambda s: _rel(run(s), truth), schedules)


def _ar_case(case, dtype, schedules, seed, rank, world, cuts=None):
    a_shape, n, bias = case
    k = a_shape[-1]
    a_all = [_global(seed + 100 * r, a_shape, dtype) for r in range(world)]
    w_all = [_global(seed + 100 * r + 1, (k, n), dtype) / math.sqrt(k) for r in range(world)]
    b = _global(seed + 3, (n,), dtype) if bias else None
    truth = sum(a.double() @ w.double() for a, w in zip(a_all, w_all)) + (world * b.double() if bias else 0)

    a, w, parts = _k_parts(a_all[rank], w_all[rank], cuts)

    def run(sched):
        _poison(truth.numel() * 2)
        return torch.ops.commopt.matmul_ar(a, w, b, "sum", world, _group_name(), sched, **parts)

    label = f"ar {a_shape} n{n} {dtype}" + (f" K parts at {cuts}" if cuts else "")
    return _compare(label, lambda s: _rel(run(s), truth), schedules)


def run_schedule_cases(rank: int, world: int, dtypes: tuple[str, ...] = ("bfloat16", "float16")):
    """[(name, error, reference error)] for every op x case x dtype x GPU schedule."""
    results, seed = [], 1000
    for dtype in (getattr(torch, d) for d in dtypes):
        for case in AG_CASES:
            seed += 17
            results += _ag_case(case, dtype, AG_SCHEDULES, seed, rank, world)
        for case in _splitting(RS_CASES, world):
            seed += 17
            results += _rs_case(case, dtype, RS_SCHEDULES, seed, rank, world)
        for case in AR_CASES:
            seed += 17
            results += _ar_case(case, dtype, AR_SCHEDULES, seed, rank, world)
    # K parts (concat-K's terms multiplied apart; fused concatenates them): the 2-D case of the
    # largest K and the 3-D case of scatter dim 1 among those that split `world` ways (picked by
    # shape, not position: the list's length follows the world -- at world 3 a fixed index
    # ran past its end)
    rs_cases = _splitting(RS_CASES, world)
    two_d = [c for c in rs_cases if len(c[0]) == 2]
    three_d = [c for c in rs_cases if len(c[0]) == 3 and c[1] == 1]
    k_parts = ([(max(two_d, key=lambda c: c[0][-1]), (384,))] if two_d else []) + \
        ([(three_d[0], (64, 96))] if three_d else [])
    assert k_parts, f"no reduce-scatter case splits {world} ways for the K-parts cases"
    for case, cuts in k_parts:
        results += _rs_case(case, torch.bfloat16, RS_SCHEDULES, 91, rank, world, cuts)
    results += _ar_case(AR_CASES[1], torch.bfloat16, AR_SCHEDULES, 92, rank, world, (200,))
    # fp32 through the cuBLAS schedules (fused needs bf16/fp16 and refuses -> sequential)
    results += _ag_case(AG_CASES[1], torch.float32, ["ce_push:2", "fused:2"], 77, rank, world)
    results += _rs_case(_splitting(RS_CASES, world)[1], torch.float32, ["direct:2", "ce_push:2", "ce_pull:2"], 78,
                        rank, world)
    return results


def _splitting(cases, world: int) -> list:
    """The reduce-scatter cases whose scatter dim splits into `world` equal blocks (the op
    refuses the others: tests/kernels/test_reference.py)."""
    return [c for c in cases if (list(c[0][:-1]) + [c[2]])[c[1]] % world == 0]


def run_auto_cases(rank: int, world: int):
    """Schedule `auto` (a region with dynamic rows) called with row counts on both sides of the
    rule's thresholds in one process: [(name, error, reference error)] and the schedules the
    calls resolved to (kernels.auto)."""
    from torch_commopt.kernels.matmul.auto import auto_schedule

    k = n = 4096
    results, picked, seed = [], set(), 4000
    for rows in (8, 2048, 8192):  # per rank: decode-sized, the host-bound band, a long GEMM
        for sched in ("auto:1", "auto:2:graphs=1"):
            seed += 17
            results += _ag_case(((rows, k), 0, [n], False, False), torch.bfloat16, [sched], seed, rank, world)
            results += _rs_case(((world * rows, k), 0, n, False, "sum"), torch.bfloat16, [sched], seed + 5, rank, world)
            results += _ar_case(((world * rows, k), n, False), torch.bfloat16, [sched], seed + 9, rank, world)
            for kind, a_shape, dim in (("ag_matmul", (rows, k), 0), ("matmul_rs", (world * rows, k), 0),
                                       ("matmul_ar", (world * rows, k), None)):
                picked.add(auto_schedule(kind, sched, a_shape, ((k, n),), dim, world, "bfloat16", "cuda"))
    return results, sorted(picked)


def run_alloc_failure(rank: int, world: int):
    """Symmetric allocations of 64 MiB or more fail on the last rank (an injected out-of-memory):
    every rank runs NCCL + cuBLAS for the calls that need such a buffer, and the GPU schedule
    for those a 16 MiB buffer serves.  [(name, error, reference error)] and the warnings the
    ops logged."""
    import logging

    from torch_commopt.kernels.gpu import symm

    allocate = symm.GroupRuntime._empty

    def failing(self, numel, dtype):
        if self.rank == world - 1 and dtype == torch.uint8 and numel >= 64 << 20:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected): tried to allocate {numel >> 20} MiB")
        return allocate(self, numel, dtype)

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    ops_log = logging.getLogger("torch_commopt.kernels.matmul.ops")
    symm.GroupRuntime._empty = failing
    ops_log.addHandler(handler)
    try:
        # a 64 MiB (world 2) buffer: the vote fails; then a 128 MiB one: refused at once
        results = refusal_sequence(rank, world)
    finally:
        symm.GroupRuntime._empty = allocate
        ops_log.removeHandler(handler)
    return results, warnings


def run_back_to_back(rank: int, world: int, calls: int = 120):
    """`calls` interleaved ag/rs/ar calls with no synchronization in between, each on fresh
    inputs, outputs checked only at the end: buffer reuse across calls and ops must not
    corrupt anything.  Returns [(name, error, reference error)]."""
    torch.manual_seed(5 + rank)
    dtype, k, n, m = torch.bfloat16, 512, 384, 256
    plan = ["ag ce_push:2", "rs direct:2", "ag fused:2", "rs fused:2:store=ce", "ar direct:2", "rs ce_push:1",
            "rs fused:1:store=direct", "rs ce_pull:2", "ar ce_pull:1", "ag ce_push:1:gemm=whole", "ag fused:2:tma=1",
            "rs fused:2:store=direct,tma=1"]
    inputs, outs = [], []
    gn = _group_name()
    for i in range(calls):
        op, sched = plan[i % len(plan)].split()
        rows = m + 64 * (i % 3)  # different shapes in one process
        a = _global(9000 + i, (world * rows, k), dtype)
        w = _global(9500 + i, (k, n), dtype) / math.sqrt(k)
        if op == "ag":
            out = torch.ops.commopt.ag_matmul(a.chunk(world)[rank].contiguous(), [w], [None], 0, world, gn, sched, False)[0]
        elif op == "rs":
            wr = _global(9700 + 31 * i + rank, (k, n), dtype) / math.sqrt(k)
            out = torch.ops.commopt.matmul_rs(a, wr, None, 0, "sum", world, gn, sched)
        else:
            wr = _global(9700 + 31 * i + rank, (k, n), dtype) / math.sqrt(k)
            out = torch.ops.commopt.matmul_ar(a, wr, None, "sum", world, gn, sched)
        inputs.append((op, sched, i, a, w))
        outs.append(out)
    torch.cuda.synchronize()
    results = []
    for (op, sched, i, a, w), out in zip(inputs, outs):
        if op == "ag":
            truth = a.double() @ w.double()
        else:
            ws = [_global(9700 + 31 * i + r, (k, n), dtype).double() / math.sqrt(k) for r in range(world)]
            total = sum(a.double() @ wr for wr in ws)
            truth = total.chunk(world)[rank] if op == "rs" else total
        results.append((f"b2b#{i} {op} {sched}", _rel(out, truth), 8e-3))
    return results


def run_debug_timeout(rank: int, world: int):
    """Rank 1 skips a call that rank 0 makes with bounded waits: rank 0 must raise a clear
    error naming the op, rank and chunk (no hang).  Returns rank 0's error message."""
    import os

    os.environ["TORCH_COMMOPT_WAIT_TIMEOUT_S"] = "5"
    a = _global(1, (256, 256), torch.bfloat16)
    w = _global(2, (256, 256), torch.bfloat16)
    gn = _group_name()
    # One good call in debug mode first (both ranks): the bounded path works when peers come.
    torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, gn, "ce_push:2:dbg=1", False)
    dist.barrier()
    message = ""
    if rank == 0:
        try:
            torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, gn, "direct:2:dbg=1")
        except RuntimeError as e:
            message = str(e)
    dist.barrier()
    return message


def run_compiled_models(rank: int, world: int, options: dict, kinds: tuple[str, ...], shape: dict, dtype: str):
    """Compile TP+SP models with commopt on the GPUs: per kind, the errors of every output
    and gradient vs float64 (next to eager's own) and the schedules explain reports."""
    from torch_commopt.testing.validate import check

    out = {}
    for kind in kinds:
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        errors = check(kind, options, shape=shape, dtype=getattr(torch, dtype))
        schedules = [r.schedule for g in torch_commopt.explain().graphs for r in g.rewritten]
        out[kind] = ([(e.name, e.compiled, e.eager) for e in errors], schedules)
    return out


def run_compiled_band(rank: int, world: int, shape: dict, options: dict | None = None):
    """A TP block whose MLP all-reduce falls in the rule's host-bound band, compiled with the rule
    (and `options`): (errors vs float64 next to eager's, the schedules the compile emitted,
    explain notes)."""
    from torch_commopt.testing.validate import check

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    errors = check("tp_block", {"schedule": "auto", **(options or {})}, shape=shape, dtype=torch.bfloat16)
    graphs = torch_commopt.explain().graphs
    return ([(e.name, e.compiled, e.eager) for e in errors], [r.schedule for g in graphs for r in g.regions],
            [n for g in graphs for n in g.notes])


def run_compiled_dynamic(rank: int, world: int, seqs: tuple[int, ...], shape: dict):
    """A TP+SP MLP compiled with dynamic shapes (bf16, the rule) and called with each global
    sequence length: ([(seq, [(name, compiled err, eager err)])], schedules emitted, the
    schedules `auto` resolved to, why the DTensor model was not run or None).  Where torch's
    own inductor cannot compile the DTensor model with symbolic sizes (torch 2.11 on 2x H100:
    "unhashable type: non-nested SymInt" hashing a DTensorSpec in AOTAutograd),
    the same MLP written with funcol collectives (the form DTensor lowers to) runs instead."""
    from torch_commopt.kernels.matmul import auto
    from torch_commopt.testing.validate import build, check_sizes

    skipped = None
    kind = "tp_sp_mlp"
    try:  # torch's own compile first: where it fails, there is nothing of ours to check
        torch._dynamo.reset()
        model, _ = build(kind, torch.bfloat16, 0, dict(shape, seq=seqs[0]))
        plain = torch.compile(model.cuda(), dynamic=True)
        for seq in seqs[:2]:
            _, x = build(kind, torch.bfloat16, 0, dict(shape, seq=seq))
            plain(x.cuda()).float().sum().backward()
    except Exception as e:  # noqa: BLE001 - torch's own failure is reported, not ours
        skipped = f"torch {torch.__version__}'s own inductor fails on the DTensor model: {type(e).__name__}: " + \
            ([line for line in str(e).splitlines() if "Error" in line] or [str(e)[:200]])[0][:200]
        # its one up-projection as wide as SwiGLU's gate + up (one GEMM of N = 2 hidden / W behind
        # the all-gather), so the long sequence's regions are as large as the DTensor model's
        kind, shape = "funcol_mlp", dict(shape, hidden=2 * shape["hidden"])
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    auto.reset()
    per_seq = check_sizes(kind, {"schedule": "auto"}, seqs, shape=shape, dtype=torch.bfloat16)
    schedules = [r.schedule for g in torch_commopt.explain().graphs for r in g.rewritten]
    ran = sorted(set(auto.resolved().values()))
    return [(q, [(e.name, e.compiled, e.eager) for e in errs]) for q, errs in per_seq], schedules, ran, skipped


GRAPH_CASES = [("ag", "ce_push:2"), ("ag", "ce_push:1:par=1"), ("ag", "ce_push:1:gemm=whole"), ("ag", "fused:2"),
               ("ag", "fused:2:tma=1"), ("ag", "fused:2:flat=0,tma=1"), ("rs", "ce_push:2"), ("rs", "direct:1"),
               ("rs", "ce_pull:2"),
               ("ar", "direct:2"), ("ar", "ce_push:1"), ("ar", "ce_pull:1"),
               ("rs", "fused:2:store=direct")]  # inside a capture it runs ce_push:2 (its barrier counts epochs)


def _graph_inputs(op: str, seed: int, rank: int, world: int, m: int, k: int, n: int, dtype):
    """(this rank's input, this rank's weight, float64 truth of this rank's output)."""
    if op == "ag":
        full = _global(seed, (world * m, k), dtype)
        w = _global(seed + 1, (k, n), dtype) / math.sqrt(k)
        return full.chunk(world)[rank].contiguous(), w, full.double() @ w.double()
    a_all = [_global(seed + 100 * r, (world * m, k), dtype) for r in range(world)]
    w_all = [_global(seed + 100 * r + 1, (k, n), dtype) / math.sqrt(k) for r in range(world)]
    total = sum(a.double() @ w.double() for a, w in zip(a_all, w_all))
    return a_all[rank], w_all[rank], (total.chunk(world)[rank] if op == "rs" else total)


def _graph_call(op: str, a, w, sched: str):
    gn, world = _group_name(), dist.get_world_size()
    if op == "ag":
        return torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, gn, sched, False)[0]
    if op == "rs":
        return torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, gn, sched)
    return torch.ops.commopt.matmul_ar(a, w, None, "sum", world, gn, sched)


def run_graph_replay(rank: int, world: int, replays: int = 4, cases=None):
    """Each GPU schedule captured in a CUDA graph (after one eager call that sets up its
    buffers) and replayed on fresh inputs copied into the captured ones, with an eager call
    of another schedule on other data right after every replay and no synchronization in
    between (graph replays and eager calls share buffers and flags); then one graph that
    holds two ops back to back.  A replay takes no new epoch, so every other eager call uses
    the replay's buffer half at another shape: its writes into its own buffer must wait for
    the peer's token, the peer may still be pulling there.  cases: GRAPH_CASES by default.
    Returns [(name, error, reference error)]."""
    dtype, m, k, n = torch.bfloat16, 256, 512, 384
    results, seed = [], 20000
    for op, sched in GRAPH_CASES if cases is None else cases:
        a, w, _ = _graph_inputs(op, seed, rank, world, m, k, n, dtype)
        static_a, static_w = a.clone(), w.clone()
        _graph_call(op, static_a, static_w, sched)  # eager: creates the buffers, compiles kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _graph_call(op, static_a, static_w, sched)
        pending = []
        for rep in range(replays):
            seed += 7
            a, w, truth = _graph_inputs(op, seed, rank, world, m, k, n, dtype)
            a2, w2, truth2 = _graph_inputs(op, seed + 3, rank, world, m + 64, k, n, dtype)
            static_a.copy_(a)
            static_w.copy_(w)
            graph.replay()
            got = out.clone()
            eager = _graph_call(op, a2, w2, "ce_push:1")
            pending += [(f"graph {op} {sched} replay {rep}", got, truth),
                        (f"eager after graph {op} {sched} #{rep}", eager, truth2)]
        torch.cuda.synchronize()
        results += [(name, _rel(x, t), 8e-3) for name, x, t in pending]
        seed += 50
    # Two ops in one graph: an all-gather GEMM feeding a reduce-scatter GEMM.
    x, w1, _ = _graph_inputs("ag", seed, rank, world, m, k, n, dtype)
    w2_all = [_global(seed + 9 + r, (n, k), dtype) / math.sqrt(n) for r in range(world)]
    w2 = w2_all[rank]
    static_x = x.clone()
    chain = lambda: _graph_call("rs", _graph_call("ag", static_x, w1, "ce_push:2"), w2, "direct:2")  # noqa: E731
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for rep in range(replays):
        seed += 11
        full = _global(seed, (world * m, k), dtype)
        static_x.copy_(full.chunk(world)[rank])
        graph.replay()
        torch.cuda.synchronize()
        hidden = (full.double() @ w1.double()).to(dtype).double()
        truth = sum(hidden @ wr.double() for wr in w2_all).chunk(world)[rank]
        results.append((f"graph ag->rs chain replay {rep}", _rel(out, truth), 8e-3))
    return results


def run_compiled_cuda_graphs(rank: int, world: int, calls: int = 5):
    """A TP MLP (all-gather -> matmul, matmul -> reduce-scatter) compiled with
    cuda_graphs=True: Inductor's CUDA-graph trees capture the commopt GPU ops and replay
    them; every call on fresh inputs is checked against eager.  Returns (errors, schedules,
    cudagraph skips)."""
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters

    torch.manual_seed(rank)
    dtype, m, k, h = torch.bfloat16, 512, 512, 1024
    w1 = (torch.randn(k, h // world, device="cuda") / k ** 0.5).to(dtype)
    w2 = (torch.randn(h // world, k, device="cuda") / h ** 0.5).to(dtype)

    def mlp(x):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD)
        return funcol.reduce_scatter_tensor(torch.relu(g @ w1) @ w2, "sum", scatter_dim=0, group=dist.group.WORLD)

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    counters.clear()
    compiled = torch.compile(mlp, backend="commopt", options={"cuda_graphs": True, "schedule": "ce_push", "chunks": 2})
    errors = []
    for i in range(calls):
        x = _global(31000 + 97 * i + rank, (m, k), dtype)
        want = mlp(x).double()
        got = compiled(x).double()
        errors.append((f"cudagraph call {i}", _rel(got, want), 2e-2))
    schedules = [r.schedule for g in torch_commopt.explain().graphs for r in g.rewritten]
    return errors, schedules, sum(counters["inductor"].get(k_, 0) for k_ in counters["inductor"] if "cudagraph_skip" in k_)


def run_compiled_cuda_graphs_short(rank: int, world: int, options: dict, calls: int = 5):
    """A short all-gather -> matmul (M_global 512, K 8192, N 4096 per rank: the rule's replayed
    band, pick.REPLAYED_BAND_CANDIDATES, gemm=whole its fallback) compiled with cuda_graphs=True
    and `options` (the rule, a fixed schedule, mode autotune), run by Inductor's CUDA-graph
    trees; every call on fresh inputs checked against float64 beside eager bf16's own error.
    Returns (errors, schedules, notes, what an autotune placeholder resolved to).  (A first-call
    measurement of this region's candidates inside the trees' warm-up failed their
    check "Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"; the measurement
    now runs on a helper thread.)"""
    import torch.distributed._functional_collectives as funcol

    from torch_commopt.tuner.matmul import autotune

    torch.manual_seed(rank)
    dtype, m, k, n = torch.bfloat16, 512 // world, 8192, 4096
    w = (torch.randn(k, n, device="cuda") / k ** 0.5).to(dtype)

    def proj(x):
        return funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD) @ w

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(proj, backend="commopt", options={"cuda_graphs": True, **options})
    errors = []
    for i in range(calls):
        x = _global(41000 + 89 * i + rank, (m, k), dtype)
        truth = funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD).double() @ w.double()
        errors.append((f"cuda-graph-tree call {i}", _rel(compiled(x), truth), _rel(proj(x), truth)))
    graphs = torch_commopt.explain().graphs
    schedules = [r.schedule for g in graphs for r in g.rewritten]
    ran = [autotune.decided(Schedule.parse(s)) for s in schedules if s.startswith("autotune")]
    return errors, schedules, [n_ for g in graphs for n_ in g.notes], ran


# Eager calls with cg=1 (kernels/gpu/call_graphs.py): fused:2:store=direct is a reduction that
# cannot be captured (it runs eagerly, logged).
CALL_GRAPH_CASES = [("ag", "ce_push:1"), ("ag", "ce_push:3"), ("ag", "ce_push:1:par=1"), ("ag", "ce_push:1:gemm=whole"),
                    ("ag", "fused:2"), ("ag", "fused:1:tma=1"), ("rs", "ce_push:1"), ("rs", "ce_push:3"),
                    ("rs", "direct:2"), ("rs", "ce_pull:2"), ("ar", "ce_push:2"), ("ar", "ce_pull:2"), ("ar", "direct:1"),
                    ("rs", "fused:2:store=direct")]


def run_call_graphs(rank: int, world: int, calls: int = 8, eager_ranks: tuple[int, ...] = ()):
    """Each schedule with cg=1 called `calls` times on fresh inputs copied into two alternating
    input sets (so each set's calls recur at fixed addresses: captured at the second sighting
    per buffer half, replayed after), each output cloned and freed before the next call (its
    block comes back), with an eager call of another schedule on other shapes between calls and
    no synchronization until the end.  Ranks in `eager_ranks` never replay
    (TORCH_COMMOPT_CALL_GRAPHS=0): replays on one rank must agree with eager calls on another.
    Returns ([(name, error, reference error)], this rank's call_graphs.stats())."""
    import os

    from torch_commopt.kernels.gpu import call_graphs, symm

    if rank in eager_ranks:
        os.environ[call_graphs.ENV] = "0"
    debug_env = os.environ.pop(symm.DEBUG_ENV, None)  # bounded waits never replay (device_run.sh sets them)
    dtype, m, k, n = torch.bfloat16, 256, 512, 384
    pending, seed = [], 40000
    for op, sched in CALL_GRAPH_CASES:
        cg = str(Schedule.parse(sched).with_params(cg=1))
        sets = []
        for _ in range(2):
            a, w, _ = _graph_inputs(op, seed, rank, world, m, k, n, dtype)
            sets.append((a.clone(), w.clone()))
            seed += 3
        # Drawn first, so that nothing but the calls allocates between them; the eager calls
        # between take 2048 more rows (blocks from the large pool, not the small one the cg
        # call's output comes from).
        fresh = [(_graph_inputs(op, seed + 5 * i, rank, world, m, k, n, dtype),
                  _graph_inputs(op, seed + 5 * i + 1, rank, world, m + 2048, k, n, dtype)) for i in range(calls)]
        seed += 5 * calls
        for i, ((a, w, truth), (a2, w2, truth2)) in enumerate(fresh):
            static_a, static_w = sets[i % 2]
            static_a.copy_(a)
            static_w.copy_(w)
            out = _graph_call(op, static_a, static_w, cg)
            got = out.clone()
            del out
            other = _graph_call(op, a2, w2, "ce_push:1")
            pending += [(f"cg {op} {sched} call {i}", got, truth), (f"eager between cg {op} {sched} #{i}", other, truth2)]
    torch.cuda.synchronize()
    results = [(name, _rel(x, t), 8e-3) for name, x, t in pending]
    stats = call_graphs.stats()
    call_graphs.reset()
    os.environ.pop(call_graphs.ENV, None)
    if debug_env is not None:
        os.environ[symm.DEBUG_ENV] = debug_env
    return results, stats


def refusal_sequence(rank: int, world: int) -> list:
    """A small all-gather (the 16 MiB class), a reduce-scatter needing a 64 MiB buffer at world 2,
    an all-gather needing 128 MiB, a small reduce-scatter (the 16 MiB class again): the calls the
    allocation-refusal tests run, each checked against its reference."""
    bf16, results = torch.bfloat16, []
    results += _ag_case(((256, 1024), 0, [512], False, False), bf16, ["ce_push:1"], 7100, rank, world)
    results += _rs_case(((world * 4096, 4096), 0, 2048, False, "sum"), bf16, ["ce_push:2"], 7300, rank, world)
    results += _ag_case(((4096, 4096), 0, [1024], False, False), bf16, ["ce_push:1"], 7200, rank, world)
    results += _rs_case(((world * 128, 1024), 0, 512, False, "sum"), bf16, ["ce_push:1"], 7400, rank, world)
    return results
