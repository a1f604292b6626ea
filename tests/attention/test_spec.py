"""spec.py: schedule names and refusals; ops.py: the fake impls (shapes, refusal at trace time)
and a lean import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_commopt.core.attention_spec import CPSchedule, refusal


@pytest.mark.parametrize("text", ["allgather", "ring", "ring_zigzag", "ulysses", "hybrid:2:4", "hybrid:1:8",
                                  "ulysses:g=1", "ring_zigzag:g=2", "hybrid:2:4:g=2"])
def test_names_round_trip(text):
    assert str(CPSchedule.parse(text)) == text and CPSchedule.parse(CPSchedule.parse(text)) == CPSchedule.parse(text)


@pytest.mark.parametrize("text,match", [("zigzag", "unknown name"), ("ring:2", "takes no parameters"),
                                        ("hybrid:2", "hybrid:U:R"), ("hybrid:0:4", "U, R >= 1"),
                                        ("hybrid:a:b", "hybrid:U:R"), ("ring:g=2", "only"),
                                        ("allgather:g=1", "only"), ("ulysses:g=0", ">= 1"), ("ulysses:g=x", "g=G"),
                                        ("hybrid:2:g=2", "hybrid:U:R")])
def test_bad_names_raise_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        CPSchedule.parse(text)


def test_degrees():
    assert CPSchedule.parse("ulysses").degrees(8) == (8, 1)
    assert CPSchedule.parse("ring_zigzag").degrees(8) == (1, 8)
    assert CPSchedule.parse("hybrid:2:4").degrees(8) == (2, 4)


@pytest.mark.parametrize("sched,shape,world,causal,reason", [
    ("ring_zigzag", (1, 8, 8, 12, 64), 4, True, "2*W = 8 equal chunks"),  # S_loc = 3: odd
    ("ulysses", (1, 8, 2, 16, 64), 4, False, "not both divisible by 4"),  # kv heads 2 over 4 ranks
    ("ulysses", (1, 6, 6, 16, 64), 4, True, "not both divisible by 4"),
    ("hybrid:2:2", (1, 6, 1, 16, 64), 4, True, "not both divisible by 2"),
    ("hybrid:2:4", (1, 8, 8, 16, 64), 4, True, "degrees 2 x 4 != world size 4"),
    ("ring", (1, 6, 4, 16, 64), 2, True, "kv heads 4 do not divide query heads 6"),
    ("ring", (1, 8, 8, 15, 64), 2, True, "not a multiple of the world size"),
    ("allgather", (0, 8, 8, 16, 64), 2, True, "sizes must be positive"),
    ("ulysses:g=2", (1, 8, 2, 16, 64), 2, True, "2 head groups of 2 rank(s) do not divide"),  # kv 2 over 2x2
    ("ring_zigzag:g=4", (1, 8, 2, 16, 64), 2, True, "4 head groups of 1 rank(s) do not divide"),
])
def test_refusals_say_why(sched, shape, world, causal, reason):
    assert reason in refusal(sched, shape, world, causal)


@pytest.mark.parametrize("sched,shape,world,causal", [
    ("ring_zigzag", (1, 8, 8, 12, 64), 4, False),  # no mask: runs ring, takes any length
    ("ring_zigzag", (1, 8, 8, 16, 64), 4, True),
    ("ulysses", (1, 8, 4, 16, 64), 4, True), ("hybrid:2:2", (1, 6, 2, 16, 64), 4, True),
    ("ring", (1, 8, 1, 12, 64), 4, True), ("allgather", (1, 8, 1, 12, 64), 4, True)])
def test_shapes_taken(sched, shape, world, causal):
    assert refusal(sched, shape, world, causal) is None


def test_pipeline_groups_are_the_schedules_or_the_rules():
    from torch_commopt.core.attention_spec import pipeline_groups

    big, small = 128 << 20, 1 << 20  # one rank's q bytes: two groups of >= 32 MiB, or not
    assert pipeline_groups("ulysses", big, 32, 8, 2) == 2 and pipeline_groups("ulysses", small, 32, 8, 2) == 1
    assert pipeline_groups("ulysses:g=1", big, 32, 8, 2) == 1 and pipeline_groups("ulysses:g=2", small, 32, 8, 2) == 2
    assert pipeline_groups("ring_zigzag", big, 32, 8, 2) == 2 and pipeline_groups("ring_zigzag:g=1", big, 32, 8, 2) == 1
    assert pipeline_groups("hybrid:1:2", big, 32, 8, 2) == 1 and pipeline_groups("ring", big, 32, 8, 2) == 1


def test_fake_impls_give_shapes_and_refuse_at_trace_time():
    """The ops' fake impls (what a graph pass traces with) need no process group."""
    import torch_commopt.kernels.attention.ops  # noqa: F401  (registers the ops)

    with FakeTensorMode():
        q, dout = torch.empty(2, 8, 6, 64), torch.empty(2, 8, 6, 32)
        k, v = torch.empty(2, 2, 6, 64), torch.empty(2, 2, 6, 32)
        out, lse = torch.ops.commopt.cp_attention_fwd(q, k, v, "ring", True, None, 4, "unused", "auto")
        assert out.shape == (2, 8, 6, 32) and lse.shape == (2, 8, 6) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.commopt.cp_attention_bwd(dout, q, k, v, out, lse, "ulysses", True, None, 2, "x")
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        q_odd, k_odd = torch.empty(1, 8, 3, 64), torch.empty(1, 8, 3, 64)
        with pytest.raises(ValueError, match="cp attention ring_zigzag: sequence length 12"):
            torch.ops.commopt.cp_attention_fwd(q_odd, k_odd, k_odd, "ring_zigzag", True, None, 4, "x", "auto")
        with pytest.raises(ValueError, match="cp attention ulysses: .* kv heads 2 are not both divisible by 4"):
            torch.ops.commopt.cp_attention_fwd(q, k, v, "ulysses", True, None, 4, "x", "auto")


