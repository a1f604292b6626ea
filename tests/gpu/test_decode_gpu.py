"""The distributed decoding attention on GPUs: the split-KV Triton kernel against the reference's
local attention (bf16 included, which Triton's CPU interpreter cannot run), and the op over a
sequence-sharded cache eager and replayed from a CUDA graph, over the low-latency all-gather and
over NCCL, against attention over the whole cache."""

from __future__ import annotations

import pytest
from decode_cases import check_split_kv, run_decode_op

from torch_commopt.testing.launch import run_distributed


@pytest.mark.gpu
def test_split_kv_kernel_matches_the_reference_local_attention(one_gpu):
    bad = check_split_kv(one_gpu)
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["ll", "nccl"])
def test_decode_attention_eager_and_replayed_matches_the_whole_cache(two_ranks, transport, monkeypatch):
    world, backend = two_ranks
    if transport == "nccl" and backend != "nccl":
        pytest.skip("NCCL needs a GPU per rank (ranks sharing a GPU run gloo, which a CUDA graph cannot capture)")
    monkeypatch.setenv("TORCH_COMMOPT_DECODE_TRANSPORT", transport)
    for bad, told in run_distributed(run_decode_op, world, backend=backend, timeout_s=400):
        assert not bad, bad
        assert not any("NCCL gathers" in t for t in told) if transport == "ll" else True, told
