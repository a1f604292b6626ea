"""benchmarks/bench_host.py's regions and report (CPU: no timing)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import bench_host


def test_the_regions_are_a_tp_sp_layers_forward_per_rank():
    regions = {label: (op, shape, ws) for label, op, shape, ws in bench_host.regions(4, 2048, 2)}
    assert regions["qkv"] == ("ag", (4, 1024, 4096), [(4096, 2048), (4096, 512), (4096, 512)])
    assert regions["w2"] == ("rs", (4, 2048, 7168), [(7168, 4096)])


def test_the_report_puts_each_schedules_replayed_and_python_host_cost_side_by_side():
    rows = [{"region": "wo", "schedule": "nccl+cublas", "mode": "python", "host_us": 100.0, "gpu_ms": 0.45},
            {"region": "wo", "schedule": "direct:1", "mode": "replayed", "host_us": 90.0, "gpu_ms": 0.29},
            {"region": "wo", "schedule": "direct:1", "mode": "python", "host_us": 210.0, "gpu_ms": 0.29}]
    meta = {"device": "NVIDIA H200", "commit": "abc", "date": "2026-11-30", "torch": "2.11", "triton": "3.6"}
    md = bench_host.markdown(rows, meta, SimpleNamespace(world=2, batch=4, seq=2048, rounds=3, calls=10, shared=False))
    assert "| wo | `direct:1` | 90.0 | 210.0 | 0.90x | 0.290 |" in md
    assert "| wo | `nccl+cublas` | - | 100.0 | 1.00x | 0.450 |" in md


def test_a_shared_device_report_has_no_nccl_ratio_nor_gpu_time_and_names_what_did_not_replay():
    rows = [{"region": "wo", "schedule": "fused:1:impl=sm90", "mode": "replayed", "host_us": 60.0, "gpu_ms": 9.0},
            {"region": "wo", "schedule": "fused:1:impl=sm90", "mode": "python", "host_us": 150.0, "gpu_ms": 9.0}]
    meta = {"device": "NVIDIA H200", "commit": "abc", "date": "2026-12-01", "torch": "2.11", "triton": "3.6",
            "not_replayed": ["matmul_rs fused:1: the call launches a Triton kernel"]}
    md = bench_host.markdown(rows, meta, SimpleNamespace(world=2, batch=4, seq=2048, rounds=3, calls=10, shared=True))
    assert "| wo | `fused:1:impl=sm90` | 60.0 | 150.0 | - | - |" in md
    assert "shared-device mode" in md and "--shared" in md
    assert "- matmul_rs fused:1: the call launches a Triton kernel" in md
