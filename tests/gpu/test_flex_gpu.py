"""FlexAttention context parallelism on GPUs (issue 70): the rewritten graph's ops with their flex
kernels compiled by Inductor, ring and all-gather, every mask (causal, documents, sliding window,
documents + window; GQA), the whole mask or the rank's rows; and a program compiled with
backend="commopt" for inference and a training step -- against dense float64 attention, within
4x single-GPU FlexAttention's own bf16 error (flex_cases)."""

from __future__ import annotations

import pytest
from flex_cases import (
    run_flex_batches,
    run_flex_ce,
    run_flex_compiled,
    run_flex_hybrid,
    run_flex_ops,
    run_flex_ops_pulled,
    run_flex_ulysses,
    run_sdpa_dense_mask,
    run_torch_cp_flex,
)

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


def _bad(results) -> list[str]:
    return [f"{label}: {err:.2e} vs single-GPU flex {ref:.2e}" for label, err, ref in results
            if not within_tolerance(err, ref)]


@pytest.mark.gpu
def test_flex_ops_match_whole_sequence_attention(two_ranks):
    _all_within_tolerance(two_ranks, run_flex_ops, 5 * 2 * 3 * 4)  # masks x (whole, own rows) x schedules x (out, dq, dk, dv)


def _all_within_tolerance(ranks, fn, count: int, *args) -> None:
    """fn's results on every rank: `count` of them, each within single-GPU flex's own error."""
    world, backend = ranks
    for results in run_distributed(fn, world, *args, backend=backend, timeout_s=500):
        assert len(results) == count
        assert not _bad(results), "\n".join(_bad(results))


def _with_the_copy_engine_ring(ranks, monkeypatch) -> None:
    """run_flex_ops with the ring on the copy engine (ce_ring) and bounded waits: its backward
    runs the K/V ring and the dK/dV ring at once, on channels 0 and 1."""
    for name, value in {"TORCH_COMMOPT_ATTENTION_TRANSPORT": "ce", "TORCH_COMMOPT_DEBUG_WAITS": "1",
                        "TORCH_COMMOPT_WAIT_TIMEOUT_S": "60"}.items():
        monkeypatch.setenv(name, value)
    _all_within_tolerance(ranks, run_flex_ops, 5 * 2 * 3 * 4)


@pytest.mark.gpu
def test_flex_ops_with_the_copy_engine_ring_match_whole_sequence_attention(two_ranks, monkeypatch):
    _with_the_copy_engine_ring(two_ranks, monkeypatch)


@pytest.mark.gpu
def test_flex_ops_with_the_pulled_gather_match_whole_sequence_attention(two_ranks, monkeypatch):
    """TORCH_COMMOPT_FLEX_GATHER_CUT=1: the one-group all-gather pulls only the keys its rows keep
    tiles of (ce_gather.all_gather_kv_pulled), kept for the backward and gathered again, and its
    reduce-scatter pushes only their gradients (ce_gather.reduce_scatter_kv_cut)."""
    monkeypatch.setenv("TORCH_COMMOPT_FLEX_GATHER_CUT", "1")
    _all_within_tolerance(two_ranks, run_flex_ops_pulled, 5 * 2 * 2 * 4)


@pytest.mark.gpu
def test_flex_ops_with_the_copy_engine_ring_at_worlds_3_and_4(more_ranks, monkeypatch):
    """Rings of two and three steps: blocks in both halves of a channel."""
    _with_the_copy_engine_ring(more_ranks, monkeypatch)


@pytest.mark.gpu
def test_the_hybrid_schedule_at_four_ranks_matches_whole_sequence_attention(four_ranks):
    world, backend = four_ranks
    for results in run_distributed(run_flex_hybrid, world, backend=backend, timeout_s=500):
        assert len(results) == 4 * 4, results  # masks x (out, dq, dk, dv)
        assert not _bad(results), "\n".join(_bad(results))


