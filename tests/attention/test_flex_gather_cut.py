"""The flex all-gather's pulled, cut K/V gather on the CPU (TORCH_COMMOPT_FLEX_GATHER_CUT): the spans
a rank pulls (flex_allgather._pull_spans) against the key blocks its rows keep, and the group's
agreement on the switch (ce_gather.cut_agreed).  Its copy-engine protocol is simulated in
tests/kernels/test_flex_ce_protocol.py; its numerics run on the device (tests/gpu/test_flex_gpu.py)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from torch_commopt.core import consistency
from torch_commopt.kernels.attention import ce_gather, flex, flex_allgather

S, BLOCK = 1024, 128
L = S // 2
CUDA_LIKE = types.SimpleNamespace(is_cuda=True)


def _docs(cuts):
    ids = torch.zeros(S, dtype=torch.int32)
    for cut in cuts:
        ids[cut:] += 1
    return ids


MASKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "documents": lambda b, h, q, kv: (DOCS[q] == DOCS[kv]) & (q >= kv),
    "window": lambda b, h, q, kv: (q >= kv) & (q - kv < 200),
}
DOCS = _docs((100, 300, 700))  # the document [300, 700) crosses the shares' boundary at 512


def _spans(mask: str, rank: int, own_rows: bool, monkeypatch) -> list:
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(flex_allgather.comm, "size", lambda group: 2)
    monkeypatch.setattr(flex_allgather.comm, "rank", lambda group: rank)
    monkeypatch.setattr(ce_gather, "cut_agreed", lambda group: True)
    mod = MASKS[mask]
    if own_rows:  # the rank's rows only, as a compiled program states its mask
        bm = create_block_mask(lambda b, h, q, kv: mod(b, h, q + rank * L, kv), 1, None, L, S, device="cpu",
                               BLOCK_SIZE=BLOCK)
    else:
        bm = create_block_mask(mod, 1, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    opts = flex_allgather.Options(flex.Blocks.of(bm), 1.0, object())
    step = flex_allgather._rows_step(opts.blocks, rank, 2)
    return flex_allgather._pull_spans(opts, step, CUDA_LIKE, [(slice(None), slice(None))])


def _needed(mask: str, rank: int) -> list:
    """Per source, the block-aligned (start, end) of its keys that rank's rows attend (None: none)."""
    q = torch.arange(rank * L, (rank + 1) * L)[:, None]
    kv = torch.arange(S)[None, :]
    used = MASKS[mask](0, 0, q, kv).any(0)
    out = []
    for s in range(2):
        blocks = used[s * L:(s + 1) * L].view(-1, BLOCK).any(-1).nonzero().flatten()
        out.append(None if not len(blocks) else (int(blocks[0]) * BLOCK, (int(blocks[-1]) + 1) * BLOCK))
    return out


