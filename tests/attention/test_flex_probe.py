"""probe_flex_blocks' figures come from its raw times (the GPU run itself is on the device)."""

import pytest
import torch

from benchmarks import probe_flex_blocks as probe


def test_work_rate_ratios_come_from_the_tiles_and_the_times():
    c = {"mask": "docs 4K", "seq": 16384, "world": 2, "rank": 1, "tiles_whole": 3000, "tiles_rank": 2000,
         "blocks_computed": 2, "ms": {"whole fwd": 2.0, "whole bwd": 6.0, "rank fwd": 1.5, "rank bwd": 5.0,
                                     "allgather fwd": 1.25, "allgather bwd": 4.0},
         "fwd_error": 1e-3, "lse_error": 1e-6, "dq_error": 2e-3, "dq_scale": 2.5, "compile_s": 9.0,
         "steps_host_ms": 0.4, "steps_cached_ms": 0.01,
         "layouts": {"contiguous": {"tiles": [1000, 2000], "fwd": [0.5, 1.5], "bwd": [2.0, 4.0]},
                     "by_work": {"tiles": [1500, 1500], "fwd": [1.0, 1.1], "bwd": [3.5, 3.0]}}}
    (d,) = probe.derive([c])
    assert d["fwd_ratio"] == pytest.approx((2000 / 1.5) / (3000 / 2.0))
    assert d["bwd_ratio"] == pytest.approx((2000 / 5.0) / (3000 / 6.0))
    assert d["allgather_fwd_ratio"] == pytest.approx((2000 / 1.25) / (3000 / 2.0))
    assert d["allgather_bwd_ratio"] == pytest.approx((2000 / 4.0) / (3000 / 6.0))
    meta = {"device": "NVIDIA H200", "commit": "c", "date": "d", "torch": "t", "rounds": 10}
    assert d["layouts"]["contiguous"]["bound"]["fwd"] == pytest.approx(2.0 / (2 * 1.5))
    assert d["layouts"]["by_work"]["bound"]["fwd+bwd"] == pytest.approx(8.0 / (2 * 4.5))
    text = probe.report([d], meta)
    assert "| docs 4K | 16384 | 2 | by_work | 1500 / 1500 | 1.100 | 3.500 | 0.909 | 0.857 | 0.889 |" in text
    assert "| docs 4K | 16384 | 2 | 3000 / 2000 | 2 |" in text and text.count("| 0.40 / 0.010 |") == 1


def _case() -> dict:
    lay = {"tiles": [400, 380], "fwd": [0.4, 0.5], "bwd": [1.2, 1.3],
           "own": {"fwd": [0.35, 0.4], "bwd": [0.9, 1.1]}}
    return {"mask": "docs 1K", "seq": 16384, "world": 2, "tiles_whole": 780, "tiles_rank": 380,
            "blocks_computed": 2, "fwd_error": 1e-3, "dq_error": 1e-3, "dq_scale": 1.0,
            "ms": {"whole fwd": 0.7, "whole bwd": 1.8, "rank fwd": 0.5, "rank bwd": 1.5},
            "layouts": {"contiguous": lay, "by_work": {k: v for k, v in lay.items() if k != "own"}}}


def test_the_shares_alone_bound_is_the_whole_kernel_over_world_times_the_slowest_share():
    lay = probe.derive([_case()])[0]["layouts"]
    # slowest share alone: 0.4 + 1.1 = 1.5 ms; whole 2.5 ms over 2 ranks
    assert lay["contiguous"]["bound"]["alone"] == pytest.approx(2.5 / (2 * 1.5))
    assert lay["contiguous"]["bound"]["fwd+bwd"] == pytest.approx(2.5 / (2 * 1.8))
    assert "alone" not in lay["by_work"]["bound"]


def test_the_report_shows_the_shares_alone_only_for_the_contiguous_layout():
    meta = {"device": "GPU", "commit": "abc", "date": "d", "torch": "t", "rounds": 3}
    rows = [line for line in probe.report(probe.derive([_case()]), meta).splitlines() if line.startswith("| docs 1K")]
    layout_rows = [r for r in rows if "contiguous" in r or "by_work" in r]
    assert layout_rows[0].endswith("| 0.833 | - |") and "contiguous" in layout_rows[0]
    assert layout_rows[1].endswith("| - | - |") and "by_work" in layout_rows[1]


