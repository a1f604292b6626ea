"""Per-rank programs: every context-parallel schedule on a live group against eager full attention.

Every rank draws the same global q, k, v, dout (float64, fresh per case) and keeps its
contiguous shard, so the truth is computed locally: F.scaled_dot_product_attention on the
whole sequence in float64 (autograd for the gradients).  A schedule's error is compared with
eager's own error in the case's dtype against that truth (validate.within_tolerance).

Besides the numbers, each case records what this rank sent (`Traffic`, at the boundary of
kernels/attention/comm.py and the collectives) and compares it with what the schedule should send:
K/V with their H_kv heads only (never expanded for GQA), dK/dV sums in the accumulation
dtype except where a half-precision hop is lossless (ring.GradRing), the number of ring steps
of the schedule's ring degree.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_commopt.core.attention_spec import CPSchedule, refusal
from torch_commopt.kernels.attention import comm, local, schedules
from torch_commopt.kernels.attention.local import acc_dtype
from torch_commopt.kernels.attention.ops import cp_attention
from torch_commopt.kernels.attention.ring import GradRing, contiguous_plan, ring_bwd, ring_fwd, zigzag_plan
from torch_commopt.kernels.attention.schedules import CPOptions, cp_attention_bwd, cp_attention_fwd
from torch_commopt.testing.validate import rel_err


def hybrids(world: int) -> list[str]:
    """Every Ulysses x ring factorization of the world (hybrid:1:W ... hybrid:W:1)."""
    return [f"hybrid:{u}:{world // u}" for u in range(1, world + 1) if world % u == 0]


def split_heads(world: int) -> int:
    """Heads that an all-to-all over the world splits into two head groups per rank (16, or
    4W where 2W does not divide 16)."""
    return 16 if 16 % (2 * world) == 0 else 4 * world


def ulysses_hybrid(world: int) -> str:
    """The hybrid with the smallest all-to-all degree > 1 (hybrid:2:W/2, or hybrid:3:1 at 3)."""
    return next(h for h in hybrids(world) if not h.startswith("hybrid:1:"))


@dataclass(frozen=True)
class Case:
    schedule: str
    causal: bool
    heads: tuple[int, int]  # (H, H_kv)
    seq_local: int = 8
    head_dim: int = 64
    v_dim: Optional[int] = None  # None: head_dim
    batch: int = 2
    dtype: torch.dtype = torch.float32
    scale: Optional[float] = None

    @property
    def dv(self) -> int:
        return self.v_dim or self.head_dim

    def label(self) -> str:
        extra = "".join(f" {k}={getattr(self, k)}" for k in ("v_dim", "scale") if getattr(self, k) is not None)
        return (f"{self.schedule} causal={self.causal} heads={self.heads} S_loc={self.seq_local} "
                f"D={self.head_dim} B={self.batch} {self.dtype}{extra}")


def schedule_names(world: int) -> list[str]:
    return ["allgather", "ring", "ring_zigzag", "ulysses", "ulysses:early"] + hybrids(world)


def _gqa_heads(schedule: str, world: int) -> tuple[int, int]:
    """GQA heads the schedule takes: (4, 2), else (2U, U) for its all-to-all degree U (the
    Ulysses degree: 4 gives (8, 4), 3 gives (6, 3))."""
    for heads in [(4, 2)] + [(2 * u, u) for u in range(2, world + 1)]:
        if refusal(schedule, (1, heads[0], heads[1], 2 * world, 8), world, True) is None:
            return heads
    raise ValueError(f"no GQA heads for {schedule} at world {world}")


def cases(world: int) -> list[Case]:
    """Every schedule x mask x head dim (64, 128) with GQA; per schedule the shortest length it
    takes and an odd one (even for zigzag's causal split); then one-off variations: MHA, MQA,
    Dv != D, bfloat16, float64, an explicit scale, batch 1."""
    out = []
    for sched in schedule_names(world):
        heads = _gqa_heads(sched, world)
        out += [Case(sched, c, heads, head_dim=d) for c in (False, True) for d in (64, 128)]
        lengths = (2, 6) if sched == "ring_zigzag" else (1, 5)
        out += [Case(sched, True, heads, seq_local=s, head_dim=32) for s in lengths]
    out += [Case("ring_zigzag", False, (4, 2), seq_local=5, head_dim=32),  # no mask: runs ring, any length
            Case("ring", True, (4, 4)), Case("ulysses", False, (2 * world, 2 * world), head_dim=32),
            Case("ring_zigzag", True, (4, 1)), Case("allgather", True, (4, 1), head_dim=32),
            Case("ring", True, (4, 2), v_dim=32), Case("ulysses", True, _gqa_heads("ulysses", world), v_dim=48),
            Case("ring_zigzag", True, (4, 2), dtype=torch.bfloat16),
            Case("ulysses", True, _gqa_heads("ulysses", world), dtype=torch.bfloat16),
            Case("allgather", True, (4, 2), dtype=torch.bfloat16, head_dim=32),
            Case(hybrids(world)[-2], True, _gqa_heads(hybrids(world)[-2], world), dtype=torch.float64, head_dim=32),
            Case("allgather", False, (4, 2), dtype=torch.float64, head_dim=32),
            Case("ring", False, (4, 2), scale=0.3, head_dim=32), Case("ring_zigzag", True, (4, 2), batch=1)]
    return out


# ---- traffic ---------------------------------------------------------------------------------

class Traffic:
    """What this rank hands to the network, by kind: "kv" / "dkv" (a ring step's message: K/V,
    or the dK/dV sums), "a2a" (an all-to-all's payload, all destinations, this rank's own piece
    included), "ag" (an all-gather's input), "rs" (a reduce-scatter's input).  Counter of
    (kind, bytes)."""

    def __init__(self) -> None:
        self.sent: Counter = Counter()

    @contextlib.contextmanager
    def record(self):
        originals = (comm.RingShift.start, comm.ring_pass, comm.exchange, schedules.all_gather,
                     schedules.reduce_scatter)
        start, ring_pass, exchange, all_gather, reduce_scatter = originals

        def ring_start(shift):
            if comm.size(shift.group) > 1:
                buf = shift.bufs[shift.cur]
                self.sent["kv", buf.numel() * buf.itemsize] += 1
            return start(shift)

        def ring_pass_(send, *args, **kwargs):
            self.sent["dkv", sum(t.numel() * t.itemsize for t in send)] += 1
            return ring_pass(send, *args, **kwargs)

        def exchange_(send, recv, group, device, **kwargs):
            self.sent["a2a", sum(t.numel() * t.itemsize for pieces in send for t in pieces)] += 1
            return exchange(send, recv, group, device, **kwargs)

        def gather(x, *args, **kwargs):
            self.sent["ag", x.numel() * x.itemsize] += 1
            return all_gather(x, *args, **kwargs)

        def scatter(x, *args, **kwargs):
            self.sent["rs", x.numel() * x.itemsize] += 1
            return reduce_scatter(x, *args, **kwargs)

        comm.RingShift.start, comm.ring_pass, comm.exchange = ring_start, ring_pass_, exchange_
        schedules.all_gather, schedules.reduce_scatter = gather, scatter
        try:
            yield self
        finally:
            (comm.RingShift.start, comm.ring_pass, comm.exchange, schedules.all_gather,
             schedules.reduce_scatter) = originals


def dkv_hop_dtypes(plan, r: int, p: int, half_terms: bool) -> list[bool]:
    """Per ring step i of ring rank p: whether the dK/dV sums it sends travel in the inputs'
    (half) dtype.  The sums leaving step i belong to block s = p - i and hold the terms of
    ranks s..s+i; half where lossless: the last hop (the final sum), or at most one term so
    far when the kernel's terms come in half (`half_terms`)."""
    out = []
    for i in range(r):
        s = (p - i) % r
        terms = sum(len(plan((s + j) % r, s, r, 4)) for j in range(i + 1))
        out.append(i == r - 1 or (terms <= 1 and half_terms))
    return out


def expected_traffic(case: Case, world: int, rank: int = 0, half_terms: bool = False) -> tuple[Counter, ...]:
    """(forward, training forward, backward) messages of a schedule on this case for group rank
    `rank`: K/V of H_kv heads in the input dtype, ring_degree - 1 K/V steps, ring_degree dK/dV
    steps (each in the acc dtype or, where lossless, the input dtype: dkv_hop_dtypes).  A
    schedule that moves its inputs (schedules.moves_inputs) moves q, k, v there and out, lse
    back in the forward; in training it keeps them moved, so its forward moves out alone back
    and its backward dout alone there (and dq, dk, dv back).  half_terms: the local attention
    kernel returns dK/dV in the input dtype (CUDA's fused kernels; math on CPU returns the acc
    dtype)."""
    elt, acc = case.dtype.itemsize, acc_dtype(case.dtype).itemsize
    h, h_kv = case.heads
    rows = case.batch * case.seq_local
    q, out, lse = rows * h * case.head_dim * elt, rows * h * case.dv * elt, rows * h * acc
    kv_numel = rows * h_kv * (case.head_dim + case.dv)
    kv = kv_numel * elt
    sched = CPSchedule.parse(case.schedule)
    if sched.name == "allgather":
        fwd = Counter({("ag", kv): 1})
        return fwd, fwd, Counter({("ag", kv): 1, ("rs", world * kv_numel * acc): 1})
    zigzag = sched.name == "ring_zigzag" and case.causal
    u, r = (1, world) if zigzag else sched.degrees(world)
    fwd, train, bwd = Counter(), Counter(), Counter()
    if zigzag or u > 1:  # relayout / all-to-all there and back
        fwd.update({("a2a", q + kv): 1, ("a2a", out + lse): 1})
        train.update({("a2a", q + kv): 1, ("a2a", out): 1})
        bwd.update({("a2a", out): 1, ("a2a", q + kv): 1})  # dout there, dq, dk, dv back
    if r > 1:
        for counter in (fwd, train, bwd):
            counter["kv", kv] += r - 1
        plan = zigzag_plan(True) if zigzag else contiguous_plan(case.causal)
        for half in dkv_hop_dtypes(plan, r, rank if zigzag else rank // u, half_terms):
            bwd["dkv", kv_numel * (elt if half else acc)] += 1
    return fwd, train, bwd


# ---- numerics --------------------------------------------------------------------------------

def _truth(q, k, v, dout, causal, scale):
    """(out, lse, dq, dk, dv) of full attention in q's dtype, by eager SDPA + autograd."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=scale)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return out.detach(), torch.logsumexp(s.detach(), -1), dq, dk, dv


def _global_inputs(case: Case, world: int, seed: int) -> list[torch.Tensor]:
    h, h_kv = case.heads
    b, s, d, dv = case.batch, case.seq_local * world, case.head_dim, case.dv
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, h, s, d), (b, h_kv, s, d), (b, h_kv, s, dv), (b, h, s, dv)]
    return [torch.randn(*sh, generator=gen, dtype=torch.float64) for sh in shapes]


def run_case(case: Case, seed: int, group) -> tuple[list[tuple[str, float, float]], list[str]]:
    """[(label, schedule's error, eager's error) per tensor], [traffic problems]."""
    rank, world = group.rank(), group.size()
    q, k, v, dout = _global_inputs(case, world, seed)
    truth = _truth(q, k, v, dout, case.causal, case.scale)
    eager = _truth(*(t.to(case.dtype) for t in (q, k, v, dout)), case.causal, case.scale)

    def shard(t):
        return t[:, :, rank * case.seq_local : (rank + 1) * case.seq_local]

    ql, kl, vl = (shard(t).to(case.dtype).requires_grad_(True) for t in (q, k, v))
    kw = dict(schedule=case.schedule, causal=case.causal, scale=case.scale, group=group)
    fwd, bwd = Traffic(), Traffic()
    with fwd.record():
        out, lse = cp_attention_fwd(ql.detach(), kl.detach(), vl.detach(), **kw)
    problems = []
    if (out.dtype, lse.dtype, out.shape, lse.shape) != (case.dtype, acc_dtype(case.dtype), shard(truth[0]).shape,
                                                        out.shape[:3]):
        problems.append(f"{case.label()}: out {out.dtype} {tuple(out.shape)}, lse {lse.dtype} {tuple(lse.shape)}")
    train = Traffic()
    with train.record():
        y = cp_attention(ql, kl, vl, **kw)
    with bwd.record():
        y.backward(shard(dout).to(case.dtype))
    # the dK/dV hops depend on the dtype the local kernel returns: CPU math, the acc dtype; on
    # CUDA the fused kernels' half output, or the acc dtype where GQA heads are folded
    wants = [expected_traffic(case, world, rank, half) for half in ((False, True) if ql.is_cuda else (False,))]
    for phase, name in enumerate(("forward", "training forward", "backward")):
        got = (fwd, train, bwd)[phase].sent
        if all(got != w[phase] for w in wants):
            problems.append(f"{case.label()} {name} sent {dict(got)}, expected "
                            f"{' or '.join(str(dict(w[phase])) for w in wants)}")
    got = [_unshard(t, group) for t in (out, lse, ql.grad, kl.grad, vl.grad)]
    errors = [(f"{case.label()} {n}", rel_err(x, t), rel_err(e, t))
              for n, x, t, e in zip(("out", "lse", "dq", "dk", "dv"), got, truth, eager)]
    return errors, problems


def _unshard(t: torch.Tensor, group) -> torch.Tensor:
    """The whole tensor from every rank's shard (sequence dim 2): errors are measured on the
    whole, as a shard's own norm can be ~0 (the first token's dq under a causal mask is 0)."""
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=2)


def run_cp_cases(rank: int, world: int, seed: int = 0) -> tuple[list[tuple[str, float, float]], list[str]]:
    """Every case of `cases(world)` on the default group: (errors, traffic problems)."""
    return _run_cases(cases(world), seed, dist.group.WORLD)


def _run_cases(case_list: list[Case], seed: int, group) -> tuple[list[tuple[str, float, float]], list[str]]:
    torch.set_num_threads(1)  # W processes share the CI's few cores
    errors, problems = [], []
    for i, case in enumerate(case_list):
        e, p = run_case(case, seed + 1000 * i, group)
        errors += e
        problems += p
    return errors, problems


def run_cp_cases_on_strided_subgroups(rank: int, world: int, seed: int = 0):
    """Every world-2 case on the "cp" dim of a (cp, dp) = (2, world / 2) mesh: the CP groups are
    strided subgroups ({0, 2} and {1, 3} at world 4), whose group ranks are not the global ones
    (the ring's peers, the all-to-alls, the hybrids' own subgroups).  Same results as run_cp_cases."""
    from torch.distributed.device_mesh import init_device_mesh

    group = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "dp"))["cp"].get_group()
    return _run_cases(cases(2), seed, group)


def run_all(rank: int, world: int, seed: int = 0) -> dict:
    """The cases, the refusals and the compiled wrapper in one process group (one spawn)."""
    return {"cases": run_cp_cases(rank, world, seed), "refusals": run_refusals(rank, world),
            "compiled": run_compiled_wrapper(rank, world, seed), "zigzag_layout": run_zigzag_layout(rank, world, seed),
            "head_groups": run_head_groups(rank, world, seed), "grad_ring": run_grad_ring(rank, world, seed),
            "kept": run_kept(rank, world, seed)}


def _half_math_bwd(dout, q, k, v, out, lse, scale, causal):
    """The math backward with its gradients rounded to the inputs' dtype, as CUDA's fused
    kernels return them."""
    return tuple(g.to(q.dtype) for g in local.backends()["math"].bwd(dout, q, k, v, out, lse, scale, causal))


def run_grad_ring(rank: int, world: int, seed: int = 0) -> list[str]:
    """ring_bwd's dK/dV sums with a backend returning bf16 gradients (as the fused kernels
    do): the hops that ring.GradRing sends in bf16 (dkv_hop_dtypes with half terms) and the
    same bits as a ring whose every hop is fp32 (GradRing.dtype forced to the acc dtype).
    Contiguous causal and full, zigzag causal; MHA and GQA.  Returns the problems."""
    local.register(local.LocalBackend("half_math", local.backends()["math"].fwd, _half_math_bwd,
                                      local.backends()["math"].why_not, auto=False))
    group, problems = dist.group.WORLD, []
    gen = torch.Generator().manual_seed(seed + 500)
    for name, plan in (("contiguous causal", contiguous_plan(True)), ("contiguous full", contiguous_plan(False)),
                       ("zigzag", zigzag_plan(True))):
        for h, h_kv in ((4, 4), (4, 2)):
            q, dout = (torch.randn(2, h, 6, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(2, h_kv, 6, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
            kw = dict(scale=0.25, plan=plan, group=group, backend="half_math")
            out, lse = ring_fwd(q, k, v, **kw)
            traffic = Traffic()
            with traffic.record():
                got = ring_bwd(dout, (q, k, v, out, lse), **kw)
            original = GradRing.dtype
            GradRing.dtype = lambda self, s, i: self.acc
            try:
                fp32_ring = ring_bwd(dout, (q, k, v, out, lse), **kw)
            finally:
                GradRing.dtype = original
            label = f"{name} heads {h}/{h_kv}"
            for what, a, b in zip(("dq", "dk", "dv"), got, fp32_ring):
                if a.dtype != b.dtype or not torch.equal(a, b):
                    problems.append(f"{label}: {what} differs from the fp32 ring's ({(a.float() - b.float()).abs().max()})")
            sums = (k.numel() + v.numel())
            want = Counter({("dkv", sums * (2 if half else 4)): 0 for half in (False, True)})
            for half in dkv_hop_dtypes(plan, world, rank, half_terms=True):
                want["dkv", sums * (2 if half else 4)] += 1
            want = +want
            dkv = Counter({key: n for key, n in traffic.sent.items() if key[0] == "dkv"})
            if dkv != want:
                problems.append(f"{label}: dK/dV hops {dict(dkv)}, expected {dict(want)}")
    return problems


def run_head_groups(rank: int, world: int, seed: int = 0) -> dict:
    """ring_zigzag's relayouts and ulysses / hybrid:2:R's all-to-alls pipelined over 2 head
    groups (schedules._pipelined, forced: the CPU shapes are below the automatic thresholds),
    MHA and GQA: forward and backward against full attention, and the forward's all-to-alls:
    two of half the size each way."""
    group, errors, problems = dist.group.WORLD, [], []
    h = split_heads(world)
    runs = [("ring_zigzag", (4, 4)), ("ring_zigzag", (8, 2)), ("ulysses", (h, h)), ("ulysses", (h, h // 2))]
    if world == 4:
        runs.append(("hybrid:2:2", (8, 4)))
    for i, (schedule, heads) in enumerate(runs):
        case = Case(schedule, True, heads, seq_local=4)
        q, k, v, dout = _global_inputs(case, world, seed + 300 + i)
        truth = _truth(q, k, v, dout, True, None)
        eager = _truth(*(t.to(case.dtype) for t in (q, k, v, dout)), True, None)

        def shard(t):
            return t[:, :, rank * case.seq_local:(rank + 1) * case.seq_local].to(case.dtype)
        ql, kl, vl, dl = (shard(t) for t in (q, k, v, dout))
        kw = dict(schedule=schedule, causal=True, group=group)
        one, two = Traffic(), Traffic()
        with one.record():
            schedules.cp_attention_fwd(ql, kl, vl, options=CPOptions(head_groups=1), **kw)
        with two.record():
            out, lse = schedules.cp_attention_fwd(ql, kl, vl, options=CPOptions(head_groups=2), **kw)
        halves = Counter({("a2a", size // 2): 2 * n for (kind, size), n in one.sent.items() if kind == "a2a"})
        got_a2a = Counter({key: n for key, n in two.sent.items() if key[0] == "a2a"})
        if got_a2a != halves or not halves:
            problems.append(f"{schedule} {heads}: forward all-to-alls {dict(got_a2a)}, expected {dict(halves)}")
        dq, dk, dv = schedules.cp_attention_bwd(dl, (ql, kl, vl, out, lse), options=CPOptions(head_groups=2), **kw)
        got = [_unshard(t, group) for t in (out, lse, dq, dk, dv)]
        errors += [(f"{schedule} head groups {heads} {n}", rel_err(x, t), rel_err(e, t))
                   for n, x, t, e in zip(("out", "lse", "dq", "dk", "dv"), got, truth, eager)]
    refused = []
    for schedule, heads in (("ring_zigzag", 3), ("ulysses", 3 * world)):
        try:
            schedules.cp_attention_fwd(*(torch.randn(1, heads, 4, 8) for _ in range(3)), schedule=schedule,
                                       causal=True, group=group, options=CPOptions(head_groups=2))
            refused.append("")
        except ValueError as e:
            refused.append(str(e))
    return {"errors": errors, "problems": problems, "refused": refused, "runs": len(runs)}


def run_kept(rank: int, world: int, seed: int = 0) -> list[str]:
    """The training forms of the schedules that move their inputs (cp_attention_fwd_keep /
    cp_attention_bwd_kept), 1 and 2 head groups, causal and not, MHA and GQA, against the plain
    forward and backward of the same schedule: out, dq, dk, dv bit-identical (the same
    kernels on the same values: the kept tensors are what the plain backward moves again),
    the kept tensors shaped as kept_shapes says, the backward moving dout alone there and
    dq, dk, dv back.  Returns the problems found."""
    torch.set_num_threads(1)
    group, problems = dist.group.WORLD, []
    names = [n for n in schedule_names(world) if schedules.moves_inputs(n, world, True)]
    hs = split_heads(world)
    for i, (schedule, causal, heads, groups) in enumerate(
            (n, c, h, g) for n in names for c in (True, False) for h in ((hs, hs), (hs, hs // 2)) for g in (1, 2)):
        if not schedules.moves_inputs(schedule, world, causal):
            continue  # ring_zigzag without a mask is the ring
        case = Case(schedule, causal, heads, seq_local=4, head_dim=16)
        q, k, v, dout = (t[:, :, rank * 4:(rank + 1) * 4].float() for t in _global_inputs(case, world, seed + 500 + i))
        kw, grouped = dict(schedule=schedule, causal=causal, group=group), CPOptions(head_groups=groups)
        out, lse = schedules.cp_attention_fwd(q, k, v, options=grouped, **kw)
        plain = schedules.cp_attention_bwd(dout, (q, k, v, out, lse), options=grouped, **kw)
        out_k, kept = schedules.cp_attention_fwd_keep(q, k, v, options=grouped, **kw)
        traffic = Traffic()
        with traffic.record():
            grads = schedules.cp_attention_bwd_kept(dout, kept, **kw)
        label = f"{schedule} causal={causal} heads={heads} groups={groups}"
        want = [(shape, dt) for shape, dt in schedules.kept_shapes(schedule, q, k, v, world, groups)]
        if [(tuple(t.shape), t.dtype) for t in kept] != want:
            problems.append(f"{label}: kept {[(tuple(t.shape), t.dtype) for t in kept]}, want {want}")
        if not all(torch.equal(a, b) for a, b in zip((out_k, *grads), (out, *plain))):
            problems.append(f"{label}: the kept form differs from the plain one")
        if groups > 1:  # the same depth named in the schedule: the same call
            named = schedules.cp_attention_fwd_keep(q, k, v, **{**kw, "schedule": f"{schedule}:g={groups}"})
            if not all(torch.equal(a, b) for a, b in zip((named[0], *named[1]), (out_k, *kept))):
                problems.append(f"{label}: {schedule}:g={groups} differs from head_groups={groups}")
        a2a = Counter({key: n for key, n in traffic.sent.items() if key[0] == "a2a"})
        want_a2a = Counter({("a2a", dout.numel() * 4 // groups): groups,
                            ("a2a", (q.numel() + k.numel() + v.numel()) * 4 // groups): groups})
        if a2a != want_a2a:
            problems.append(f"{label}: the kept backward's all-to-alls {dict(a2a)}, expected {dict(want_a2a)}")
    return problems


# ---- a program already sharded zigzag ----------------------------------------------------------

ZIGZAG_LAYOUT_CASES = [Case("ring_zigzag", True, (4, 2), seq_local=6), Case("ring_zigzag", True, (4, 4), seq_local=2,
                                                                            dtype=torch.float64),
                       Case("ring", False, (4, 1), seq_local=4)]


def run_zigzag_layout(rank: int, world: int, seed: int = 0) -> dict:
    """layout="zigzag": each rank holds chunks r and 2W-1-r of the sequence.  ring_zigzag takes a
    causal one as it is (no all-to-all: only ring steps), any schedule a non-causal one; the
    other causal schedules refuse it.  Returns {"errors": [...], "problems": [...], "refused": str}."""
    group, errors, problems = dist.group.WORLD, [], []
    for i, case in enumerate(ZIGZAG_LAYOUT_CASES):
        q, k, v, dout = _global_inputs(case, world, seed + 77 + i)
        truth = _truth(q, k, v, dout, case.causal, case.scale)
        eager = _truth(*(t.to(case.dtype) for t in (q, k, v, dout)), case.causal, case.scale)
        c = case.seq_local // 2

        def shard(t):
            chunks = t.split(c, dim=2)
            return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=2)

        ql, kl, vl = (shard(t).to(case.dtype).requires_grad_(True) for t in (q, k, v))
        kw = dict(schedule=case.schedule, causal=case.causal, scale=case.scale, group=group,
                  options=CPOptions(layout="zigzag"))
        traffic = Traffic()
        with traffic.record():
            y = cp_attention(ql, kl, vl, **kw)
            y.backward(shard(dout).to(case.dtype))
        if any(kind == "a2a" for kind, _ in traffic.sent):
            problems.append(f"{case.label()} zigzag layout: an all-to-all was sent ({dict(traffic.sent)})")
        _, lse = cp_attention_fwd(ql.detach(), kl.detach(), vl.detach(), **kw)
        got = [_unzigzag(t, group) for t in (y, lse, ql.grad, kl.grad, vl.grad)]
        errors += [(f"{case.label()} zigzag layout {n}", rel_err(x, t), rel_err(e, t))
                   for n, x, t, e in zip(("out", "lse", "dq", "dk", "dv"), got, truth, eager)]
    try:
        cp_attention_fwd(*(torch.randn(1, 2, 4, 8) for _ in range(3)), schedule="ring", causal=True, group=group,
                         options=CPOptions(layout="zigzag"))
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"errors": errors, "problems": problems, "refused": refused}


def _unzigzag(t: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence from zigzag shards (rank r: chunks r and 2W-1-r)."""
    world = group.size()
    parts = [torch.empty_like(t.detach().contiguous()) for _ in range(world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    c = t.shape[2] // 2
    chunks = [None] * (2 * world)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * world - 1 - r] = part[:, :, :c], part[:, :, c:]
    return torch.cat(chunks, dim=2)


# ---- refusals --------------------------------------------------------------------------------

def refused_calls(world: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(schedule, q, k) of calls that must be refused: zigzag on an odd local length (2W
    chunks do not divide the sequence), all-to-alls whose degree does not divide the heads."""
    odd = torch.randn(1, 4, 3, 16)  # S_total = 3W: not a multiple of 2W
    bad_heads = torch.randn(1, 2 * world + 1, 4, 16)
    hybrid = ulysses_hybrid(world)
    return [("ring_zigzag", odd, odd), ("ulysses", bad_heads, bad_heads[:, :1]), (hybrid, bad_heads, bad_heads[:, :1]),
            ("ulysses", torch.randn(1, 2 * world, 4, 16), torch.randn(1, world // 2, 4, 16))]


def run_refusals(rank: int, world: int) -> list[tuple[str, str, Optional[str], int]]:
    """Per refused call and entry point: (schedule, entry, ValueError message or None, bytes sent)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    results = []
    for sched, q, k in refused_calls(world):
        calls = {"fwd": lambda: cp_attention_fwd(q, k, k, schedule=sched, causal=True, group=group),
                 "bwd": lambda: cp_attention_bwd(q, (q, k, k, q, q[..., 0]), schedule=sched, causal=True, group=group),
                 "wrapper": lambda: cp_attention(q, k, k, schedule=sched, causal=True, group=group)}
        for entry, fn in calls.items():
            traffic, message = Traffic(), None
            try:
                with traffic.record():
                    fn()
            except ValueError as e:
                message = str(e)
            results.append((sched, entry, message, sum(traffic.sent.values())))
    return results


# ---- the autograd wrapper under torch.compile, and the ops' registrations ---------------------

def run_compiled_wrapper(rank: int, world: int, seed: int = 0) -> list[tuple[str, float, float]]:
    """cp_attention inside torch.compile(fullgraph=True) (aot_eager: the ops' fake impls and
    the autograd.Function traced) against the eager wrapper, forward and backward; then
    torch.library.opcheck of both ops.  Returns (label, compiled error, 0) per tensor and
    raises on an opcheck failure."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    sched = "ring_zigzag" if world == 2 else ulysses_hybrid(world)
    case = Case(sched, True, _gqa_heads(sched, world), head_dim=32)
    q, k, v, dout = (t[:, :, rank * case.seq_local : (rank + 1) * case.seq_local].float()
                     for t in _global_inputs(case, world, seed))

    def fn(q, k, v):  # default group (None): a group *name* would be resolved by c10d, untraceable
        return torch.tanh(cp_attention(q * 1.5, k, v, schedule=case.schedule, causal=True))

    results = []
    for _label, f in (("eager", fn), ("compiled", torch.compile(fn, backend="aot_eager", fullgraph=True))):
        args = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = f(*args)
        out.backward(dout)
        results.append([out.detach()] + [a.grad for a in args])
    errs = [(f"compiled wrapper {n}", rel_err(c, e), 0.0) for n, c, e in zip(("out", "dq", "dk", "dv"), *results)]
    name = group.group_name
    fwd_args = (q, k, v, case.schedule, True, None, world, name, "auto")
    out, lse = torch.ops.commopt.cp_attention_fwd(*fwd_args)
    torch.library.opcheck(torch.ops.commopt.cp_attention_fwd, fwd_args)
    torch.library.opcheck(torch.ops.commopt.cp_attention_bwd, (dout, q, k, v, out, lse) + fwd_args[3:])
    _, *kept = torch.ops.commopt.cp_attention_fwd_keep(*fwd_args)
    torch.library.opcheck(torch.ops.commopt.cp_attention_fwd_keep, fwd_args)
    torch.library.opcheck(torch.ops.commopt.cp_attention_bwd_kept, (dout, *kept) + fwd_args[3:])
    return errs


def run_a2a_votes(rank: int, world: int) -> list[tuple[bool, str]]:
    """peers.vote (the copy-engine transports' agreement) on the default group: one host with peer
    access everywhere; rank 1 on another host; one rank without peer access (every rank must get
    the same answer)."""
    from torch_commopt.kernels.gpu import peers

    group, cpu = dist.group.WORLD, torch.device("cpu")
    return [peers.vote(group, cpu, "node-a", True),
            peers.vote(group, cpu, "node-b" if rank == 1 else "node-a", True),
            peers.vote(group, cpu, "node-a", rank != world - 1)]
