"""The native host replay (kernels/gpu/host_replay.py, native/replay.c) on the CPU: the schedules'
real host code under fake_cuda, the replay's driver calls and GEMMs through native_fakes.  A
replayed call must queue exactly what the Python host code queues for the same tensors, and its
products must be the same; a call that does other device work is never replayed."""

from __future__ import annotations

import ctypes
import logging
import shutil

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda
from native_fakes import entry_points, forget_kinds, named

from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import driver, host_replay
from torch_commopt.kernels.matmul.gpu import ag_matmul as agm
from torch_commopt.kernels.matmul.gpu import matmul_reduce as mr
from torch_commopt.kernels.matmul.product import Product

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the native replay")
CALLS = 10  # per buffer half: a first call, two recordings, then two replays


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No kind known, the library's entry points set by the test, no cuBLAS handle needed."""
    forget_kinds(monkeypatch, tmp_path)


def _ag(sched: str, shape: tuple, gather_dim: int, n_weights: int, keep: bool = False):
    k = shape[-1]
    ws = [torch.randn(12 + 4 * i, k, dtype=torch.bfloat16).t() for i in range(n_weights)]  # (N, K) params, viewed
    return lambda a: agm.ag_matmul_gpu(a, ws, [None] * n_weights, gather_dim, "fake", Schedule.parse(sched), keep), ws


def _rs(sched: str, op: str = "sum"):
    w = torch.randn(16, 8, dtype=torch.bfloat16).t()
    return lambda a: [mr.matmul_rs_gpu(Product(a, w), a.dim() - 2, op, "fake", Schedule.parse(sched))], w


def _run(call, inputs: list, replay: bool, monkeypatch, runtimes=None) -> tuple[list, list, list]:
    """(queue, outputs, native GEMMs) of rank 0's calls on `inputs`, on `runtimes` from their
    first call on (the same streams, events and buffers: the same queue for the same tensors)."""
    runtimes = runtimes or fake_runtimes(2)
    for rt in runtimes:
        rt.epoch = 0
    queue, gemms, outs = [], [], []
    with faked_cuda(runtimes, queue) as active:
        monkeypatch.setenv(env.HOST_REPLAY, "1" if replay else "0")
        active(0)
        _copying(driver._lib())
        points, keep = entry_points(driver._lib(), gemms)
        host_replay.load(points)
        for a in inputs:
            outs.append(call(a))  # kept: every output at an address of its own
    del keep
    return named(queue, outs), outs, gemms


def _copying(fake: dict) -> None:
    """The fake driver's copies performed as well as recorded (at once: a pulled partial then holds
    what the peer's buffer holds, the same in every run)."""
    copy, copy2d = fake["cuMemcpyDtoDAsync"], fake["cuMemcpy2DAsync"]

    def memcpy(dst, src, n, stream):
        ctypes.memmove(dst, src, n)
        return copy(dst, src, n, stream)

    def memcpy2d(desc, stream):
        d = desc._obj
        for row in range(d.Height):
            ctypes.memmove(d.dstDevice + row * d.dstPitch, d.srcDevice + row * d.srcPitch, d.WidthInBytes)
        return copy2d(desc, stream)
    fake["cuMemcpyDtoDAsync"], fake["cuMemcpy2DAsync"] = memcpy, memcpy2d


def _ar(sched: str):
    w = torch.randn(16, 8, dtype=torch.bfloat16).t()
    return lambda a: [mr.matmul_ar_gpu(Product(a, w), "sum", "fake", Schedule.parse(sched))], w


