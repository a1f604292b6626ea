"""The attention transports' environment switches (kernels/attention/switches.py): "auto" by
default for the ring's K/V (NCCL for the rings, the copy engine for the flex all-gather's moves),
Ulysses's all-to-alls on the copy engine unless asked for NCCL, and an unknown value logged and
read as nccl."""

from __future__ import annotations

import logging

import pytest

from torch_commopt.kernels.attention import ce_a2a, ce_ring


@pytest.mark.parametrize("module,default,other", [(ce_ring, "auto", "ce"), (ce_ring, "auto", "nccl"),
                                                  (ce_a2a, "ce", "nccl")])
def test_transport_default_and_the_other_value(monkeypatch, module, default, other):
    monkeypatch.delenv(module.ENV, raising=False)
    assert module.transport() == default
    monkeypatch.setenv(module.ENV, "")
    assert module.transport() == default
    monkeypatch.setenv(module.ENV, f" {other.upper()} ")
    assert module.transport() == other


@pytest.mark.parametrize("module", [ce_ring, ce_a2a])
def test_an_unknown_transport_is_logged_and_read_as_nccl(monkeypatch, caplog, module):
    monkeypatch.setenv(module.ENV, "nvshmem")
    with caplog.at_level(logging.WARNING, logger=module.log.name):
        assert module.transport() == "nccl"
    assert any("nvshmem" in r.getMessage() and module.ENV in r.getMessage() for r in caplog.records)


def test_concurrent_head_groups_are_both_passes_unless_asked_otherwise(monkeypatch, caplog):
    """(forward, backward) per value: both by default and with "1", the forward's with "fwd",
    neither with "0"; a typo is logged and read as the default."""
    def asked():
        return ce_a2a.group_streams_asked(False), ce_a2a.group_streams_asked(True)
    monkeypatch.delenv(ce_a2a.GROUP_STREAMS_ENV, raising=False)
    assert asked() == (True, True)
    for value, want in ((" 0 ", (False, False)), ("1", (True, True)), ("FWD", (True, False)), ("", (True, True))):
        monkeypatch.setenv(ce_a2a.GROUP_STREAMS_ENV, value)
        assert asked() == want, value
    monkeypatch.setenv(ce_a2a.GROUP_STREAMS_ENV, "bwd-only")
    with caplog.at_level(logging.WARNING, logger=ce_a2a.log.name):
        assert asked() == (True, True)
    assert any("bwd-only" in r.getMessage() for r in caplog.records)


def test_only_a_ring_of_one_runs_its_head_groups_concurrently(monkeypatch):
    """schedules._moved tells the all-to-all pipeline whether the attention it runs per group
    makes collective calls of its own (a ring over more than one rank): only pure Ulysses's
    groups may run on two streams."""
    from torch_commopt.core.attention_spec import CPSchedule
    from torch_commopt.kernels.attention import schedules

    seen = []
    monkeypatch.setattr(schedules, "_ulysses_pipelined", lambda *a, concurrent=False, **k: seen.append(concurrent))

    class Ring:
        def size(self):
            return 2
    monkeypatch.delenv(ce_a2a.GROUP_STREAMS_ENV, raising=False)
    def route(ring_group=None):
        return schedules._Route(CPSchedule.parse("ulysses"), True, None, None, ring_group, None)
    for ring_group in (None, Ring()):
        schedules._moved(route(ring_group), [], None, 2, [])
    # the backward's groups: two streams by default, one where only the forward's are asked for
    schedules._moved(route(), [], None, 2, [], backward=True)
    monkeypatch.setenv(ce_a2a.GROUP_STREAMS_ENV, "fwd")
    schedules._moved(route(), [], None, 2, [], backward=True)
    schedules._moved(route(), [], None, 2, [])
    assert seen == [True, False, True, False, True]


def test_the_attention_report_names_the_rings_transport_under_auto(monkeypatch):
    from benchmarks import bench_attention

    monkeypatch.delenv(ce_ring.ENV, raising=False)
    assert bench_attention._transport() == f"nccl ({ce_ring.ENV}=auto)"
    monkeypatch.setenv(ce_ring.ENV, "ce")
    assert bench_attention._transport() == f"ce ({ce_ring.ENV}=ce)"
