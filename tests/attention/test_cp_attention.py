"""Context-parallel attention on live gloo groups (2, 3 and 4 ranks) against eager full attention.

One spawned group per world size runs every case (cp_programs.run_all) and the tests below
read its results: per case the forward (out, lse) and the gradients (dq, dk, dv) through the
autograd wrapper, each within a few times eager's own error against a float64 truth; what each
rank sent; the refusals; the wrapper under torch.compile and opcheck of the two ops.
"""

from __future__ import annotations

import cp_programs
import pytest

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance

WORLDS = [2, 3, 4]
# make test runs the odd world (a ring of three hops); the slow tier the others
WORLD_PARAMS = [pytest.param(w, marks=pytest.mark.slow) if w != 3 else w for w in WORLDS]


@pytest.fixture(scope="module", params=WORLD_PARAMS, ids=lambda w: f"world{w}")
def results(request):
    """(world, per-rank results of cp_programs.run_all), one spawn per world size."""
    return request.param, run_distributed(cp_programs.run_all, request.param, timeout_s=180)


def test_every_schedule_matches_full_attention_forward_and_backward(results):
    world, ranks = results
    expected = len(cp_programs.cases(world)) * 5
    for rank, res in enumerate(ranks):
        errors, _ = res["cases"]
        assert len(errors) == expected
        bad = [f"{label}: {got:.2e} vs eager {eager:.2e}" for label, got, eager in errors
               if not within_tolerance(got, eager)]
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)


