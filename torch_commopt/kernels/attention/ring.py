"""Ring attention: K/V travel one peer per step, each rank merges its partials by lse.

Step i of rank p (group of n ranks) holds the K/V block of rank (p - i) mod n.  The step
loop issues the transfer of step i+1's block before computing on step i's (RingShift), so
the transfer hides behind the compute.  Which part of the block a rank computes is a
`Plan`: a list of (query slice, key slice, mask) per step.

    contiguous layout (ring):  source s == p: the diagonal block, causal; s < p: full;
        s > p: skipped under causal (the block still travels on).  Rank n-1 does n blocks of
        work, rank 0 one half-block: the causal imbalance zigzag removes.
    zigzag layout: rank p holds chunks p and 2n-1-p (each of c tokens).  s == p: causal over
        both chunks (the local order is the global order); s < p: all queries against the
        source's first chunk; s > p: the second query chunk against both of the source's
        chunks.  Every step but the first is c x 2c keys: balanced.
    zigzag queries, contiguous keys (zigzag_q_plan, not used by a schedule): the queries as
        in the zigzag layout, K/V as the program holds them (rank s: chunks 2s and 2s+1), so
        only the query side would be relaid (K/V go round the ring anyway): half the bytes.
        Per (query chunk a, key chunk b): full if b < a, the causal diagonal if b == a,
        nothing if b > a.  Totals balanced, single steps not (world 2: 0.625 / 0.375 and
        0.125 / 0.875 of an S_loc^2 block).  On an H200 at 8K tokens/GPU, world 2, its four
        smaller blocks per rank cost 12% more compute than zigzag's two (causal fwd+bwd, MHA),
        more than the relayout bytes it saves, so ring_zigzag relays q, k, v
        (docs/context-parallel-attention.md, "Measurements behind the constants").

Backward (given the global out and lse): K/V travel as in the forward, and their gradient
sums travel one step behind them; after n sends each is back at its owner.  The sums are
accumulated in fp32; a hop travels in the inputs' half dtype only where that loses nothing
(`GradRing`): while it holds a single term as the kernel gave it (bf16), and on the last hop,
which carries the final sum rounded as its owner would round it.  At world 2 that is every
hop: half the bytes, no fp32 conversions, and the same bits as an fp32 ring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from torch_commopt.kernels.attention import comm
from torch_commopt.kernels.attention.local import Saved, acc_dtype, attend_bwd, attend_fwd
from torch_commopt.kernels.attention.merge import Accumulator

Block = tuple[slice, slice, str]  # (query slice, key slice, mask) along the sequence dim
Plan = Callable[[int, int, int, int], list[Block]]  # (rank, source, n, S_loc) -> blocks
ALL = slice(None)
KV_TAG, DKV_TAG = 0, 1  # dK and dV go as tags DKV_TAG and DKV_TAG + 1


def contiguous_plan(causal: bool) -> Plan:
    """Blocks of the contiguous layout (rank p holds tokens [p*S_loc, (p+1)*S_loc))."""
    def plan(p: int, s: int, n: int, length: int) -> list[Block]:
        if not causal:
            return [(ALL, ALL, "full")]
        if s == p:
            return [(ALL, ALL, "causal")]
        return [(ALL, ALL, "full")] if s < p else []
    return plan


def zigzag_plan(causal: bool) -> Plan:
    """Blocks of the zigzag layout (rank p holds chunks p and 2n-1-p, c = S_loc / 2 each)."""
    def plan(p: int, s: int, n: int, length: int) -> list[Block]:
        c = length // 2
        if not causal:
            return [(ALL, ALL, "full")]
        if s == p:
            return [(ALL, ALL, "causal")]
        if s < p:
            return [(ALL, slice(0, c), "full")]
        return [(slice(c, length), ALL, "full")]
    return plan


def zigzag_q_plan(causal: bool) -> Plan:
    """Blocks of zigzag queries against contiguous K/V (see the module docstring): rank p's
    query chunks p and 2n-1-p (local rows [0, c) and [c, 2c)) against source s's key chunks
    2s and 2s+1; a query chunk that sees both key chunks in full takes them as one block."""
    def plan(p: int, s: int, n: int, length: int) -> list[Block]:
        if not causal:
            return [(ALL, ALL, "full")]
        c = length // 2
        halves = (slice(0, c), slice(c, length))
        blocks = []
        for a, qs in zip((p, 2 * n - 1 - p), halves):
            masks = ["full" if b < a else "causal" if b == a else "" for b in (2 * s, 2 * s + 1)]
            if masks == ["full", "full"]:
                blocks.append((qs, ALL, "full"))
            else:
                blocks += [(qs, ks, mask) for mask, ks in zip(masks, halves) if mask]
        return blocks
    return plan


def block_fractions(plan: Plan, n: int, length: int = 4) -> list[list[float]]:
    """Per rank, per ring step: the share of a full S_loc x S_loc block that `plan` computes
    (a causal diagonal block counts half): what the cost model charges each step."""
    def area(qs: slice, ks: slice, mask: str) -> float:
        rows = len(range(length)[qs]) * len(range(length)[ks]) / length ** 2
        return rows / 2 if mask == "causal" else rows
    return [[sum(area(*blk) for blk in plan(p, (p - i) % n, n, length)) for i in range(n)] for p in range(n)]


def _seq(x: Tensor, sl: slice) -> Tensor:
    return x[:, :, sl]


class GradRing:
    """dK/dV sums of the K/V blocks on their way round the ring (ring_bwd), one step behind
    the blocks: at step i rank p adds its terms to block s = (p - i) mod n's sums and sends
    them on; after step n-1 they reach their owner s.  Sums are formed in the acc dtype; the
    message leaving step i travels in the inputs' dtype (`half`) where that is lossless:

        i == n - 1: the final sum, rounded as the owner would round it;
        at most one term so far, and the terms come as the kernel's half-precision output
            (its fp32 value is that half value exactly);
        otherwise the acc dtype.

    Every rank computes every block's dtypes from the plan (the number of terms each rank
    adds at each step) and from its own first term's dtype: the first step's block (s == p)
    is the same shape, mask and backend on every rank, hence the same output dtype."""

    def __init__(self, plan: Plan, n: int, length: int, like: tuple[Tensor, Tensor], group: comm.Group) -> None:
        self.n, self.group, self.like = n, group, like
        self.half, self.acc = like[0].dtype, acc_dtype(like[0].dtype)
        # terms[s][i]: how many block gradients block s's sums hold after step i
        self.terms = [[0] * n for _ in range(n)]
        for s in range(n):
            total = 0
            for i in range(n):
                total += len(plan((s + i) % n, s, n, length))
                self.terms[s][i] = total
        self.term_dtype: Optional[torch.dtype] = None
        self.pending: Optional[Callable[[], list[Tensor]]] = None

    def dtype(self, s: int, i: int) -> torch.dtype:
        """The dtype of block s's sums as they leave step i."""
        if i == self.n - 1 or (self.terms[s][i] <= 1 and self.term_dtype == self.half):
            return self.half
        return self.acc

    def step(self, i: int, s: int, incoming: Optional[list[Tensor]],
             terms: list[tuple[slice, tuple[Tensor, Tensor]]]) -> list[Tensor]:
        """Block s's sums after step i: `incoming` (None at step 0: nothing yet) plus this
        rank's terms [(key slice, (dk, dv))], in dtype(s, i)."""
        if i == 0 and self.term_dtype is None:
            self.term_dtype = terms[0][1][0].dtype if len(terms) == 1 else self.acc
        out = self.dtype(s, i)
        if incoming is None and len(terms) == 1 and terms[0][0] == ALL:
            return [g.to(out).contiguous() for g in terms[0][1]]  # handed over as the kernel gave it
        if incoming is not None and incoming[0].dtype == out and (out == self.acc or len(terms) <= 1):
            sums = incoming  # in place: in the acc dtype, or one term and one rounding
        elif incoming is not None:
            sums = [t.to(self.acc) for t in incoming]
        else:
            sums = [torch.zeros_like(t, dtype=self.acc) for t in self.like]
        for ks, grads in terms:
            for total, g in zip(sums, grads):
                _seq(total, ks).add_(g)
        return [t.to(out) for t in sums]

    def send(self, sums: list[Tensor], s: int, i: int) -> None:
        """Send block s's sums (leaving step i) to the next rank; receive block s - 1's."""
        prev = (s - 1) % self.n
        self.pending = comm.ring_pass(sums, [(t.shape, self.dtype(prev, i)) for t in self.like], self.group,
                                      DKV_TAG)

    def receive(self) -> list[Tensor]:
        got, self.pending = self.pending(), None
        return got


