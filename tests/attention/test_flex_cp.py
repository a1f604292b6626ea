"""FlexAttention over a sequence sharded across ranks (issue 70): the block mask cut per (rank,
source) equals the mask built for that block directly, and the reference ring schedule on gloo
(2 and 4 ranks; causal, document, sliding-window and document + window masks; GQA; documents
crossing shares, a one-token document, one longer than a share) gives dense float64 attention's
output and gradients, computing only the blocks whose mask keeps a tile."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from flex_programs import BLOCK, S, doc_ids, mask_mod_of, run_flex_ring

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance

KINDS = ["causal", "document", "window", "document+window"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_mask_is_the_block_mask_of_its_rows_and_keys(kind):
    """Each (p, s) block, and each rank's rows against every key (s None, the all-gather schedule's)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    from torch_commopt.kernels.attention import flex

    world, batch = 4, 2
    docs = doc_ids(batch)
    mod = mask_mod_of(kind, docs)
    blocks = flex.Blocks.of(create_block_mask(mod, batch, None, S, S, device="cpu", BLOCK_SIZE=BLOCK))
    length = S // world
    pos = torch.arange(length)
    for p in range(world):
        for s in range(world):
            step = flex.step_mask(blocks, p, s, world)
            direct = create_block_mask(lambda b, h, q, kv: mod(b, h, q + p * length, kv + s * length), batch, None,
                                       length, length, device="cpu", BLOCK_SIZE=BLOCK)
            # the same tiles kept, partial and full, and the same elementwise mask
            for got, want in ((step.tables[2], direct.kv_num_blocks), (step.tables[4], direct.full_kv_num_blocks)):
                assert torch.equal(got, want), (kind, p, s)
            assert step.tiles() == int(direct.kv_num_blocks.sum() + direct.full_kv_num_blocks.sum())
            for b in range(batch):  # the lifted mask (its document ids a buffer) moved by the offsets
                assert torch.equal(step.mask(torch.tensor(b), 0, pos[:, None], pos[None, :]),
                                   direct.mask_mod(b, 0, pos[:, None], pos[None, :])), (kind, p, s, b)
    for p in range(world):
        rows = flex.step_mask(blocks, p, None, world)
        direct = create_block_mask(lambda b, h, q, kv: mod(b, h, q + p * length, kv), batch, None, length, S,
                                   device="cpu", BLOCK_SIZE=BLOCK)
        assert torch.equal(rows.tables[2], direct.kv_num_blocks) and torch.equal(rows.tables[4], direct.full_kv_num_blocks)
        assert torch.equal(rows.mask(torch.tensor(1), 0, pos[:, None], torch.arange(S)[None, :]),
                           direct.mask_mod(1, 0, pos[:, None], torch.arange(S)[None, :])), (kind, p)
    for p in range(world):  # the backward's Q-block tables, made without vmap, as BlockMask makes them
        for s in [*range(world), None]:
            step = flex.step_mask(blocks, p, s, world)
            ref = BlockMask.from_kv_blocks(*step.tables[2:6], BLOCK_SIZE=BLOCK, seq_lengths=step.tables[:2]).as_tuple()
            for num, idx in ((6, 7), (8, 9)):
                kept = torch.arange(step.tables[idx].shape[-1]) < step.tables[num][..., None]
                assert torch.equal(step.tables[num], ref[num]), (kind, p, s)
                assert torch.equal(torch.where(kept, step.tables[idx], -1), torch.where(kept, ref[idx], -1)), (kind, p, s)
    for p in range(world):  # the span of a block's tiles: the bounding box of its blocks with an unmasked score
        steps = [flex.step_mask(blocks, p, s, world) for s in range(world)]
        for s, (step, ext) in enumerate(zip(steps, flex.extents(steps), strict=True)):
            live = step.dense(batch, 1)[:, 0].any(0)  # scores kept in any batch row
            tiled = live.unflatten(0, (-1, BLOCK)).unflatten(-1, (-1, BLOCK)).any(-1).any(1)  # [row block, key block]
            if not tiled.any():
                assert ext is None, (kind, p, s)
                continue
            rows, cols = tiled.any(1).nonzero().flatten(), tiled.any(0).nonzero().flatten()
            assert ext.rows == slice(int(rows[0]) * BLOCK, (int(rows[-1]) + 1) * BLOCK), (kind, p, s)
            assert ext.keys == slice(int(cols[0]) * BLOCK, (int(cols[-1]) + 1) * BLOCK), (kind, p, s)
            assert ext.tiles == step.tiles()
    spans = flex.spans(blocks, world)  # every rank's key spans from the whole tables: each rank's own extents'
    for p in range(world):
        steps = [flex.step_mask(blocks, p, s, world) for s in range(world)]
        want = [(e.keys.start, e.keys.stop) if e is not None else None for e in flex.extents(steps)]
        assert spans[p] == want, (kind, p, spans[p], want)
    if kind.startswith("document"):
        assert len(blocks.buffers) == 1 and torch.equal(blocks.buffers[0], docs)  # lifted, not a constant
    work = flex.work(blocks, world)
    assert work.sum() == int(blocks.kv_num.sum() + blocks.full_num.sum())
    assert (work.triu(1) == 0).all()  # causal: no rank attends a later share


