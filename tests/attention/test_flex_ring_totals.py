"""The ring's dK/dV totals over two ranks with sends cut (flex_ring.DirectGrads adopt_own): the own
block's terms become the totals, in the inputs' dtype, and the result is bitwise the fp32 sum's."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torch_commopt.testing.launch import run_distributed

S, BLOCK, D = 1024, 128, 16


def _docs() -> torch.Tensor:
    """Document ids over S tokens; the document 450..700 crosses the two shares' end at 512."""
    docs = torch.zeros(S, dtype=torch.int32)
    for cut in (200, 450, 700):
        docs[cut:] += 1
    return docs


def _ring_grads(rank: int, world: int, lean: bool) -> tuple[list[torch.Tensor], int]:
    """(dq, dk, dv) of this rank's shares by flex_ring's backward in bf16 over a documents mask that
    crosses the shares' end (the whole mask on every rank, so the sends are cut), and how many
    times the own block's terms were adopted.  lean False: the totals summed in fp32 from zeros,
    as before adopt_own."""
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import flex, flex_ring

    gen = torch.Generator().manual_seed(5)
    q, out, dout = (torch.randn(1, 4, S, D, generator=gen).to(torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(1, 2, S, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    lse = torch.randn(1, 4, S, generator=gen)
    docs = _docs()
    mask = create_block_mask(lambda b, h, qi, kv: (docs[qi] == docs[kv]) & (qi >= kv), 1, None, S, S,
                             device="cpu", BLOCK_SIZE=BLOCK)
    blocks, group, length = flex.Blocks.of(mask), dist.group.WORLD, S // world
    mine = slice(rank * length, (rank + 1) * length)
    saved = flex_ring.Saved(*(t[:, :, mine].contiguous() for t in (q, k, v, out)), lse[:, :, mine].contiguous())
    adopted = []
    adopt = flex_ring.DirectGrads.adopt

    def counted(self, gk, gv, keys):
        took = adopt(self, gk, gv, keys) if lean else False
        adopted.append(took)
        return took

    flex_ring.DirectGrads.adopt = counted
    try:
        if lean:
            grads = flex_ring.ring_backward(saved, dout[:, :, mine].contiguous(), blocks, 1 / math.sqrt(D), group)
        else:
            ring = flex_ring.RankBlocks(*flex_ring.steps_of(blocks, world, rank), 1 / math.sqrt(D), rank, world)
            spans = flex_ring.skipping(blocks, world)
            zeros = [torch.zeros(t.shape, dtype=torch.float32) for t in (saved.k, saved.v)]
            shifts = (flex_ring.DirectShift([saved.k, saved.v], group, flex_ring.TAG_KV, spans),
                      flex_ring.DirectGrads(zeros, group, flex_ring.TAG_GRAD, spans))
            grads = flex_ring.backward_blocks(saved, dout[:, :, mine].contiguous(), shifts, ring)
    finally:
        flex_ring.DirectGrads.adopt = adopt
    return list(grads), sum(adopted)


def run_totals(rank: int, world: int) -> dict:
    lean, took = _ring_grads(rank, world, True)
    plain, _ = _ring_grads(rank, world, False)
    return {"adopted": took, "dtypes": [str(g.dtype) for g in lean],
            "equal": [torch.equal(a, b) for a, b in zip(lean, plain, strict=True)],
            "nonzero": [bool(g.abs().sum() > 0) for g in lean]}


def test_two_rank_totals_adopt_the_own_terms_and_equal_the_fp32_sum_bitwise():
    per_rank = run_distributed(run_totals, 2, backend="gloo", timeout_s=300)
    for rank, got in enumerate(per_rank):
        assert got["adopted"] == 1, (rank, got)  # the own block's terms became the totals
        assert got["dtypes"] == ["torch.bfloat16"] * 3, (rank, got)
        assert all(got["nonzero"]), (rank, got)
        assert all(got["equal"]), (rank, got)  # bitwise the fp32 path's sum, rounded once


def run_own_rows(rank: int, world: int) -> dict:
    """flex_ring over two ranks with each rank's own rows' mask (sends not cut): the direct sends of
    whole shares (the default) against the plain ring (TORCH_COMMOPT_ATTENTION_TRANSPORT=ce, which
    keeps it; on a CPU it then runs on gloo), forward and backward, and the bytes each sent (in
    shares of K and V)."""
    import os

    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import comm, flex_ring

    gen = torch.Generator().manual_seed(9)
    q, dout = (torch.randn(1, 4, S, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, S, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    docs = _docs()
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    rows = create_block_mask(lambda b, h, qi, kv: (docs[qi + rank * length] == docs[kv]) & (qi + rank * length >= kv),
                             1, None, length, S, device="cpu", BLOCK_SIZE=BLOCK)
    got, sent = {}, {}
    p2p = comm._p2p  # noqa: SLF001
    for transport in ("auto", "ce"):
        os.environ["TORCH_COMMOPT_ATTENTION_TRANSPORT"] = transport
        sent[transport] = 0

        def counted(sends, recvs, group, transport=transport):
            sent[transport] += sum(t.numel() * t.element_size() for t, _, _ in sends)
            return p2p(sends, recvs, group)

        comm._p2p = counted  # noqa: SLF001
        try:
            qs, ks, vs = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
            out = flex_ring.flex_ring(qs, ks, vs, rows, 1 / math.sqrt(D), dist.group.WORLD)
            out.backward(dout[:, :, mine])
        finally:
            comm._p2p = p2p  # noqa: SLF001
            del os.environ["TORCH_COMMOPT_ATTENTION_TRANSPORT"]
        got[transport] = [out.detach(), qs.grad, ks.grad, vs.grad]
    share = 2 * k[:, :, mine].numel() * k.element_size()  # a rank's K and V in bf16
    return {"equal": [torch.equal(a, b) for a, b in zip(got["auto"], got["ce"], strict=True)],
            "sent": {name: count / share for name, count in sent.items()},
            "dtypes": [str(g.dtype) for g in got["auto"]]}


def test_two_ranks_own_rows_masks_send_whole_shares_directly_and_sum_as_the_ring_does():
    per_rank = run_distributed(run_own_rows, 2, backend="gloo", timeout_s=300)
    for rank, got in enumerate(per_rank):
        assert all(got["equal"]), (rank, got)  # out, dq, dk, dv bitwise the plain ring's
        assert got["dtypes"] == ["torch.bfloat16"] * 4, (rank, got)
        # direct: K/V once in the forward (kept for the backward), the bf16 terms once in the
        # backward; the plain ring: its K/V in both passes, and its fp32 sums (twice the bytes) to
        # the peer and back
        assert got["sent"] == {"auto": 2.0, "ce": 6.0}, (rank, got)


def test_a_capture_before_the_first_direct_sends_takes_the_plain_ring(monkeypatch):
    """Inside a CUDA-graph capture, a group the direct sends have not met yet (its barrier cannot
    run there) goes round the plain ring; a group they have met keeps them."""
    from types import SimpleNamespace

    from torch_commopt.kernels.attention import flex_ring

    group = SimpleNamespace(group_name="g-test")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(flex_ring, "_READY", set())
    assert flex_ring._first_in_capture(group)  # noqa: SLF001
    assert flex_ring._sends(None, 2, None, group) is None  # noqa: SLF001  (nothing else is read)
    flex_ring._READY.add("g-test")  # noqa: SLF001
    assert not flex_ring._first_in_capture(group)  # noqa: SLF001
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    flex_ring._READY.clear()  # noqa: SLF001
    assert not flex_ring._first_in_capture(group)  # noqa: SLF001