def test_cases_cover_the_matrix():
    """The matrix the numerics test runs: each schedule (hybrids included) causal and not, GQA,
    head dims 64 and 128, a shortest and an odd length; MHA, MQA, Dv != D, bf16, fp64."""
    for world in WORLDS:
        cases = cp_programs.cases(world)
        for sched in cp_programs.schedule_names(world):
            mine = [c for c in cases if c.schedule == sched]
            gqa = {(c.causal, c.head_dim) for c in mine if c.heads[1] < c.heads[0]}
            assert gqa >= {(a, d) for a in (False, True) for d in (64, 128)}
            assert min(c.seq_local for c in mine) <= 2 and len({c.seq_local for c in mine}) >= 3
        assert {c.heads[0] // c.heads[1] for c in cases} >= {1, 2, 4}
        assert any(c.v_dim for c in cases) and {c.dtype.itemsize for c in cases} == {2, 4, 8}


def test_kv_travel_unexpanded_and_dkv_in_fp32(results):
    """Each rank sends what its schedule should: K/V of H_kv heads (never expanded for GQA),
    W-1 (ring degree - 1) K/V steps, dK/dV in the accumulation dtype."""
    world, ranks = results
    for rank, res in enumerate(ranks):
        _, problems = res["cases"]
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_expected_traffic_tells_expanded_kv_apart():
    """The traffic check can fail: K/V expanded to H heads would not match the expectation."""
    case = cp_programs.Case("ring", True, (4, 1))
    fwd, _, _ = cp_programs.expected_traffic(case, 4)
    expanded = cp_programs.expected_traffic(cp_programs.Case("ring", True, (4, 4)), 4)[0]
    assert fwd != expanded and sum(fwd.values()) == 3


def test_unsplittable_shapes_are_refused_before_any_transfer(results):
    world, ranks = results
    calls = cp_programs.refused_calls(world)
    for rank, res in enumerate(ranks):
        refusals = res["refusals"]
        assert len(refusals) == 3 * len(calls)
        for sched, entry, message, sent in refusals:
            assert message is not None, f"rank {rank}: {sched} {entry} was not refused"
            assert message.startswith(f"cp attention {sched}: ") and sent == 0, message
            if sched == "ring_zigzag":
                assert f"2*W = {2 * world} equal chunks" in message
            else:
                assert "not both divisible" in message


def test_compiled_wrapper_matches_eager_wrapper(results):
    """cp_attention in torch.compile(fullgraph=True, aot_eager) = the eager wrapper, and the
    two ops pass torch.library.opcheck (raised in the worker otherwise)."""
    _, ranks = results
    for res in ranks:
        for label, err, _ in res["compiled"]:
            assert err <= 1e-6, f"{label}: {err:.2e}"


def test_a_zigzag_sharded_program_runs_without_relayouts(results):
    """layout="zigzag" (torch CP's head-tail sharding): ring_zigzag computes a causal sequence
    on the shards as they are -- forward and backward match full attention and no all-to-all
    is sent; a non-causal one runs under any schedule; causal ring refuses it."""
    _, ranks = results
    for rank, res in enumerate(ranks):
        zz = res["zigzag_layout"]
        assert len(zz["errors"]) == 5 * len(cp_programs.ZIGZAG_LAYOUT_CASES)
        bad = [f"{label}: {got:.2e} vs eager {eager:.2e}" for label, got, eager in zz["errors"]
               if not within_tolerance(got, eager)]
        assert not bad and not zz["problems"], f"rank {rank}:\n" + "\n".join(bad + zz["problems"])
        assert "needs ring_zigzag" in zz["refused"]


def test_relayouts_and_all_to_alls_pipelined_over_head_groups(results):
    """ring_zigzag's relayouts and ulysses's (at 4 ranks also hybrid:2:2's) all-to-alls split
    over 2 head groups (group g+1's in flight while group g computes): forward and backward
    match full attention (MHA and GQA), the forward's all-to-alls are two of half the size each
    way, and head counts the groups do not divide are refused."""
    _, ranks = results
    for rank, res in enumerate(ranks):
        hg = res["head_groups"]
        assert len(hg["errors"]) == 5 * hg["runs"]
        bad = [f"{label}: {got:.2e} vs eager {eager:.2e}" for label, got, eager in hg["errors"]
               if not within_tolerance(got, eager)]
        assert not bad and not hg["problems"], f"rank {rank}:\n" + "\n".join(bad + hg["problems"])
        assert all("head groups" in r and "do not divide" in r for r in hg["refused"]), hg["refused"]


def test_kept_training_forms_equal_the_plain_schedules_and_move_dout_alone(results):
    """ring_zigzag, ulysses and the hybrids with U > 1 keep q, k, v, out, lse in the layout their
    attention ran in (1 and 2 head groups): the backward from the kept tensors gives the plain
    backward's gradients bit for bit and moves only dout there (and dq, dk, dv back)."""
    _, ranks = results
    for rank, res in enumerate(ranks):
        assert not res["kept"], f"rank {rank}:\n" + "\n".join(res["kept"])


def test_dkv_hops_travel_in_bf16_where_lossless_with_the_bits_of_an_fp32_ring(results):
    """With bf16 kernel gradients, ring_bwd's dK/dV sums go in bf16 on the hops that lose
    nothing (at world 2 every hop; at 4 the first where one term is held, and the last), and
    dq, dk, dv are bit-identical to a ring whose every hop is fp32."""
    world, ranks = results
    for rank, res in enumerate(ranks):
        assert not res["grad_ring"], f"rank {rank}:\n" + "\n".join(res["grad_ring"])


def test_dkv_hop_dtypes_by_plan():
    """Which hops are bf16 (half terms): world 2 all; world 4 contiguous causal: a block's sums
    hold one term until a later rank sees it in full (rank 0's step 1 holds block 3: skipped
    under causal); the last hop always."""
    from torch_commopt.kernels.attention.ring import contiguous_plan, zigzag_plan

    for plan in (contiguous_plan(True), contiguous_plan(False), zigzag_plan(True)):
        assert cp_programs.dkv_hop_dtypes(plan, 2, 0, True) == [True, True]
        assert cp_programs.dkv_hop_dtypes(plan, 2, 1, False) == [False, True]
    assert cp_programs.dkv_hop_dtypes(contiguous_plan(True), 4, 0, True) == [True, True, False, True]
    assert cp_programs.dkv_hop_dtypes(contiguous_plan(True), 4, 2, True) == [True, False, False, True]
    assert cp_programs.dkv_hop_dtypes(zigzag_plan(True), 4, 1, True) == [True, False, False, True]


def test_every_schedule_on_strided_subgroups_of_a_mesh():
    """CP over the outer dim of a (cp, dp) mesh: groups {0, 2} and {1, 3}."""
    for rank, (errors, problems) in enumerate(run_distributed(cp_programs.run_cp_cases_on_strided_subgroups, 4,
                                                              timeout_s=300)):
        assert len(errors) == len(cp_programs.cases(2)) * 5 and not problems, problems
        bad = [f"{label}: {got:.2e} vs eager {eager:.2e}" for label, got, eager in errors
               if not within_tolerance(got, eager)]
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