@pytest.mark.parametrize("world, kind", [(2, "causal"), pytest.param(2, "document", marks=pytest.mark.slow),
                                         (4, "document"), (4, "window"), (2, "document+window")])
def test_the_ring_gives_dense_attention_and_its_gradients(world, kind):
    per_rank = run_distributed(run_flex_ring, world, kind, 2 if kind == "document" else 1, backend="gloo",
                               timeout_s=300)
    for rank, got in enumerate(per_rank):
        assert all(e < 1e-10 for e in got["errors"].values()), (rank, got["errors"])
        # only the blocks whose mask keeps a tile are computed
        assert got["computed"] == sum(n > 0 for n in got["work"][rank]), (rank, got)
    if kind == "window" and world == 4:  # a 200-token window over 256-token shares: own and previous share only
        assert all(got["computed"] == min(rank + 1, 2) for rank, got in enumerate(per_rank)), per_rank
        # the shares go straight to the one rank that needs them, and its dK/dV terms straight back
        # (flex_ring.DirectShift / DirectGrads): each rank sends its K/V once in the forward and once
        # in the backward, and its terms of the previous share's dK/dV once -- whole shares here (the
        # window reaches both 128-token blocks of the previous share), so two messages each (K and V
        # as they are); the ring sends 10
        assert [got["sent"] for got in per_rank] == [4, 6, 6, 2], per_rank
    work, spans = per_rank[0]["work"], per_rank[0]["spans"]
    pairs = [(p, s) for p in range(world) for s in range(world) if p != s]
    cut = spans is not None and any(work[p][s] == 0 or spans[p][s] != (0, S // world) for p, s in pairs)
    assert (spans is not None) == cut, spans  # the direct path only where something is skipped or cut
    assert cut or all(work[p][s] > 0 for p, s in pairs), work  # and wherever something is skipped
    whole = (0, S // world)
    direct_spans = spans if cut else [[whole] * world for _ in range(world)] if world == 2 else None
    for p, got in enumerate(per_rank):  # what each rank sends: to those who need it, or round the ring
        others = [q for q in range(world) if q != p]
        if direct_spans is None:  # more than two ranks, nothing cut: the ring, its sums W hops
            assert got["sent"] == 3 * world - 2, (p, got, work)
            continue
        # a span is one packed message, a whole share two (K and V, or their terms, as they are);
        # two ranks send directly even where nothing is cut, and keep the peer's K/V from the
        # forward (FlexRing: pair_backward), so their K/V go once, not again in the backward
        msgs = lambda span: 2 if span == whole else 1  # noqa: E731
        kv_times = 1 if world == 2 else 2
        needed = [q for q in others if direct_spans[q][p]]  # who receives this rank's K/V
        reached = [s for s in others if direct_spans[p][s]]  # whose keys this rank's terms go to
        direct = kv_times * sum(msgs(direct_spans[q][p]) for q in needed) \
            + sum(msgs(direct_spans[p][s]) for s in reached)
        assert got["sent"] == direct, (p, got, work)
        if cut:  # K and V over the span each peer needs; dK/dV terms over its own spans
            rows = kv_times * sum(2 * (b - a) for a, b in (spans[q][p] for q in needed)) \
                + sum(2 * (b - a) for a, b in (spans[p][s] for s in reached))
            assert got["sent_numel"] == rows * got["kv_row"], (p, got, spans)


@pytest.mark.parametrize("world, kind, schedule", [(2, "document", "allgather"), (4, "document+window", "allgather:g=2")])
def test_the_all_gather_schedule_gives_dense_attention_and_its_gradients(world, kind, schedule):
    """One flex call per head group over every key (the rows' own mask, no merge), K/V gathered a
    group ahead; dK/dV reduce-scattered to their owners."""
    per_rank = run_distributed(run_flex_ring, world, kind, 2 if kind == "document" else 1, schedule, backend="gloo",
                               timeout_s=300)
    for rank, got in enumerate(per_rank):
        assert all(e < 1e-10 for e in got["errors"].values()), (rank, schedule, got["errors"])
        assert got["computed"] == (int(schedule.split("g=")[1]) if "g=" in schedule else 1), (rank, got)


@pytest.mark.parametrize("world, schedule", [(2, "ring"), pytest.param(4, "ring", marks=pytest.mark.slow), (2, "allgather"),
                                             pytest.param(4, "allgather:g=2", marks=pytest.mark.slow)])
def test_rows_with_no_key_give_zero_output_and_no_gradient(world, schedule):
    """Empty windows and padding (flex_programs "empty rows": token 0 sees no earlier token, the
    last 40 tokens are padding): their output rows are 0, nothing of them reaches any gradient,
    and no NaN anywhere -- in the ring's LSE merges too, where a row's every block is empty."""
    per_rank = run_distributed(run_flex_ring, world, "empty rows", 1, schedule, backend="gloo", timeout_s=300)
    for rank, got in enumerate(per_rank):
        assert all(e < 1e-10 for e in got["errors"].values()), (rank, schedule, got["errors"])


@pytest.mark.parametrize("schedule", ["ring", "allgather:g=2"])
def test_a_mask_stated_for_the_rank_s_own_rows_runs_the_same(schedule):
    """A context-parallel program states the mask of its rows only, against every key (its row
    offset added in its mask_mod, as torch's context_parallel does): the same attention, and the
    ring computes only the sources with a kept tile."""
    per_rank = run_distributed(run_flex_ring, 4, "document+window", 1, schedule, True, backend="gloo", timeout_s=300)
    for rank, got in enumerate(per_rank):
        assert all(e < 1e-10 for e in got["errors"].values()), (rank, schedule, got["errors"])
        if schedule == "ring":
            assert got["computed"] == sum(n > 0 for n in got["work"][rank]), (rank, got)


@pytest.mark.parametrize("schedule, own_rows", [("ring", False), ("allgather:g=2", True)])
def test_the_ops_a_rewritten_graph_calls_give_dense_attention(schedule, own_rows):
    """cp_flex_attention_fwd / _bwd with the mask as a rewritten graph carries it (tables, the lifted
    graph's code, its buffers): the forward's out and lse feed the backward, as in a joint graph."""
    from flex_programs import run_flex_ops

    for rank, errors in enumerate(run_distributed(run_flex_ops, 2, "document", schedule, own_rows, backend="gloo",
                                                  timeout_s=300)):
        assert all(e < 1e-10 for e in errors.values()), (rank, schedule, errors)


def test_the_hybrid_gives_dense_attention_and_refuses_a_mask_of_the_rank_s_rows():
    """hybrid:2:2 on 4 ranks: Ulysses over pairs of ranks, the flex ring over the two segments (GQA
    4:2, a documents and window mask): out, dq, dk, dv as dense float64 attention's.  A mask of the
    rank's own rows cannot give a segment's rows, nor a per-head mask a head shard's: a ValueError that
    says so, before any collective."""
    from flex_programs import run_flex_ops

    for rank, errors in enumerate(run_distributed(run_flex_ops, 4, "document+window", "hybrid:2:2", backend="gloo",
                                                  timeout_s=300)):
        assert all(e < 1e-10 for e in errors.values()), (rank, errors)
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import flex, flex_hybrid

    rows = create_block_mask(lambda b, h, q, kv: q + 128 >= kv, 1, None, 128, 256, device="cpu", BLOCK_SIZE=128)
    with pytest.raises(ValueError, match="a mask of this rank's rows only"):  # raised before any collective
        flex_hybrid._groups(flex.Blocks.of(rows), (4, 2), None, 2, 2)  # noqa: SLF001
    per_head = create_block_mask(lambda b, h, q, kv: q >= kv + h, 1, 4, 256, 256, device="cpu", BLOCK_SIZE=128)
    with pytest.raises(ValueError, match="differs per head"):
        flex_hybrid._groups(flex.Blocks.of(per_head), (4, 2), None, 2, 2)  # noqa: SLF001


def test_a_flex_schedule_name_is_checked():
    from torch_commopt.core.attention_spec import parse_flex_schedule as flex_schedule

    assert flex_schedule("ring") == ("ring", 1) and flex_schedule("allgather:g=4") == ("allgather", 4)
    assert flex_schedule("hybrid:2:4") == ("hybrid", 1)
    for bad in ("ring:2", "allgather:g=0", "allgather:2", "zigzag", "allgather:g=x", "hybrid:1:4", "hybrid:4",
                "hybrid:2:2:g=2"):
        with pytest.raises(ValueError, match="unknown schedule"):
            flex_schedule(bad)
    from torch_commopt.config import Config

    assert Config(attention_schedule="allgather:g=2").attention_schedule == "allgather:g=2"  # a flex schedule
    with pytest.raises(ValueError, match="as a flex_attention schedule"):
        Config(attention_schedule="allgather:2")


@pytest.mark.parametrize("world, schedule", [(4, "ring"), pytest.param(2, "allgather", marks=pytest.mark.slow), (2, "auto")])
def test_a_compiled_flex_program_runs_the_named_schedule(world, schedule):
    """K/V all-gathered into flex_attention (the rank's rows' mask, documents + window), compiled
    with backend="commopt": the region becomes cp_flex_attention_fwd running the schedule
    Config.attention_schedule names, or with "auto" the flex model's pick, and gives dense attention."""
    from flex_programs import run_flex_compiled

    for rank, got in enumerate(run_distributed(run_flex_compiled, world, "document+window", schedule, backend="gloo",
                                               timeout_s=300)):
        assert within_tolerance(got["error"], got["eager_error"]), (rank, got)
        if schedule == "auto":
            picked = [n for n in got["notes"] if "cp_flex_attention_fwd" in n]
            assert picked and "predicted at a causal mask's work: " in picked[0], got["notes"]
        else:
            assert any(f"cp_flex_attention_fwd {schedule}" in n for n in got["notes"]), got["notes"]


@pytest.mark.parametrize("own_rows", [False, True])
def test_the_kept_pair_carries_the_gathered_kv_into_a_backward_that_gathers_nothing(own_rows):
    """cp_flex_attention_fwd_keep returns the whole sequence's K/V beside out and lse, and
    cp_flex_attention_bwd_kept on them gives dense attention's gradients without an all-gather,
    with the whole mask or the rank's rows' (torch CP's form); a schedule other than the one-group
    all-gather is refused."""
    from flex_programs import run_flex_ops

    for rank, got in enumerate(run_distributed(run_flex_ops, 2, "document", "allgather", own_rows, True,
                                               backend="gloo", timeout_s=300)):
        assert got["backward_gathers"] == 0 and got["gathered"] == 0, (rank, got)
        assert all(got[n] < 1e-10 for n in ("out", "dq", "dk", "dv")), (rank, got)
    import torch_commopt  # noqa: F401  (registers the ops)
    from torch_commopt.kernels.attention.ops import _kept_schedule

    for schedule in ("ring", "allgather:g=2", "hybrid:2:2"):
        with pytest.raises(ValueError, match="one head group keeps"):
            _kept_schedule(schedule)


@pytest.mark.parametrize("options, kept", [({}, True), ({"regather_for_backward": True}, False)])
def test_a_compiled_training_step_keeps_the_gathered_kv_unless_asked_to_gather_again(options, kept):
    """The one-group all-gather in a joint graph runs as the kept pair by default (the program's own
    gathered K/V were saved for its backward too), and as the plain pair under
    regather_for_backward; the gradients within float32's own error either way."""
    from flex_programs import run_flex_compiled_training

    for rank, got in enumerate(run_distributed(run_flex_compiled_training, 2, "allgather", options, backend="gloo",
                                               timeout_s=300)):
        for name, err in got["errors"].items():
            assert within_tolerance(err, got["eager_errors"][name]), (rank, name, got)
        notes = [n for n in got["notes"] if "cp_flex_attention_fwd/bwd allgather in the joint graph" in n]
        assert notes and all(("gathered K/V kept" in n) == kept for n in notes), got["notes"]


@pytest.mark.parametrize("world, schedule", [(2, "ring"), pytest.param(4, "allgather", marks=pytest.mark.slow)])
def test_a_compiled_flex_training_step_runs_the_named_schedule_forward_and_backward(world, schedule):
    """The same program trained one step: on the joint graph the forward and its backward become
    cp_flex_attention_fwd / _bwd (the gathers and the gradients' reduce-scatters go), and q, k and v's
    gradients are within float32's own error of dense float64 attention's."""
    from flex_programs import run_flex_compiled_training

    for rank, got in enumerate(run_distributed(run_flex_compiled_training, world, schedule, backend="gloo",
                                               timeout_s=300)):
        for name, err in got["errors"].items():
            assert within_tolerance(err, got["eager_errors"][name]), (rank, name, got)
        assert any(f"cp_flex_attention_fwd/bwd {schedule} in the joint graph" in n for n in got["notes"]), got["notes"]


def test_a_mask_is_cut_once_for_its_very_tensors():
    """flex.cached: every layer's call with the same block tables reuses the cut steps; a write into
    them, a new mask at the same shapes, or an inference-mode one (no version counter) cuts again.
    The mask function's buffers are not part of the cut: a hit carries the call's own."""
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import flex, flex_ring

    def mask_of(docs):
        return create_block_mask(mask_mod_of("document", docs), 1, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)

    docs = doc_ids(1)
    blocks = flex.Blocks.of(mask_of(docs))
    first = flex_ring.steps_of(blocks, 2, 1)
    assert flex_ring.steps_of(blocks, 2, 1) is first
    assert flex_ring.steps_of(blocks, 2, 0) is not first  # another rank's (or schedule's) cut
    # another tensor object for the same buffer (a compiled graph's alias of it), or new values in
    # it: the same cut, with this call's buffer, which the kernels read when they run
    alias = torch.as_strided(blocks.buffers[0].detach(), blocks.buffers[0].shape, blocks.buffers[0].stride())
    rebound = flex_ring.steps_of(dataclasses.replace(blocks, buffers=(alias,)), 2, 1)
    assert rebound is not first and rebound[1] is first[1] and rebound[0][0].tables is first[0][0].tables
    assert all(step.buffers[2] is alias for step in rebound[0])
    assert [step.mask(*map(torch.tensor, (0, 0, 3, 100))) for step in first[0]] == \
        [step.mask(*map(torch.tensor, (0, 0, 3, 100))) for step in rebound[0]]
    blocks.kv_num.add_(0)  # a write into the block tables: cut again
    assert flex_ring.steps_of(blocks, 2, 1) is not first
    again = flex.Blocks.of(mask_of(docs))  # equal values, other tensors
    assert flex_ring.steps_of(again, 2, 1) is not flex_ring.steps_of(blocks, 2, 1)
    with torch.inference_mode():
        served = flex.Blocks.of(mask_of(doc_ids(1)))
        assert flex_ring.steps_of(served, 2, 1) is not flex_ring.steps_of(served, 2, 1)


class _Holder:
    ids = None


_HOLDER = _Holder()
GLOBAL_IDS = None


def test_a_mask_function_is_traced_once_for_the_objects_it_reads():
    """flex.lifted_mask: an eager call of a schedule traces its mask function (~10 ms) once for
    the function and the tensors it reads; a tensor rebound in its closure or in the globals it
    names is another mask; new values written into the same tensor are read through the buffer;
    a function reading an object's attribute (which could be rebound unseen) is traced every call."""
    from torch_commopt.kernels.attention import flex

    global GLOBAL_IDS
    cpu = torch.device("cpu")
    docs = doc_ids(1)[0]
    mod = mask_mod_of("document", doc_ids(1))
    first = flex.lifted_mask(mod, cpu)
    assert flex.lifted_mask(mod, cpu) is first
    q, kv = torch.tensor([5]), torch.tensor([3])
    GLOBAL_IDS = docs.clone()

    def reads_a_global(b, h, q, kv):
        return GLOBAL_IDS[q] == GLOBAL_IDS[kv]

    graph, buffers = flex.lifted_mask(reads_a_global, cpu)
    assert buffers[0] is GLOBAL_IDS and flex.lifted_mask(reads_a_global, cpu)[1][0] is GLOBAL_IDS
    GLOBAL_IDS[:] = torch.arange(GLOBAL_IDS.numel())  # in place: the same trace, reading the new values
    assert flex.lifted_mask(reads_a_global, cpu)[0] is graph and not graph(0, 0, q, kv, *buffers).item()
    GLOBAL_IDS = torch.zeros_like(docs)  # rebound: traced again, over the new tensor
    again = flex.lifted_mask(reads_a_global, cpu)
    assert again[0] is not graph and again[1][0] is GLOBAL_IDS and again[0](0, 0, q, kv, *again[1]).item()

    _HOLDER.ids = docs

    def reads_an_attribute(b, h, q, kv):
        return _HOLDER.ids[q] == _HOLDER.ids[kv]

    traced = flex.lifted_mask(reads_an_attribute, cpu)
    assert flex.lifted_mask(reads_an_attribute, cpu) is not traced  # nothing to key it by
    _HOLDER.ids = torch.zeros_like(docs)
    assert flex.lifted_mask(reads_an_attribute, cpu)[1][0] is _HOLDER.ids


@pytest.mark.parametrize("world, kind, schedule, own_rows, layout", [
    pytest.param(2, "causal", "ring", False, "head_tail", marks=pytest.mark.slow),
    (4, "document", "allgather:g=2", True, "by_work")])
def test_the_schedules_run_unchanged_on_a_balanced_layout(world, kind, schedule, own_rows, layout):
    """The sequence dealt to the ranks by balance.choose (head_tail for causal, by_work for the
    documents) with the mask stated over layout positions: dense attention and its gradients."""
    per_rank = run_distributed(run_flex_ring, world, kind, 2 if kind == "document" else 1, schedule, own_rows,
                               "choose", backend="gloo", timeout_s=300)
    for rank, got in enumerate(per_rank):
        assert got["layout"] == layout, got
        assert all(e < 1e-10 for e in got["errors"].values()), (rank, got["errors"])


def test_balanced_layouts_deal_whole_blocks_by_work():
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import balance

    x = torch.arange(2 * S).view(2, S)
    for world in (2, 4):
        mask = create_block_mask(mask_mod_of("document", doc_ids(2)), 2, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
        rows = balance.row_work(mask)
        for lay in balance.candidates(rows, world, BLOCK):
            shards = [lay.shard(x, 1, p) for p in range(world)]
            assert torch.equal(lay.restore(torch.cat(shards, 1), 1), x)  # every token once, back in order
            assert sum(lay.rank_work(rows)) == int(rows.sum())
            pos = lay.positions()
            assert torch.equal(pos.view(-1, BLOCK) % BLOCK, torch.arange(BLOCK).expand(S // BLOCK, BLOCK))  # whole blocks
            # the mask over layout positions is the sequence's, permuted: a layout-order tile holds the same scores
            moved = create_block_mask(lay.mask_mod(mask_mod_of("document", doc_ids(2))), 2, None, S, S, device="cpu",
                                      BLOCK_SIZE=BLOCK)
            assert torch.equal(balance.row_work(moved), rows[lay.order])
        best = balance.by_work(rows, world, BLOCK)
        assert max(best.rank_work(rows)) <= rows.sum() / world + rows.max()  # within one block of even
        assert max(balance.choose(mask, world).rank_work(rows)) == min(max(lay.rank_work(rows))
                                                                        for lay in balance.candidates(rows, world, BLOCK))
    causal = create_block_mask(mask_mod_of("causal", None), None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    lay = balance.choose(causal, 2)
    assert lay.name == "head_tail" and lay.rank_work(balance.row_work(causal)) == [18, 18]
    with pytest.raises(ValueError, match="not a permutation"):
        balance.Layout(torch.tensor([0, 0, 1, 2]), BLOCK, 2)


@pytest.mark.parametrize("schedule, train", [("auto", True)])
def test_torch_context_parallel_with_flex_attention_runs_the_cp_ops(schedule, train):
    """torch's _ContextParallel(FLEX) gathers K/V with cplib::flex_cp_allgather (and scatters their
    gradients with its backward) over the sequence its PTRR load balancer dealt: with the block
    around it compiled with backend="commopt" the region runs the flex ops (the cplib ops written
    out as the collectives they run, then replaced), within float32's own error of dense attention."""
    from flex_programs import run_torch_cp_flex

    for rank, got in enumerate(run_distributed(run_torch_cp_flex, 2, schedule, train, backend="gloo", timeout_s=300)):
        for name, err in got["errors"].items():
            assert within_tolerance(err, got["eager_errors"][name]), (rank, name, got)
        want = "cp_flex_attention_fwd/bwd " if train else f"cp_flex_attention_fwd {schedule} "
        assert any(want in n for n in got["notes"]), got["notes"]


def test_a_new_documents_mask_each_batch_recompiles_nothing():
    """A compiled program given a new mask each batch (new document ids in a new mask_mod closure,
    new block tables) runs one compiled graph, its region rewritten, right on every batch: the
    document ids and tables are the graph's inputs and the cut masks are made per call."""
    from flex_programs import run_flex_compiled_batches

    for rank, got in enumerate(run_distributed(run_flex_compiled_batches, 2, "ring", backend="gloo", timeout_s=300)):
        assert got["graphs"] == 1, got
        assert all(within_tolerance(e, r) for e, r in zip(got["errors"], got["eager_errors"], strict=True)), (rank, got)
        assert any("cp_flex_attention_fwd ring" in n for n in got["notes"]), got["notes"]


def test_sdpa_with_a_documents_mask_runs_the_flex_ops():
    """SDPA with a boolean documents mask of the rank's rows (computed in the graph from the ids;
    SDPA makes it additive, where(mask, 0, -inf)) over all-gathered K/V: in an inference graph it
    runs as cp_flex_attention_fwd with the mask a buffer and its block tables made from it at run
    time (commopt.dense_block_tables); in the joint graph as cp_flex_attention_fwd/bwd in place of
    SDPA and its backward, the K/V gradients' reduce-scatters gone."""
    from flex_programs import run_sdpa_document_mask_both

    for rank, both in enumerate(run_distributed(run_sdpa_document_mask_both, 2, backend="gloo", timeout_s=300)):
        for train, got in zip((False, True), both, strict=True):
            assert within_tolerance(got["error"], got["eager_error"]), (rank, train, got)
            want = "cp_flex_attention_fwd/bwd allgather" if train else "cp_flex_attention_fwd allgather"
            assert any(want in n for n in got["notes"]), got["notes"]


def test_a_dense_masks_block_tables_are_create_block_masks():
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import flex

    for kind in KINDS:
        mod = mask_mod_of(kind, doc_ids(2))
        pos = torch.arange(S)
        dense = torch.stack([mod(b, 0, pos[:, None], pos[None, :]) for b in range(2)])[:, None]
        want = create_block_mask(mod, 2, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
        kv_num, kv_idx, full_num, full_idx = flex.dense_tables(dense, BLOCK)
        for num, idx, w_num, w_idx in ((kv_num, kv_idx, want.kv_num_blocks, want.kv_indices),
                                       (full_num, full_idx, want.full_kv_num_blocks, want.full_kv_indices)):
            kept = torch.arange(idx.shape[-1]) < num[..., None]
            assert torch.equal(num, w_num) and torch.equal(torch.where(kept, idx, -1),
                                                           torch.where(kept, w_idx[..., :idx.shape[-1]], -1)), kind


# 4 ranks: the compiled flex tests
@pytest.mark.parametrize("world, schedule", [(2, "allgather"), pytest.param(2, "ring", marks=pytest.mark.slow)])
def test_a_ulysses_program_around_flex_attention_runs_the_flex_ops(world, schedule):
    """Ulysses all-to-alls around flex_attention with the whole sequence's documents mask
    (GQA): inference as cp_flex_attention_fwd and a training step as cp_flex_attention_fwd/bwd on
    each rank's sequence share, every all-to-all gone, output and q/k/v gradients within float32's
    own error of dense float64 attention."""
    from flex_programs import run_flex_ulysses_both

    for rank, both in enumerate(run_distributed(run_flex_ulysses_both, world, schedule, backend="gloo",
                                                timeout_s=300)):
        for train, got in zip((False, True), both, strict=True):
            assert within_tolerance(got["error"], got["eager_error"]), (rank, train, got)
            want = f"cp_flex_attention_fwd/bwd {schedule}" if train else f"cp_flex_attention_fwd {schedule}"
            assert any("flex_ulysses" in n and want in n for n in got["notes"]), got["notes"]
            assert got["a2as"] == 0, got


def test_a_dtensor_program_with_flex_attention_runs_the_flex_ops():
    """K and V as DTensors sharded along the sequence, redistributed to Replicate (gradients
    Partial) into flex_attention -- the collectives DTensor emits: funcol's gather in its split/cat
    form for the sequence dim, and a reduce-scatter back: a training step runs
    cp_flex_attention_fwd/bwd, its q/k/v gradients within float32's own error of dense float64."""
    from flex_programs import run_flex_dtensor

    for rank, got in enumerate(run_distributed(run_flex_dtensor, 2, backend="gloo", timeout_s=300)):
        for name, err in got["errors"].items():
            assert within_tolerance(err, got["eager_errors"][name]), (rank, name, got)
        assert any("cp_flex_attention_fwd/bwd allgather in the joint graph" in n for n in got["notes"]), got["notes"]


def test_the_block_kernels_compile_once_per_kind_and_shape(monkeypatch):
    """flex._compiled: one Inductor compile per kind, shapes and mask graph, with Inductor's
    default configuration (max-autotune of flex's templates crashed on torch 2.11), then reused."""
    from torch_commopt.kernels.attention import flex

    seen = []

    def compile_stub(gm, args):
        seen.append(torch._inductor.config.max_autotune)
        return gm

    monkeypatch.setattr(torch._inductor, "compile", compile_stub)
    monkeypatch.setattr(flex, "_COMPILED", {})
    step = flex.Step((), (), "stub")
    for shape, compiles in (((4,), [False]), ((4,), [False]), ((8,), [False, False])):
        t = torch.randn(shape)
        fn = flex._compiled("forward", lambda t: t * 2, (t,), step, 0.5)  # noqa: SLF001
        assert seen == compiles and torch.equal(fn(t), t * 2)
