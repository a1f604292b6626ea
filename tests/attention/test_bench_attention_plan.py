"""bench_attention's choice of what to run: the pick always among the timed schedules."""

from __future__ import annotations

import torch

from benchmarks.bench_attention import Case, _commopt_plan
from torch_commopt.tuner.attention.cost import machine_from_calibration
from torch_commopt.tuner.calibration import prior


def test_the_pick_runs_even_when_it_is_a_head_group_depth(monkeypatch):
    """2x H200: without --schedules the pick `ulysses:g=1` was not among the
    accepted names (which say `ulysses`), and the record's lookup of its time failed.  (With
    the head groups on one stream the model picks `ulysses:g=1` at 16K.)"""
    from torch_commopt.kernels.attention import ce_a2a
    from torch_commopt.tuner.attention import cost

    monkeypatch.delenv(ce_a2a.ENV, raising=False)
    monkeypatch.setenv(ce_a2a.GROUP_STREAMS_ENV, "0")
    monkeypatch.setattr(cost, "DEPTH_MARGIN", 0.0)  # a depth predicted ahead by less than the margin is picked too
    machine = machine_from_calibration(prior("NVIDIA H200", 2), "bfloat16")
    seen_depth = False
    for seq in (8192, 16384, 32768, 131072):
        for kv in (32, 8):
            case = Case(1, 32, kv, 128, seq, True, "fwd+bwd")
            scheds, pick, ranked = _commopt_plan(case, 2, torch.bfloat16, machine, None)
            assert pick == ranked[0][0] and pick in scheds and len(scheds) == len(set(scheds))
            seen_depth |= ":g=" in pick
            only, pick2, _ = _commopt_plan(case, 2, torch.bfloat16, machine, ["allgather"])
            assert pick2 == pick and only[0] == "allgather" and pick in only
    assert seen_depth  # the case the fix is for occurred at least once