CASES = [  # (label, call maker, input shape)
    ("ag ce_push:1 rows", lambda: _ag("ce_push:1", (8, 16), 0, 3)[0], (8, 16)),
    ("ag ce_push:2:par=1 blocks", lambda: _ag("ce_push:2:par=1", (2, 8, 16), 1, 2)[0], (2, 8, 16)),
    ("ag ce_push:2 blocks, the gathered input kept", lambda: _ag("ce_push:2", (2, 8, 16), 1, 1, True)[0], (2, 8, 16)),
    ("rs ce_pull:2 rows", lambda: _rs("ce_pull:2")[0], (16, 8)),
    ("rs direct:1 blocks", lambda: _rs("direct:1")[0], (2, 8, 8)),
    ("rs ce_push:1 rows (own GEMM, then the partial added)", lambda: _rs("ce_push:1")[0], (16, 8)),
    ("rs ce_push:2 blocks", lambda: _rs("ce_push:2")[0], (2, 8, 8)),
    ("ar ce_push:1 rows", lambda: _ar("ce_push:1")[0], (16, 8)),
    ("ar ce_pull:2 rows", lambda: _ar("ce_pull:2")[0], (16, 8)),
]


@pytest.mark.parametrize("shape, gather_dim", [((8, 16), 0), ((2, 8, 16), 1)])
def test_the_own_rows_copied_early_give_the_same_gathered_input_and_products(fresh, monkeypatch, shape, gather_dim):
    """env.gather_own_early moves the own rows' copy to the local stream under the own GEMM: the
    outputs (the products and the kept gathered input, this rank's rows in it) are the same."""
    torch.manual_seed(0)
    call = _ag("ce_push:2", shape, gather_dim, 1, True)[0]
    inputs = [torch.randn(*shape, dtype=torch.bfloat16) for _ in range(3)]
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(env.GATHER_OWN_EARLY, switch)
        queue, outs[switch], _ = _run(call, inputs, False, monkeypatch)
        assert any(entry[-1][0] == "copy" for entry in queue), queue  # the gathered copies ran
    for off, on, a in zip(outs["0"], outs["1"], inputs, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(off, on, strict=True))
        own = on[-1].narrow(gather_dim, 0, a.shape[gather_dim])  # rank 0's rows come first in the gathered input
        assert torch.equal(own, a)


# env.tokens_on_side: the tokens' batch on the side stream; env.gather_own_early: the own rows'
# gathered copy on the local stream -- recorded and replayed there too
@pytest.mark.parametrize("switch", [None, env.TOKENS_ON_SIDE, env.GATHER_OWN_EARLY])
@pytest.mark.parametrize("label,make,shape", CASES, ids=[c[0] for c in CASES])
def test_a_replayed_call_queues_and_computes_what_the_python_host_code_does(fresh, monkeypatch, label, make, shape,
                                                                          switch):
    if switch:
        monkeypatch.setenv(switch, "1")
    torch.manual_seed(0)
    call = make()
    inputs = [torch.randn(*shape, dtype=torch.bfloat16) for _ in range(CALLS)]  # fresh addresses every call
    runtimes = fake_runtimes(2)
    want_queue, want_outs, none = _run(call, inputs, False, monkeypatch, runtimes)
    got_queue, got_outs, gemms = _run(call, inputs, True, monkeypatch, runtimes)
    assert not none and gemms, "the replay ran its GEMMs natively (and the Python path none)"
    replayed = [k for k, v in host_replay._kinds.items() if isinstance(v, host_replay.Trace)]
    assert len(replayed) == 2, "one trace per buffer half"
    assert got_queue == want_queue
    for got, want in zip(got_outs, want_outs):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_call_with_other_device_work_runs_its_python_host_code_every_time(fresh, monkeypatch, caplog):
    """An average reduce-scatter (ce_push:1 at two ranks) scales its sum with an elementwise mul_
    after the add: not a replayable call; it is said once per kind and every call still computes
    right."""
    call, w = _rs("ce_push:1", "avg")
    inputs = [torch.randn(16, 8, dtype=torch.bfloat16) for _ in range(CALLS)]
    runtimes = fake_runtimes(2)
    with caplog.at_level(logging.INFO, logger=host_replay.log.name):
        queue, outs, gemms = _run(call, inputs, True, monkeypatch, runtimes)
    assert not gemms
    assert set(host_replay._kinds.values()) == {"the call runs aten.mul_.Tensor besides its GEMMs"}
    assert host_replay.refusals() == ["matmul_rs ce_push:1: the call runs aten.mul_.Tensor besides its GEMMs"]
    assert sum("not a replay" in r.getMessage() for r in caplog.records) == 2  # once per half
    _, want_outs, _ = _run(call, inputs, False, monkeypatch, runtimes)
    for got, want in zip(outs, want_outs):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def test_a_new_layout_is_a_new_kind(fresh, monkeypatch):
    call, _ = _ag("ce_push:1", (8, 16), 0, 1)
    inputs = [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(CALLS)]
    inputs += [torch.randn(16, 16, dtype=torch.bfloat16)[::2] for _ in range(2)]  # strided rows: other kinds
    _run(call, inputs, True, monkeypatch)
    kinds = host_replay._kinds
    assert sum(isinstance(v, host_replay.Trace) for v in kinds.values()) == 2
    assert sum(v is host_replay._SEEN for v in kinds.values()) == 2  # one call of each half so far
    assert len(kinds) == 4