@pytest.mark.parametrize("own_rows", [False, True], ids=["whole mask", "own rows"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_pulls_the_span_of_each_share_its_rows_attend(mask, rank, own_rows, monkeypatch):
    assert _spans(mask, rank, own_rows, monkeypatch) == _needed(mask, rank)


def test_the_spans_cut_the_documents_mask_to_the_crossing_document(monkeypatch):
    # rank 1's rows [512, 1024) reach back into share 0 only through the document [300, 700)
    assert _spans("documents", 1, True, monkeypatch) == [(256, 512), (0, 512)]
    assert _spans("causal", 0, True, monkeypatch) == [(0, 512), None]


def test_no_spans_without_the_agreed_switch_two_ranks_one_head_group_and_cuda(monkeypatch):
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(MASKS["causal"], 1, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    opts = flex_allgather.Options(flex.Blocks.of(bm), 1.0, object())
    step = flex_allgather._rows_step(opts.blocks, 0, 2)
    one = [(slice(None), slice(None))]
    monkeypatch.setattr(flex_allgather.comm, "rank", lambda group: 0)
    monkeypatch.setattr(flex_allgather.comm, "size", lambda group: 2)
    monkeypatch.setattr(ce_gather, "cut_agreed", lambda group: False)
    assert flex_allgather._pull_spans(opts, step, CUDA_LIKE, one) is None
    monkeypatch.setattr(ce_gather, "cut_agreed", lambda group: True)
    assert flex_allgather._pull_spans(opts, step, CUDA_LIKE, one) is not None
    assert flex_allgather._pull_spans(opts, step, types.SimpleNamespace(is_cuda=False), one) is None
    assert flex_allgather._pull_spans(opts, step, CUDA_LIKE, one * 2) is None  # two head groups
    monkeypatch.setattr(flex_allgather.comm, "size", lambda group: 4)
    assert flex_allgather._pull_spans(opts, step, CUDA_LIKE, one) is None


@pytest.fixture
def votes(monkeypatch):
    """consistency.agree replaced: every vote recorded, the outcome `votes.outcome`."""
    state = types.SimpleNamespace(cast=[], outcome=consistency.Outcome(True, "on", ""))
    monkeypatch.setattr(ce_gather, "_AGREED", {})

    def agree(decision, value, timeout_s):
        state.cast.append((decision.group_name, value))
        return state.outcome
    monkeypatch.setattr(consistency, "agree", agree)
    return state


def test_the_switch_off_pulls_nothing_and_votes_nothing(votes, monkeypatch):
    monkeypatch.delenv("TORCH_COMMOPT_FLEX_GATHER_CUT", raising=False)
    assert not ce_gather.cut_agreed(types.SimpleNamespace(group_name="g"))
    assert votes.cast == []


def test_the_switch_on_is_voted_once_per_group(votes, monkeypatch):
    monkeypatch.setenv("TORCH_COMMOPT_FLEX_GATHER_CUT", "1")
    g, h = types.SimpleNamespace(group_name="g"), types.SimpleNamespace(group_name="h")
    assert ce_gather.cut_agreed(g) and ce_gather.cut_agreed(g) and ce_gather.cut_agreed(h)
    assert votes.cast == [("g", "on"), ("h", "on")]


def test_a_group_whose_ranks_disagree_gathers_whole(votes, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_COMMOPT_FLEX_GATHER_CUT", "on")
    votes.outcome = consistency.Outcome(False, None, "rank 1 did not vote within 60 s")
    with caplog.at_level(logging.WARNING, logger=ce_gather.log.name):
        assert not ce_gather.cut_agreed(types.SimpleNamespace(group_name="g"))
    assert "not set on every rank" in caplog.text and "did not vote" in caplog.text


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("rank", [0, 1])
def test_the_backward_s_cut_scatter_sends_the_peer_s_span_outside_which_its_gradients_are_zero(mask, rank,
                                                                                                 monkeypatch):
    """allgather_backward hands the cut reduce-scatter the span of the peer's share its rows keep
    tiles of, and the gradients it would not send are zero (what the cut relies on)."""
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(flex_allgather.comm, "size", lambda group: 2)
    monkeypatch.setattr(flex_allgather.comm, "rank", lambda group: rank)
    monkeypatch.setattr(ce_gather, "cut_agreed", lambda group: True)
    real = flex_allgather._pull_spans
    monkeypatch.setattr(flex_allgather, "_pull_spans", lambda opts, step, k, heads: real(opts, step, CUDA_LIKE, heads))
    moved = []

    def by_copy_engine(move, a, b, group):
        moved.append((move, a, b))
        if move is ce_gather.all_gather_kv or getattr(move, "func", None) is ce_gather.all_gather_kv_pulled:
            return whole_k, whole_v  # what the gather lands where the rows read
        return a[:, :, rank * L:(rank + 1) * L], b[:, :, rank * L:(rank + 1) * L]
    monkeypatch.setattr(flex_allgather, "_by_copy_engine", by_copy_engine)
    gen = torch.Generator().manual_seed(7 + rank)
    whole_q, whole_k, whole_v, whole_do = (torch.randn(1, 2, S, 16, generator=gen) for _ in range(4))
    bm = create_block_mask(MASKS[mask], 1, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    opts = flex_allgather.Options(flex.Blocks.of(bm), 0.25, object())
    mine = slice(rank * L, (rank + 1) * L)
    q, k, v, dout = (t[:, :, mine] for t in (whole_q, whole_k, whole_v, whole_do))
    out, lse, _ = flex_allgather.allgather_forward(q, k, v, opts)
    flex_allgather.allgather_backward((q, k, v, out, lse), dout, opts)
    move, gk, gv = moved[-1]
    sent = _needed(mask, rank)[1 - rank]
    assert move.func is ce_gather.reduce_scatter_kv_cut and move.keywords == {"sent": sent}
    peer = slice((1 - rank) * L, (2 - rank) * L)
    for g in (gk[:, :, peer], gv[:, :, peer]):
        outside = torch.ones(L, dtype=torch.bool)
        if sent is not None:
            outside[sent[0]:sent[1]] = False
            assert g[:, :, ~outside].abs().sum() > 0
        assert torch.equal(g[:, :, outside], torch.zeros_like(g[:, :, outside]))
