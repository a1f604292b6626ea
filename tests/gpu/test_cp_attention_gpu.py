"""Context-parallel attention on 2 GPUs (NCCL, cuDNN local kernels, the Triton merge): every
schedule, both sequence layouts and the head-group pipelines against full attention (see
attention_cases), Ulysses's all-to-alls by the copy engine (kernels/attention/ce_a2a.py, the CUDA
default); again with the ring's K/V pushed by the copy engine too (kernels/attention/ce_ring.py,
TORCH_COMMOPT_ATTENTION_TRANSPORT=ce) and bounded waits, so a protocol error raises; with
Ulysses's head groups on one compute stream (TORCH_COMMOPT_ATTENTION_GROUP_STREAMS=0; by default
the odd ones run on a second) and with the forward's only on two ("fwd"); and with NCCL's
all-to-alls (TORCH_COMMOPT_ATTENTION_A2A=nccl)."""

from __future__ import annotations

import pytest
from attention_cases import run_cp_attention_cases

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


def _check_all(ranks: tuple[int, str]) -> None:
    world, backend = ranks
    for results in run_distributed(run_cp_attention_cases, world, backend=backend, timeout_s=400):
        assert len(results) >= 60
        bad = [f"{label}: {err:.2e} vs eager bf16 {ref:.2e}" for label, err, ref in results
               if not within_tolerance(err, ref)]
        assert not bad, "\n".join(bad)


@pytest.mark.gpu
def test_every_cp_schedule_matches_full_attention_on_gpus(two_ranks):
    _check_all(two_ranks)


@pytest.mark.gpu
def test_every_cp_schedule_matches_full_attention_at_worlds_3_and_4(more_ranks, monkeypatch):
    # the copy-engine all-to-alls and ring over three and four ranks (a ring of two and three
    # steps), hybrid:2:2 among the schedules at four
    monkeypatch.setenv("TORCH_COMMOPT_ATTENTION_TRANSPORT", "ce")
    monkeypatch.setenv("TORCH_COMMOPT_DEBUG_WAITS", "1")
    _check_all(more_ranks)


@pytest.mark.gpu
@pytest.mark.parametrize("env", [{"TORCH_COMMOPT_ATTENTION_TRANSPORT": "ce"},
                                 # Ulysses's head groups one after the other on one compute stream
                                 # (the default runs both passes' odd ones on a second:
                                 # ce_a2a.GROUP_STREAMS_ENV), and the forward's only on two
                                 {"TORCH_COMMOPT_ATTENTION_GROUP_STREAMS": "0"},
                                 {"TORCH_COMMOPT_ATTENTION_GROUP_STREAMS": "fwd"}],
                         ids=["copy_engine_ring", "one_compute_stream", "two_streams_forward_only"])
def test_every_cp_schedule_matches_full_attention_with_bounded_waits(two_ranks, monkeypatch, env):
    for name, value in {**env, "TORCH_COMMOPT_DEBUG_WAITS": "1", "TORCH_COMMOPT_WAIT_TIMEOUT_S": "60"}.items():
        monkeypatch.setenv(name, value)
    _check_all(two_ranks)


@pytest.mark.gpu
def test_every_cp_schedule_matches_full_attention_with_nccl_all_to_alls(two_ranks, monkeypatch):
    monkeypatch.setenv("TORCH_COMMOPT_ATTENTION_A2A", "nccl")
    _check_all(two_ranks)


@pytest.mark.gpu
def test_attention_tune_measures_on_gpus_and_every_rank_agrees(two_ranks, tmp_path):
    import json

    from attention_cases import tune_attention

    results = run_distributed(tune_attention, two_ranks[0], str(tmp_path), backend=two_ranks[1], timeout_s=400)
    best, measured = results[0]
    assert all(r == results[0] for r in results[1:]), results  # the slowest rank's figures, on every rank
    assert best == min(measured, key=measured.get) and all(ms > 0 for ms in measured.values()), measured
    entries = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    stored = [e for e in entries if e["key"].get("question") == "attention"]
    assert [e["value"] for e in stored] == [{"schedule": best, "measured_ms": measured}], stored
    # every candidate of the question timed: the model's top-2, their head-group depths, allgather
    # (two when the top-2 are depthless and hold allgather, as 2x H100 ranked ring, allgather)
    assert sorted(measured) == sorted(stored[0]["key"]["candidates"]) and "allgather" in measured, stored


@pytest.mark.gpu
@pytest.mark.parametrize("busy_ms", [0, 50], ids=["idle", "busy"])
def test_copy_engine_all_to_alls_stay_exact_while_their_buffer_grows(two_ranks, busy_ms):
    from attention_cases import run_a2a_buffer_growth

    for results in run_distributed(run_a2a_buffer_growth, two_ranks[0], busy_ms, backend=two_ranks[1], timeout_s=300):
        assert all(same for _, same, _ in results), results
        assert results[0][2] >= 512 and results[1][2] >= 1024, results  # it did grow
