"""bench_decode on CPU/gloo (2 ranks, a tiny projection): every variant runs and agrees with NCCL's
stand-in, the rank-order sums give every rank the same bits, and the report derives its figures
from the raw times."""

import pytest

from benchmarks import bench_decode
from torch_commopt.testing.launch import run_distributed


def test_the_cpu_smoke_run_measures_every_variant_and_they_agree():
    per_rank = run_distributed(bench_decode._rank, 2, bench_decode.CPU_PROJECTIONS, (1, 3), 1, False, backend="gloo",
                               timeout_s=300)
    cases, device = per_rank[0]
    assert device == "cpu (gloo)" and [c["rows"] for c in cases] == [1, 3]
    for c in bench_decode.records(cases):
        assert set(c["ms"]) == {"gemm", "nccl", "gather_sum", "scatter_gather"} and all(v > 0 for v in c["ms"].values())
        assert c["agree"] and c["same_on_every_rank"] == {"gather_sum": True, "scatter_gather": True}
    meta = {"device": device, "world": 2, "commit": "c", "date": "d", "torch": "t", "rounds": 1}
    text = bench_decode.report(cases, meta)
    assert "| tiny | o_proj | 32x48 | 1 |" in text and "gather_sum × NCCL" in text


def test_speedups_and_the_ceiling_come_from_the_times():
    case = {"ms": {"gemm": 0.01, "nccl": 0.04, "oneshot": 0.02, "twoshot": 0.025, "symm_mem": 0.03},
            "max_rel_error_vs_nccl": {"oneshot": 0.0, "twoshot": 0.0, "symm_mem": 0.0}, "same_on_every_rank": {"oneshot": True}}
    (c,) = bench_decode.records([case])
    assert c["speedup_vs_nccl"]["oneshot"] == pytest.approx(2.0)
    assert c["speedup_vs_best_baseline"]["oneshot"] == pytest.approx(1.5)  # symm_mem is the best baseline here
    assert c["ceiling_vs_nccl"] == pytest.approx(4.0) and c["agree"]
    (c,) = bench_decode.records([dict(case, same_on_every_rank={"oneshot": False})])
    assert not c["agree"]
