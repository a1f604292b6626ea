"""kernels/gpu/launch.py's keys, on the CPU: two calls share a kept binary only when the JIT would
have compiled them alike (tests/gpu/test_launch_gpu.py launches them on a GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from torch_commopt.kernels.gpu import launch


def _launcher(monkeypatch, do_not_specialize=()):
    fn = types.SimpleNamespace(arg_names=["ptr", "n", "start", "BLOCK"], do_not_specialize=list(do_not_specialize))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return launch.Launcher(fn)


def test_ints_share_a_binary_only_where_the_jit_specializes_alike(monkeypatch):
    lau = _launcher(monkeypatch)
    x = torch.zeros(4)

    def key(n, start):
        return lau._key((x, n, start), {"BLOCK": 64, "num_warps": 4})  # noqa: SLF001

    assert key(2, 3) == key(5, 7)  # neither 1 nor a multiple of 16
    assert key(1, 3) != key(2, 3)  # 1 is a constant to the JIT
    assert key(32, 3) != key(2, 3)  # a multiple of 16 is known divisible
    assert key(2, 3) != key(2 ** 31 + 2, 3)  # a 64-bit int is another type


def test_do_not_specialize_ints_keep_only_their_type(monkeypatch):
    lau = _launcher(monkeypatch, do_not_specialize=["start"])
    x = torch.zeros(4)
    keys = {lau._key((x, 2, s), {"BLOCK": 64}) for s in (0, 1, 16, 17)}  # noqa: SLF001
    assert len(keys) == 1
    assert lau._key((x, 2, 2 ** 40), {"BLOCK": 64}) not in keys  # noqa: SLF001


def test_tensor_alignment_dtype_and_constexprs_are_in_the_key(monkeypatch):
    lau = _launcher(monkeypatch)
    base = torch.zeros(64)
    aligned, unaligned = base[4:], base[1:]  # 16 and 4 bytes past an aligned start
    assert base.data_ptr() % 16 == 0
    k = lau._key((aligned, 2, 3), {"BLOCK": 64})  # noqa: SLF001
    assert k == lau._key((base, 2, 3), {"BLOCK": 64})  # noqa: SLF001
    assert k != lau._key((unaligned, 2, 3), {"BLOCK": 64})  # noqa: SLF001
    assert k != lau._key((aligned.to(torch.float64), 2, 3), {"BLOCK": 64})  # noqa: SLF001
    assert k != lau._key((aligned, 2, 3), {"BLOCK": 128})  # noqa: SLF001
    assert k != lau._key((aligned, 2, 3), {"BLOCK": 64, "num_warps": 8})  # noqa: SLF001


@pytest.mark.parametrize("args, kw", [((None, 2, 3), {"BLOCK": 64}),  # None: the JIT's own business
                                      ((torch.zeros(2), (1, 2), 3), {"BLOCK": 64}),  # a tuple
                                      ((torch.zeros(2), 2, 3), {})])  # a constexpr left to its default
def test_what_the_key_cannot_describe_goes_through_the_jit(monkeypatch, args, kw):
    assert _launcher(monkeypatch)._key(args, kw) is None  # noqa: SLF001


def test_the_interpreter_and_launch_hooks_take_the_jit(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch._fast_allowed()  # noqa: SLF001
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if launch._knobs is None:  # noqa: SLF001
        pytest.skip("this Triton keeps its launch hooks on CompiledKernel")
    assert launch._fast_allowed()  # noqa: SLF001
    monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", lambda *a: None)  # noqa: SLF001
    assert not launch._fast_allowed()  # noqa: SLF001
    chain = types.SimpleNamespace(calls=[])  # Triton 3.9's HookChain, empty: nothing to call
    monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", chain)  # noqa: SLF001
    assert launch._fast_allowed()  # noqa: SLF001
    chain.calls.append(print)
    assert not launch._fast_allowed()  # noqa: SLF001