class LocalSum:
    """A rank-local gradient (dq) summed over blocks along the sequence dim.  The first term
    covering all rows is kept as the kernel gave it (handed over: no copy or zero fill); a
    half-precision sum takes its last term in place (fp32 math, one rounding: what summing
    in the acc dtype and rounding at the end gives) and converts to the acc dtype before any
    other term.  With two terms (a ring of two) that is one pass instead of three."""

    def __init__(self, like: Tensor, acc: torch.dtype) -> None:
        self.like, self.acc, self.sum = like, acc, None

    def add(self, sl: slice, grad: Tensor, last: bool) -> None:
        if self.sum is None and sl == ALL and grad.is_contiguous():
            self.sum = grad
            return
        if self.sum is None:
            self.sum = torch.zeros_like(self.like, dtype=self.acc)
        elif self.sum.dtype != self.acc and not last:
            self.sum = self.sum.to(self.acc)
        _seq(self.sum, sl).add_(grad)

    def result(self, dtype: torch.dtype) -> Tensor:
        return torch.zeros_like(self.like, dtype=dtype) if self.sum is None else self.sum.to(dtype)


def _final(steps: list[list[Block]]) -> tuple[int, int]:
    """(step, index) of the last block of a rank's plan (every block adds to its sums)."""
    i = max((i for i, blocks in enumerate(steps) if blocks), default=-1)
    return i, len(steps[i]) - 1 if i >= 0 else -1