def test_addresses_are_relocated_into_the_calls_tensors_or_kept_absolute():
    a, b = torch.zeros(4, 4), torch.zeros(8)
    extents = [host_replay._extent(a), None, host_replay._extent(b)]
    assert host_replay._where(a.data_ptr() + 20, extents) == (1, 20)
    assert host_replay._where(b.data_ptr(), extents) == (3, 0)
    assert host_replay._where(1 << 44, extents) == (0, 1 << 44)
    view = a.view(-1)[4:]
    assert host_replay._where(view.data_ptr(), [host_replay._extent(a), host_replay._extent(view)]) is None


def test_gemm_parameters_follow_cublas_column_major_convention():
    """out = A @ B with out row-major: cuBLAS computes out^T = B^T A^T (m = N, n = M); a weight
    viewed as an (N, K) parameter's transpose is read transposed with leading dim K."""
    a, w = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(3, 7, dtype=torch.bfloat16).t()
    out = torch.empty(5, 3, dtype=torch.bfloat16)
    step = host_replay._gemm(torch.ops.aten.mm.out, (a, w), {"out": out}, 9)
    assert step[:8] == ("gemm", 9, torch.bfloat16, 1, 0, 3, 5, 7)
    assert step[9] == 7 and step[12] == 7 and step[15] == 3 and step[17:] == (0, 1.0, 0.0)
    spaced = torch.randn(10, 14, dtype=torch.bfloat16)[::2, ::2]  # no unit stride: ATen would copy it
    assert isinstance(host_replay._gemm(torch.ops.aten.mm.out, (spaced, w), {"out": out}, 9), str)


def test_a_recording_that_fails_costs_its_kind_the_replay_not_the_call(fresh, monkeypatch, caplog):
    def broken(ops, tensors):
        raise ValueError("injected")
    monkeypatch.setattr(host_replay, "_relocate", broken)
    call, _ = _ag("ce_push:1", (8, 16), 0, 1)
    inputs = [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(CALLS)]
    runtimes = fake_runtimes(2)
    with caplog.at_level(logging.INFO, logger=host_replay.log.name):
        _, outs, gemms = _run(call, inputs, True, monkeypatch, runtimes)
    _, want, _ = _run(call, inputs, False, monkeypatch, runtimes)
    assert not gemms and set(host_replay._kinds.values()) == {"its recording failed: ValueError: injected"}
    for got, w in zip(outs, want):
        torch.testing.assert_close(got[0], w[0], rtol=0, atol=0)