@pytest.mark.gpu
def test_the_all_gather_s_k_v_moved_by_the_copy_engine_match_nccl_s(two_ranks, monkeypatch):
    """ce_gather under TORCH_COMMOPT_ATTENTION_TRANSPORT=ce: the gathered K/V and the forward equal
    NCCL's bit for bit (copies only), dK/dV within single-GPU flex's error, and the copy engine
    did move them (two gathers and one sum a mask and pass pair)."""
    monkeypatch.setenv("TORCH_COMMOPT_ATTENTION_TRANSPORT", "ce")
    world, backend = two_ranks
    for got in run_distributed(run_flex_ce, world, backend=backend, timeout_s=400):
        assert not _bad(got["results"]), "\n".join(_bad(got["results"]))
        assert got["moves"] == {"all_gather_kv": 2 * 3, "reduce_scatter_kv": 2 * 2}, got["moves"]
        for kind, equal in got["same"]:  # out, dq, dk, dv (kept); out, dq, dk, dv; K, V gathered
            assert equal[0] and equal[4] and equal[8] and equal[9], (kind, equal)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["ring", "allgather"])
def test_a_compiled_flex_program_runs_the_cp_ops_and_matches(two_ranks, schedule):
    world, backend = two_ranks
    for got in run_distributed(run_flex_compiled, world, schedule, backend=backend, timeout_s=500):
        assert any(f"cp_flex_attention_fwd {schedule}" in n for n in got["notes"]), got["notes"]  # inference
        assert any(f"cp_flex_attention_fwd/bwd {schedule} in the joint graph" in n for n in got["notes"]), got["notes"]
        assert len(got["results"]) == 5
        assert not _bad(got["results"]), "\n".join(_bad(got["results"]))


@pytest.mark.gpu
def test_torch_context_parallel_with_flex_runs_the_cp_ops_and_matches(two_ranks):
    """torch's _ContextParallel(FLEX) with its PTRR load balancer (documents), the block compiled
    with commopt and trained one step: its cplib gather becomes the flex ops (the model's pick)."""
    world, backend = two_ranks
    for got in run_distributed(run_torch_cp_flex, world, backend=backend, timeout_s=500):
        assert any("cp_flex_attention_fwd/bwd" in n for n in got["notes"]), got["notes"]
        assert not _bad(got["results"]), "\n".join(_bad(got["results"]))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["allgather", "auto"])
def test_a_ulysses_program_around_flex_runs_the_cp_ops_or_keeps_its_own(two_ranks, schedule):
    """Ulysses all-to-alls around flex_attention (whole-sequence documents + window mask): a named
    schedule runs as the flex ops in inference and training; auto runs the model's pick, which
    may keep the program's own Ulysses (explain says which); either way within tolerance."""
    world, backend = two_ranks
    for got in run_distributed(run_flex_ulysses, world, schedule, backend=backend, timeout_s=500):
        done = [n for n in got["notes"] if "flex_ulysses" in n]
        assert done, got["notes"]
        if schedule != "auto":  # the inference graph's and the joint graph's
            assert any("cp_flex_attention_fwd allgather (" in n for n in done), done
            assert any("cp_flex_attention_fwd/bwd allgather in the joint graph" in n for n in done), done
        assert len(got["results"]) == 5
        assert not _bad(got["results"]), "\n".join(_bad(got["results"]))


@pytest.mark.gpu
def test_new_documents_each_batch_compile_no_kernel_again(two_ranks):
    """Three batches of new documents through one compiled training step: one Dynamo graph, and
    the block kernels compiled at the first batch serve the others."""
    world, backend = two_ranks
    for got in run_distributed(run_flex_batches, world, backend=backend, timeout_s=500):
        assert got["graphs"][1:] == [got["graphs"][0]] * 2, got["graphs"]  # nothing compiled again
        assert got["compiled"][0] > 0 and got["compiled"][1:] == [got["compiled"][0]] * 2, got["compiled"]
        assert not _bad(got["results"]), "\n".join(_bad(got["results"]))


@pytest.mark.gpu
def test_sdpa_with_a_documents_mask_runs_the_flex_ops(two_ranks):
    """SDPA with a boolean documents mask over all-gathered K/V (inference): the flex ops, the mask
    a buffer of the compiled flex kernel, its tables made at run time (on CUDA SDPA hands cuDNN
    the mask as an additive where() of it, read back to the boolean: mask_forms.boolean_of)."""
    world, backend = two_ranks
    for got in run_distributed(run_sdpa_dense_mask, world, backend=backend, timeout_s=300):
        assert any("cp_flex_attention_fwd" in n for n in got["notes"]), got["notes"]
        assert not _bad(got["results"]), "\n".join(_bad(got["results"]))