def _single_block(plan: Plan, n: int, length: int) -> Optional[str]:
    """The mask of a ring of one whose plan is one block over all rows and keys, else None."""
    if n != 1:
        return None
    blocks = plan(0, 0, 1, length)
    return blocks[0][2] if len(blocks) == 1 and blocks[0][:2] == (ALL, ALL) else None


def ring_fwd(q: Tensor, k: Tensor, v: Tensor, *, scale: float, plan: Plan, group: comm.Group,
             backend: str = "auto") -> tuple[Tensor, Tensor]:
    """q: (B, H, S_loc, D); k, v: (B, H_kv, S_loc, D) this rank's shard of the ring's layout.
    Returns out (B, H, S_loc, D) in q's dtype and lse (B, H, S_loc) in the acc dtype."""
    n, p = comm.size(group), comm.rank(group)
    q = q.contiguous()  # once, not per block: the fused kernels want contiguous operands
    mask = _single_block(plan, n, q.shape[2])
    if mask is not None:  # a ring of one (Ulysses): the accumulator's hand-over without its machinery
        out_b, lse_b = attend_fwd(q, k, v, scale=scale, mask=mask, backend=backend)
        if not (out_b.dtype in (torch.float16, torch.bfloat16) and out_b.is_contiguous()):
            out_b = out_b.to(acc_dtype(q.dtype), memory_format=torch.contiguous_format, copy=True)
        return out_b.to(q.dtype), lse_b.to(acc_dtype(q.dtype)).contiguous()
    acc = Accumulator(q, v.shape[-1], acc_dtype(q.dtype))
    shift = comm.ring_shift([k, v], group, KV_TAG)
    steps = [plan(p, (p - i) % n, n, q.shape[2]) for i in range(n)]
    final = _final(steps)  # the last merge may round into a half-precision accumulator
    for i in range(n):
        k_i, v_i = shift.current()
        if i + 1 < n:
            shift.start()  # step i+1's block travels while step i computes
        for j, (qs, ks, mask) in enumerate(steps[i]):
            acc.add(qs, *attend_fwd(_seq(q, qs), _seq(k_i, ks), _seq(v_i, ks), scale=scale, mask=mask,
                                    backend=backend), last=(i, j) == final)
        if i + 1 < n:
            shift.wait()
    shift.finish()
    out, lse = acc.result()
    return out.to(q.dtype), lse


