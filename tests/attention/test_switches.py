"""The attention transports' environment switches (attention/switches.py): the ring's K/V on
NCCL unless asked for the copy engine, Ulysses's all-to-alls on the copy engine unless asked for
NCCL, and an unknown value logged and read as nccl."""

from __future__ import annotations

import logging

import pytest

from torch_commopt.attention import ce_a2a, ce_ring


@pytest.mark.parametrize("module,default,other", [(ce_ring, "nccl", "ce"), (ce_a2a, "ce", "nccl")])
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
