"""The step profiler's idle-gap attribution (benchmarks/step_profile.py), on synthetic timelines."""

from benchmarks.step_profile import category, format_idle, gap_causes, idle_gaps, kernel_differences, split


def test_gaps_are_named_by_the_last_to_end_and_the_next_to_start():
    # a long GEMM overlaps a short copy that ends first: the gap after them follows the GEMM
    events = [("gemm_a", 0.0, 100.0), ("memcpy", 10.0, 40.0), ("gemm_b", 130.0, 200.0),
              ("add", 203.0, 210.0),  # 3 us: under the threshold
              ("gemm_a", 260.0, 300.0), ("gemm_b", 320.0, 330.0)]
    got = idle_gaps(events, min_us=5.0)
    assert got["gaps"] == 3
    assert got["idle_ms"] == round((30 + 50 + 20) / 1e3, 3)
    assert [g["us"] for g in got["largest"]] == [50.0, 30.0, 20.0]
    assert got["largest"][0] == {"at_ms": 0.21, "us": 50.0, "before": "add", "after": "gemm_a"}
    pairs = {(p["before"], p["after"]): (p["ms"], p["count"]) for p in got["by_pair"]}
    assert pairs == {("gemm_a", "gemm_b"): (0.05, 2), ("add", "gemm_a"): (0.05, 1)}


def test_no_events_and_no_gaps():
    assert idle_gaps([])["gaps"] == 0
    busy = idle_gaps([("k", 0.0, 10.0), ("k", 10.0, 20.0), ("c", 5.0, 25.0)])
    assert busy["gaps"] == 0 and busy["idle_ms"] == 0 and busy["largest"] == []


def test_long_names_are_cut_and_reports_split_out_the_gaps():
    name = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1"
    got = idle_gaps([(name, 0.0, 1.0), (name, 11.0, 12.0)])
    assert len(got["largest"][0]["before"]) == 48 and got["largest"][0]["before"].endswith("...")
    totals, idle = split({"gemm": 1.0, "idle_gaps": got, "window": (1.0, 2.0)})
    assert totals == {"gemm": 1.0} and idle is got  # the wall-clock window is not a category
    lines = format_idle("commopt", idle)
    assert lines[0].startswith("- commopt: idle 0.01 ms in 1 gaps") and "x1" in lines[0]
    assert split(None) == ({}, None) and format_idle("x", None) == []


def test_the_kernels_that_differ_most_from_the_other_side_are_named_with_both_figures():
    mine = {"silu_backward": [1.16, 4], "gemm": [30.0, 80], "t_copy": [0.21, 4]}
    bound = {"silu_backward": [0.54, 4], "gemm": [29.9, 72], "cat_split": [0.38, 8]}
    lines = kernel_differences("commopt", mine, "the bound", bound, top=3)
    assert lines[0] == "- commopt against the bound (ms per step, launches per step):"
    # largest first: a kernel running longer, one only this side runs, one only the other side runs
    assert lines[1] == "  - +0.620 ms: silu_backward (1.160 ms x4 against 0.540 ms x4)"
    assert lines[2].startswith("  - -0.380 ms: cat_split (0.000 ms x0 against 0.380 ms x8)")
    assert lines[3].startswith("  - +0.210 ms: t_copy") and len(lines) == 4
    assert kernel_differences("a", None, "b", bound) == [] and kernel_differences("a", mine, "b", {}) == []
    assert split({"gemm": 1.0, "kernels": mine}) == ({"gemm": 1.0}, None)  # kernels are not a category


def _trace(*ops):
    """A Chrome trace: each op (name, device start, device end, the queuing call's start and end or
    None) as a device event and its launch call, matched by correlation id."""
    events = []
    for i, (name, lo, hi, call) in enumerate(ops):
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": lo, "dur": hi - lo, "args": {"correlation": i}})
        if call is not None:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": call[0],
                           "dur": call[1] - call[0], "args": {"correlation": i}})
    return {"traceEvents": events}


def test_each_gap_is_the_late_host_s_or_a_dependency_s_from_the_queuing_calls():
    trace = _trace(("a", 100.0, 200.0, (0.0, 5.0)),
                   ("b", 230.0, 300.0, (10.0, 15.0)),   # queued long before the device went idle at 200
                   ("c", 350.0, 400.0, (320.0, 340.0)),  # its call returned at 340, after idle from 300
                   ("d", 402.0, 410.0, (20.0, 25.0)),   # 2 us: under the threshold
                   ("e", 460.0, 470.0, None))            # no queuing call in the trace
    got = gap_causes(trace, min_us=5.0)
    assert got == {"host_late": {"ms": 0.05, "count": 1}, "queued": {"ms": 0.03, "count": 1},
                   "unmatched": {"ms": 0.05, "count": 1}}
    idle = dict(idle_gaps([("a", 100.0, 200.0), ("b", 230.0, 300.0)]), causes=got)
    why = [line for line in format_idle("commopt", idle) if "why" in line]
    assert len(why) == 1 and "after the device went idle: 0.05 ms in 1" in why[0] and "waited on a dependency" in why[0]


def test_an_overlapping_operation_keeps_the_device_busy_for_the_causes_too():
    # a copy running beside a kernel: the gap starts when the later of the two ends
    trace = _trace(("gemm", 0.0, 100.0, (-50.0, -40.0)), ("copy", 20.0, 150.0, (-30.0, -20.0)),
                   ("next", 160.0, 170.0, (155.0, 158.0)))
    assert gap_causes(trace)["host_late"] == {"ms": 0.01, "count": 1}
    assert gap_causes(trace)["queued"]["count"] == 0


def test_kernels_fall_in_their_categories_and_cublas_s_axpy_is_no_gemm():
    assert category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert category("void axpy_kernel_val<__nv_bfloat16, float>(cublasAxpyParamsVal<...>)") == "add (axpy)"
    assert category("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert category("Memcpy PtoP (Device -> Device)") == "copy to peer"
    assert category("Memcpy DtoD (Device -> Device)") == "copy"
    assert category("triton_poi_fused_add_3") == "commopt/triton"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert category("void at::native::vectorized_elementwise_kernel") == "other"


def test_a_local_copy_counts_where_no_kernel_runs_beside_it():
    from benchmarks.step_profile import copies_alone

    events = [("gemm", 0.0, 10.0), ("Memcpy DtoD (Device -> Device)", 5.0, 20.0),  # 10 us alone (10..20)
              ("Memset (Device)", 25.0, 30.0),  # 5 us alone
              ("Memcpy PtoP (Device -> Device)", 30.0, 40.0),  # to a peer: not a local copy
              ("Memcpy DtoD (Device -> Device)", 40.0, 50.0), ("attn", 42.0, 44.0), ("attn", 46.0, 60.0)]  # 4 us
    assert copies_alone(events) == 10.0 + 5.0 + 4.0
    assert copies_alone([("gemm", 0.0, 5.0)]) == 0.0 and copies_alone([]) == 0.0
