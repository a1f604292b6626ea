"""The all-reduce split analysis (passes/matmul/ar_split.py) on graphs of a fake process group:
which ops count as row-local, which operands must be sliced or used as they are."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt

fake_worlds = pytest.mark.parametrize("fake_world", [2, 4], indirect=True)


def _notes(fn, *inputs):
    torch_commopt.reset_explain()
    torch.compile(fn, backend="commopt", options={"patterns": ()})(*inputs)
    return [n for g in torch_commopt.explain().graphs for n in g.notes if n.startswith("split candidate")]


def _all_reduce(t):
    return funcol.all_reduce(t, "sum", group=dist.group.WORLD.group_name)


def _rmsnorm(h, g):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g


@fake_worlds
def test_tp_block_residual_and_norm_are_a_candidate_that_pays(fake_world):
    # row-parallel output -> all-reduce -> residual add -> RMSNorm -> column-parallel matmul
    x, a, wo, g, w1 = (torch.randn(16, 32), torch.randn(16, 8), torch.randn(8, 32), torch.randn(32),
                       torch.randn(32, 8))

    def fn(x, a, wo, g, w1):
        h = x + _all_reduce(a @ wo)
        return h, _rmsnorm(h, g) @ w1

    (note,) = _notes(fn, x, a, wo, g, w1)
    assert "16 rows" in note and "worth it" in note
    assert "1 full and 1 broadcast operand(s)" in note  # x sliced to the rank's rows, g as is
    assert "all-gather of 2 value(s)" in note  # h (an output) and the normalized rows (to the matmul)


@fake_worlds
def test_no_matmul_after_it_is_reported_as_not_worth_it(fake_world):
    a, w = torch.randn(8, 16), torch.randn(16, 16)

    def fn(a, w):
        return torch.relu(_all_reduce(a @ w)) * 2.0

    (note,) = _notes(fn, a, w)
    assert "no GEMM to overlap on both sides" in note


@fake_worlds
def test_ops_that_are_not_row_local_end_the_candidate(fake_world):
    a, w = torch.randn(8, 16), torch.randn(16, 16)

    def column_sum(a, w):  # a reduction over dim 0 mixes rows
        return _all_reduce(a @ w).sum(0)

    def transpose(a, w):
        return _all_reduce(a @ w).t() @ a

    def row_vector_broadcast(a, w):  # a per-row value broadcast along columns: not row-local
        t = _all_reduce(a @ w)
        return t * t.mean(-1)

    assert _notes(column_sum, a, w) == []
    assert _notes(transpose, a, w) == []
    (note,) = _notes(row_vector_broadcast, torch.randn(16, 16), w)  # square: [16] broadcasts along columns
    assert "-> 1 row-local op(s)" in note  # the mean only; the broadcasting mul is outside


@fake_worlds
def test_rows_that_do_not_split_are_not_a_candidate(fake_world):
    a, w = torch.randn(fake_world + 1, 16), torch.randn(16, 16)
    assert _notes(lambda a, w: torch.relu(_all_reduce(a @ w)), a, w) == []


def test_split_matches_eager_and_forms_overlapped_regions():
    from ar_split_programs import split_forward

    from torch_commopt.testing.launch import run_distributed

    for notes, kinds, errors in run_distributed(split_forward, 2):
        splits = [n for n in notes if "split into reduce-scatter" in n]
        assert len(splits) == 2, notes  # both all-reduces: a GEMM on each side
        assert "assumed equal on every rank" in splits[0]
        # each all-reduce became a reduce-scatter meeting its matmul, and the gathers meet theirs
        assert kinds.count("matmul_rs") == 2 and kinds.count("ag_matmul") >= 2, kinds
        assert max(errors) < 1e-5, errors
        # the first layer's gathered residual is used on the rows only (by the second split)
        assert any("1 all-gather(s) dropped" in n for n in notes), notes


def test_split_on_a_dtensor_tp_block_matches_eager_forward_and_backward():
    # tensor parallelism without sequence parallelism: the residual stream and the norm
    # weights are replicated, which is the split's assumption
    from ar_split_programs import split_tp_block

    from torch_commopt.testing.launch import run_distributed
    from torch_commopt.testing.validate import within_tolerance

    for errors, notes, kinds in run_distributed(split_tp_block, 2):
        assert any("split into reduce-scatter" in n for n in notes), notes
        assert ("forward", "matmul_rs") in kinds and ("forward", "ag_matmul") in kinds, kinds
        assert len(errors) >= 10  # output, input grad, every parameter grad
        bad = [f"{n}: {c:.2e} vs eager {e:.2e}" for n, c, e in errors if not within_tolerance(c, e)]
        assert not bad, bad


@pytest.mark.slow
def test_split_of_a_batch_one_block_cuts_the_sequence_dim():
    # (1, S, D) activations: dim 0 cannot be cut, the split goes along the sequence (dim 1)
    # through the funcol split/cat forms, which the finders then overlap like DTensor's own
    from ar_split_programs import split_tp_block

    from torch_commopt.testing.launch import run_distributed
    from torch_commopt.testing.validate import within_tolerance

    for errors, notes, kinds in run_distributed(split_tp_block, 2, 1):
        splits = [n for n in notes if "split into reduce-scatter" in n]
        assert splits and all("(dim 1)" in n for n in splits), notes
        assert ("forward", "matmul_rs") in kinds and ("forward", "ag_matmul") in kinds, kinds
        bad = [f"{n}: {c:.2e} vs eager {e:.2e}" for n, c, e in errors if not within_tolerance(c, e)]
        assert not bad, bad


def test_checked_split_verifies_the_replication_it_assumes():
    from ar_split_programs import split_forward

    from torch_commopt.testing.launch import run_distributed

    for _notes, kinds, errors in run_distributed(split_forward, 2, 16, "checked"):
        assert max(errors) < 1e-5 and kinds.count("matmul_rs") == 2
    # a residual that differs per rank: a clear error, not a silently different result
    for message in run_distributed(split_forward, 2, 16, "checked", False):
        assert isinstance(message, str) and "differs between the ranks" in message and "ar_split" in message


def test_ar_split_option_values():
    from torch_commopt.config import Config

    assert Config(ar_split="checked").ar_split == "checked"
    with pytest.raises(ValueError, match="ar_split"):
        Config(ar_split="yes")
    with pytest.raises(ValueError, match="ar_split_policy"):
        Config(ar_split=True, ar_split_policy="sometimes")


def test_cost_policy_splits_where_the_model_predicts_it_faster():
    from torch_commopt.reshard.ar_cost import SplitShapes, op_bytes, split_cost
    from torch_commopt.tuner.calibration import prior

    h200 = prior("NVIDIA H200", 2)
    # TP attention output (8192 tokens, K_local 2048, dim 4096) into the MLP's w1/w3
    # (K 4096 -> 2 x 7168 per rank), a residual add + RMSNorm in between
    big = SplitShapes(rows=8192, k=2048, n=4096, op_bytes=op_bytes([8192 * 4096] * 6, 2),
                      gathered=((4096, (7168, 7168)), (4096, ())), world=2, dtype="bfloat16")
    cost = split_cost(big, h200)
    assert cost.pays and cost.split_ms < cost.keep_ms and "split" in cost.describe()
    # the same without the GEMMs after it and with nothing on the rows: the all-reduce stays
    bare = SplitShapes(rows=8192, k=2048, n=4096, op_bytes=0, gathered=((4096, ()), (4096, ()), (4096, ())),
                       world=2, dtype="bfloat16")
    assert not split_cost(bare, h200).pays
    # row-local work shrinks by W when split: more of it makes the split cheaper, never dearer
    more = SplitShapes(**{**big.__dict__, "op_bytes": 10 * big.op_bytes})
    assert split_cost(more, h200).keep_ms - split_cost(more, h200).split_ms > cost.keep_ms - cost.split_ms


def test_cost_policy_decides_each_candidate_and_matches_eager_either_way():
    from ar_split_programs import split_forward

    from torch_commopt.testing.launch import run_distributed

    for notes, _kinds, errors in run_distributed(split_forward, 2, 16, True, True, "cost"):
        decided = [n for n in notes if "as an all-reduce" in n]
        assert len(decided) == 2, notes  # both candidates costed, split or kept
        assert all("predicted" in n and "joint plan of 2 candidate(s)" in n for n in decided), decided
        splits = sum("split into reduce-scatter" in n for n in notes)
        assert splits == sum(": split by the joint plan" in n for n in decided), notes
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("keep_ms, split_ms, gather_ms, want", [
    # alone each split loses (1.04 > 1.00), together they win: the first one's residual gather
    # (0.10 of its 1.04) goes when the second splits too: 0.94 + 1.04 < 2.00
    (1.00, 1.04, 0.10, ["split", "split"]),
    (1.00, 1.04, 0.01, ["kept", "kept"]),  # the gather saved is too small to matter
    (1.00, 0.90, 0.05, ["split", "split"]),  # each pays alone
])
def test_cost_policy_decides_the_splits_together(keep_ms, split_ms, gather_ms, want):
    """Deciding each all-reduce alone charges every split for a residual gather a split
    neighbour makes unnecessary; the joint plan (reshard.split_plan) sees it on the edge."""
    from ar_split_programs import joint_split_decisions

    from torch_commopt.testing.launch import run_distributed

    for notes, errors in run_distributed(joint_split_decisions, 2, keep_ms, split_ms, gather_ms):
        decided = [n for n in notes if "joint plan" in n]
        assert ["split" if ": split by the joint plan" in n else "kept" for n in decided] == want, notes
        assert all(("not split (kept by" in n) == (w == "kept") for n, w in zip(decided, want)), notes
        assert ("residual gather goes if" in decided[0]) and sum("split into" in n for n in notes) == want.count("split")
        assert max(errors) < 1e-5, errors