def test_the_ring_bound_sums_each_rank_s_calls_a_source():
    case = _case()
    case["layouts"]["contiguous"]["ring"] = {"fwd": [0.5, 0.42], "bwd": [1.3, 1.2]}
    lay = probe.derive([case])[0]["layouts"]
    # the busiest rank's calls: 0.5 + 1.3 = 1.8 ms; whole 2.5 ms over 2 ranks
    assert lay["contiguous"]["bound"]["ring"] == pytest.approx(2.5 / (2 * 1.8))
    assert "ring" not in lay["by_work"]["bound"]
    meta = {"device": "GPU", "commit": "abc", "date": "d", "torch": "t", "rounds": 3}
    row = [r for r in probe.report([case], meta).splitlines() if r.startswith("| docs 1K") and "contiguous" in r]
    assert row and row[0].endswith("| 0.833 | 0.694 |")


def test_the_report_states_its_kernels_and_rounds():
    meta = {"device": "GPU", "commit": "abc", "date": "d", "torch": "t", "rounds": 3}
    cases = probe.derive([_case()])
    assert "default kernels" in probe.report(cases, meta) and "median of 3 calls" in probe.report(cases, meta)


def test_every_layout_s_calls_run_on_a_cpu_with_the_ring_s_per_source_calls(monkeypatch):
    """layouts() on a CPU (flex's blocks in plain torch there), each call run once: the contiguous
    layout and choose's, the ring's calls a source where asked (not by_work's), own first."""
    calls = []
    monkeypatch.setattr(probe, "_ms", lambda fn, reps: calls.append(fn()) or 1.0)
    seq, gen = 1024, torch.Generator().manual_seed(0)
    q, dout, out = (torch.randn(1, probe.H, seq, probe.D, generator=gen) for _ in range(3))
    k, v = (torch.randn(1, probe.H_KV, seq, probe.D, generator=gen) for _ in range(2))
    lse = torch.randn(1, probe.H, seq, generator=gen)
    got = probe.layouts("docs 128", seq, 2, 1, [q, k, v, dout, out, lse])
    assert "contiguous" in set(got)  # choose's may be contiguous itself
    assert "ring" in got["contiguous"] and "own" in got["contiguous"]
    assert all("ring" not in got[name] for name in got if name == "by_work")
    assert all(len(got[name]["fwd"]) == 2 for name in got)
    assert all(1.0 <= ms <= 2.0 for ms in got["contiguous"]["ring"]["fwd"])  # own, and at most one other source


def test_the_kernels_section_rates_the_backward_s_main_kernel_apart_from_the_rest():
    case = _case()
    fwd_tem, bwd_tem = "triton_tem_fused_flex_attention_0", "triton_tem_fused_flex_attention_backward_1"
    delta = "triton_per_fused_flex_attention_backward_0"
    case["kernels"] = {"whole fwd+bwd": {bwd_tem: 1.56, fwd_tem: 0.6, delta: 0.06, "fill": 0.01},
                       "rows, every key bwd": {bwd_tem: 1.0, delta: 0.03},
                       "rows, own keys bwd": {bwd_tem: 0.9, delta: 0.03}}
    case["tiles_own"] = 370
    meta = {"device": "GPU", "commit": "abc", "date": "d", "torch": "t", "rounds": 3}
    text = probe.report(probe.derive([case]), meta)
    # whole rate 780 / 1.56 = 500 tiles a ms; rows: 380 / 1.0 = 380 (0.760), own keys 370 / 0.9 (0.822)
    assert "| docs 1K | 16384 | 2 | 1.560 | 0.070 | 1.000 | 0.030 | 0.760 | 370 | 0.900 | 0.822 |" in text
    del case["kernels"]["rows, own keys bwd"]
    assert "| 0.760 | - | - | - |" in probe.report(probe.derive([case]), meta)