def ring_bwd(dout: Tensor, saved: Saved, *, scale: float, plan: Plan, group: comm.Group,
             backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ring_fwd given saved = (q, k, v, out, lse), its inputs and (global) out and
    lse; shapes as ring_fwd's.  Returns (dq, dk, dv) in the inputs' dtypes, accumulated in the
    acc dtype."""
    q, k, v, out, lse = saved
    n, p = comm.size(group), comm.rank(group)
    dout, q, out = dout.contiguous(), q.contiguous(), out.to(q.dtype).contiguous()  # once, not per block
    mask = _single_block(plan, n, q.shape[2])
    if mask is not None:  # a ring of one (Ulysses): one block's gradients, as LocalSum and GradRing hand them over
        dq_b, dk_b, dv_b = attend_bwd(dout, Saved(q, k, v, out, lse.contiguous()), scale=scale, mask=mask,
                                      backend=backend)
        dq_b = dq_b if dq_b.is_contiguous() else torch.zeros_like(q, dtype=acc_dtype(q.dtype)).add_(dq_b)
        return _unaliased(dq_b.to(q.dtype), dk_b.to(k.dtype).contiguous(), dv_b.to(v.dtype).contiguous())
    dq = LocalSum(q, acc_dtype(q.dtype))
    kv = comm.ring_shift([k, v], group, KV_TAG)
    steps = [plan(p, (p - i) % n, n, q.shape[2]) for i in range(n)]
    dkv = GradRing(plan, n, q.shape[2], (k, v), group)
    final, incoming = _final(steps), None
    for i in range(n):
        k_i, v_i = kv.current()
        if i + 1 < n:
            kv.start()
        parts = [(qs, ks, attend_bwd(_seq(dout, qs), Saved(_seq(q, qs), _seq(k_i, ks), _seq(v_i, ks), _seq(out, qs),
                                                           _seq(lse, qs).contiguous()),
                                     scale=scale, mask=mask, backend=backend))
                 for qs, ks, mask in steps[i]]
        if i > 0:
            incoming = dkv.receive()  # the sums of the block held now, from the previous rank
        for j, (qs, _, (dq_b, _, _)) in enumerate(parts):
            dq.add(qs, dq_b, last=(i, j) == final)
        sums = dkv.step(i, (p - i) % n, incoming, [(ks, (dk_b, dv_b)) for _, ks, (_, dk_b, dv_b) in parts])
        if n > 1:
            dkv.send(sums, (p - i) % n, i)  # on to the next rank; after step n-1 that is the block's owner
        if i + 1 < n:
            kv.wait()
    kv.finish()
    dk, dv = dkv.receive() if n > 1 else sums
    return _unaliased(dq.result(q.dtype), dk.to(k.dtype), dv.to(v.dtype))


def _unaliased(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors, each copied if its storage is another's (an op's outputs may not alias:
    a kernel may hand out dq, dk, dv as views of one buffer)."""
    out, seen = [], set()
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return tuple(out)