def test_kept_pair_fakes_give_shapes_and_refuse_kept_tensors_that_do_not_fit():
    import torch_commopt.kernels.attention.ops  # noqa: F401  (registers the ops)

    with FakeTensorMode():
        q, k, v = torch.empty(2, 8, 6, 64), torch.empty(2, 4, 6, 64), torch.empty(2, 4, 6, 32)
        out, *kept = torch.ops.commopt.cp_attention_fwd_keep(q, k, v, "ulysses:g=2", False, None, 2, "x", "auto")
        # 2 head groups of 8 / (2 groups x 2 ranks) = 2 query heads over the whole sequence (12)
        assert [tuple(t.shape) for t in kept] == [(2, 2, 2, 12, 64), (2, 2, 1, 12, 64), (2, 2, 1, 12, 32),
                                                  (2, 2, 2, 12, 32), (2, 2, 2, 12)]
        dout = torch.empty(2, 8, 6, 32)
        dq, dk, dv = torch.ops.commopt.cp_attention_bwd_kept(dout, *kept, "ulysses:g=2", False, None, 2, "x", "auto")
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        with pytest.raises(ValueError, match="do not fit"):  # dout of another head dim
            torch.ops.commopt.cp_attention_bwd_kept(torch.empty(2, 8, 6, 64), *kept, "ulysses:g=2", False, None, 2,
                                                    "x", "auto")
        with pytest.raises(ValueError, match="do not fit"):  # out kept for another sequence length
            torch.ops.commopt.cp_attention_bwd_kept(dout, *kept[:3], torch.empty(2, 2, 2, 10, 32), kept[4],
                                                    "ulysses:g=2", False, None, 2, "x", "auto")
        with pytest.raises(ValueError, match="do not fit"):  # ring moves nothing: it has no kept form
            torch.ops.commopt.cp_attention_bwd_kept(dout, *kept, "ring", False, None, 2, "x", "auto")
        with pytest.raises(ValueError, match="are not"):
            torch.ops.commopt.cp_attention_bwd_kept(dout, *kept[:4], torch.empty(2, 2, 2, 12, 1), "ulysses:g=2",
                                                    False, None, 2, "x", "auto")


def test_import_touches_neither_cuda_nor_a_process_group():
    code = ("import torch, torch.distributed as dist, torch_commopt.kernels.attention.ops\n"
            "assert not torch.cuda.is_initialized() and not dist.is_initialized()\n"
            "assert hasattr(torch.ops.commopt, 'cp_attention_fwd')\n"
            "import sys; assert 'torch_commopt.kernels.attention.fused' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_zigzag_pipelines_its_relayouts_over_two_head_groups_for_large_shards_only():
    from torch_commopt.core.attention_spec import ZIGZAG_PIPELINE_MIN_BYTES, zigzag_head_groups

    big = 2 * ZIGZAG_PIPELINE_MIN_BYTES
    assert zigzag_head_groups(big, 8) == 2  # e.g. 8K tokens/GPU, H 32, D 128, bf16: 64 MiB of q
    assert zigzag_head_groups(big - 2, 8) == 1  # each group would keep less than the minimum
    assert zigzag_head_groups(4 * big, 1) == 1  # MQA: one K/V head cannot be split


def test_ulysses_pipelines_its_all_to_alls_over_two_head_groups_for_large_shards_only():
    from torch_commopt.core.attention_spec import ULYSSES_PIPELINE_MIN_BYTES, ulysses_head_groups

    least = ULYSSES_PIPELINE_MIN_BYTES
    assert ulysses_head_groups(2 * least, 32, 8, 2) == 2  # e.g. 16K tokens, H 32, bf16: 64 MiB of q
    assert ulysses_head_groups(8 * least, 32, 8, 2) == 2  # never deeper: smaller groups lose to the last wave
    assert ulysses_head_groups(2 * least - 2, 32, 8, 2) == 1  # each group would keep less than the least
    assert ulysses_head_groups(2 * least, 32, 2, 2) == 1  # 2 K/V heads: no 2 groups x 2 ranks
    assert ulysses_head_groups(64 * least, 32, 8, 1) == 1  # no Ulysses rank to move to