def test_past_the_kinds_cap_new_kinds_are_not_recorded(fresh, monkeypatch, caplog):
    monkeypatch.setattr(host_replay, "MAX_KINDS", 1)
    call, _ = _ag("ce_push:1", (8, 16), 0, 1)
    with caplog.at_level(logging.WARNING, logger=host_replay.log.name):
        _, _, gemms = _run(call, [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(CALLS)], True, monkeypatch)
    # the first buffer half's kind is known and replays; the other half's is never recorded
    assert gemms and [type(v) for v in host_replay._kinds.values()] == [host_replay.Trace]
    assert sum("kinds of eager calls recorded" in r.getMessage() for r in caplog.records) == 1


def test_tied_weights_are_not_replayed_and_views_at_moving_offsets_are(fresh, monkeypatch):
    """A pointer inside two of the call's tensors (the same weight twice) cannot be relocated: that
    kind keeps its Python host code.  Inputs that are views into larger tensors, at another offset
    every call, relocate by their own data pointers: replayed, same queue, same bits."""
    k = 16
    w = torch.randn(12, k, dtype=torch.bfloat16).t()
    tied = lambda a: agm.ag_matmul_gpu(a, [w, w], [None, None], 0, "fake", Schedule.parse("ce_push:1"), False)  # noqa: E731
    inputs = [torch.randn(8, k, dtype=torch.bfloat16) for _ in range(CALLS)]
    _, _, gemms = _run(tied, inputs, True, monkeypatch)
    assert not gemms and set(host_replay._kinds.values()) == {"an address inside two of the call's tensors"}

    host_replay._kinds.clear()
    call, _ = _ag("ce_push:1", (8, k), 0, 2)
    big = torch.randn(CALLS * 8 + 5, k, dtype=torch.bfloat16)
    views = [big[i * 8 + (i % 3): i * 8 + (i % 3) + 8] for i in range(CALLS)]  # contiguous, offsets vary
    runtimes = fake_runtimes(2)
    want_queue, want_outs, _ = _run(call, views, False, monkeypatch, runtimes)
    got_queue, got_outs, gemms = _run(call, views, True, monkeypatch, runtimes)
    assert gemms and got_queue == want_queue
    for got, want in zip(got_outs, want_outs):
        for g, w2 in zip(got, want):
            torch.testing.assert_close(g, w2, rtol=0, atol=0)


def test_a_strided_input_copied_by_the_call_is_not_replayed(fresh, monkeypatch):
    call, _ = _ag("ce_push:1", (8, 16), 0, 1)
    inputs = [torch.randn(16, 16, dtype=torch.bfloat16)[::2] for _ in range(CALLS)]  # a.contiguous() copies
    _, _, gemms = _run(call, inputs, True, monkeypatch)
    assert not gemms and set(host_replay._kinds.values()) == {"the call runs aten.clone.default besides its GEMMs"}


def test_under_a_dispatch_mode_of_the_callers_calls_run_their_python_host_code(fresh, monkeypatch):
    """A FLOP counter (or any dispatch mode) around the step sees every GEMM: nothing is recorded
    or replayed under it."""
    from torch.utils.flop_counter import FlopCounterMode

    call, _ = _ag("ce_push:1", (8, 16), 0, 1)
    with FlopCounterMode(display=False) as flops:
        _, _, gemms = _run(call, [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(CALLS)], True, monkeypatch)
    assert not gemms and not host_replay._kinds
    assert flops.get_total_flops() == CALLS * 2 * (2 * 8) * 16 * 12  # every call's two GEMMs counted


def test_with_atens_gemms_on_another_blas_library_nothing_is_replayed(fresh, monkeypatch):
    lt = type(torch.backends.cuda.preferred_blas_library()).Cublaslt
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda: lt)
    call, _ = _ag("ce_push:1", (8, 16), 0, 1)
    _, _, gemms = _run(call, [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(CALLS)], True, monkeypatch)
    assert not gemms
    assert set(host_replay._kinds.values()) == {
        "ATen's GEMMs run through Cublaslt (torch.backends.cuda.preferred_blas_library)"}
