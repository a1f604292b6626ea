"""The CUDA (sm_90a) fused GEMMs on the CPU: their sources build with nvcc (where there is one)
into a library with both entry points, they refuse what they cannot take, and `impl=sm90` is a
fused option that schedules offer for all-gathers only (their GPU numerics:
tests/gpu/test_sm90_gemm.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.matmul.gpu import sm90


def test_the_kernel_source_builds_with_its_entry_points(tmp_path, monkeypatch):
    if sm90._nvcc() is None:
        pytest.skip("no nvcc")
    monkeypatch.setenv("TORCH_COMMOPT_CACHE_DIR", str(tmp_path))
    built = sm90._compile()
    assert built.parent == tmp_path / "native" and built.stat().st_size > 0
    lib = ctypes.CDLL(str(built))
    for entry in ("ag_gemm_words", "rs_gemm_words", "ag_ready", "rs_ready"):
        assert hasattr(lib, f"commopt_sm90_{entry}"), entry
    assert sm90._compile() == built  # cached by the source's and flags' digest


def test_a_failed_build_is_reported_and_the_triton_kernel_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_COMMOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sm90, "_nvcc", lambda: None)
    monkeypatch.setattr(sm90, "_state", {"lib": None, "why": None})
    with caplog.at_level("WARNING", logger=sm90.__name__):
        assert sm90.library() is None
    assert "no nvcc" in sm90.why_not()
    assert any("Triton fused kernels run" in r.getMessage() for r in caplog.records)


def test_the_kernels_refuse_what_they_cannot_take():
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import RsSegments, RsTargets

    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    w = torch.zeros(256, 128, dtype=torch.bfloat16).t()
    out = torch.zeros(256, 256, dtype=torch.bfloat16)
    assert sm90.ag_refusal(a, a, [w], [out], [None]) == "not an sm_90 GPU"
    targets = RsTargets(out[:128], out, out.view(2, 128, 256), torch.zeros(2, dtype=torch.int64), 0, True, True)
    assert sm90.rs_refusal(a, w, targets, RsSegments(0, 2, 128, 128, 1)) == "not an sm_90 GPU"


def test_impl_is_a_fused_option_with_known_values():
    assert Schedule.parse("fused:1:impl=sm90").param("impl") == "sm90"
    assert Schedule.parse("fused:2:impl=triton").param("impl") == "triton"
    for bad in ("ce_push:1:impl=sm90", "fused:1:impl=cuda"):
        with pytest.raises(ValueError, match="impl is a fused option"):
            Schedule.parse(bad)


def test_the_reduce_scatter_takes_impl_sm90_as_fused_does():
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import unsupported_reason

    a, w = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(128, 256, dtype=torch.bfloat16)
    assert unsupported_reason(a, w, 0, 2, Schedule.parse("fused:2:impl=sm90"), "g") is None
    assert unsupported_reason(a.float(), w.float(), 0, 2, Schedule.parse("fused:2:impl=sm90"), "g") is not None


def test_the_reduce_scatter_words_agree_with_the_c_launcher():
    """sm90.RS_WORDS is the order rs_gemm_sm90.cu's words launcher reads: as many scalar words as
    its call takes before the destinations, which start at the index it passes (`w + N`), and as
    many destinations as its MAX_RANKS."""
    import re

    src = (sm90.NATIVE / "rs_gemm_sm90.cu").read_text()
    assert int(re.search(r"constexpr int MAX_RANKS = (\d+);", src).group(1)) == sm90.RS_MAX_RANKS
    words_fn = src[src.index("int commopt_sm90_rs_gemm_words"):]
    call = words_fn[words_fn.index("return commopt_sm90_rs_gemm(") + len("return commopt_sm90_rs_gemm("):]
    call = call[:call.index(");")]
    indices = [int(a or b) for a, b in re.findall(r"(?:ptr|i32|f32)\((\d+)\)|w\[(\d+)\]", call)]
    dst_at = int(re.search(r"w \+ (\d+)", call).group(1))
    assert indices == list(range(dst_at)) and sm90.RS_WORDS.index("dst0") == dst_at
    assert sm90.RS_WORDS[dst_at:] == tuple(f"dst{s}" for s in range(sm90.RS_MAX_RANKS))
    assert all(sm90.RS_WORDS.index(f"dst{s}") in sm90.RS_ADDRESSES for s in range(sm90.RS_MAX_RANKS))


@pytest.mark.parametrize("direct", [True, False])
def test_the_reduce_scatter_destinations(direct):
    """Direct: each peer's receive slot `rank` (its buffer's host base + the slots' offset + rank
    segments); store=ce: the local send buffer's segments; 0 at this rank's own and past the world."""
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import RsSegments, RsTargets

    m_seg, n, world, rank, off = 64, 256, 3, 1, 512
    send = torch.zeros(world, m_seg, n, dtype=torch.bfloat16)
    out = torch.zeros(m_seg, n, dtype=torch.bfloat16)
    bases = (1 << 40, 2 << 40, 3 << 40)
    targets = RsTargets(out, send, send, torch.zeros(world, dtype=torch.int64), off, direct, True, bases)
    dst = sm90.rs_destinations(targets, RsSegments(rank, world, m_seg, m_seg, 1), n)
    seg = m_seg * n * 2
    want = ([bases[0] + off * 2 + rank * seg, 0, bases[2] + off * 2 + rank * seg] if direct
            else [send.data_ptr(), 0, send.data_ptr() + 2 * seg])
    assert dst == want + [0] * (sm90.RS_MAX_RANKS - world)
