"""Host replay of the fused schedules with impl=sm90 on the CPU: their kernels are native launchers
(driver.native_call), so a recorded call holds every driver operation and every launch with its
argument words.  Stand-in launchers (CPU products over the words' addresses) show that a replayed
call launches what the Python host code launches -- the same words, each address relocated into
this call's tensors, the epoch words (the reduce-scatter's barrier and kernel argument) this
call's -- and queues the same driver operations; that a fallback to the Triton kernel is never
replayed; and that two recordings differing in more than the epoch refuse the kind."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda
from native_fakes import _matrix, entry_points, forget_kinds, named
from torch.utils._python_dispatch import _disable_current_modes

from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import driver, host_replay, symm
from torch_commopt.kernels.matmul.gpu import ag_matmul as agm
from torch_commopt.kernels.matmul.gpu import matmul_reduce as mr
from torch_commopt.kernels.matmul.gpu import sm90
from torch_commopt.kernels.matmul.product import Product

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the native replay")
CALLS = 10  # per buffer half: a first call, two recordings, then replays
LAUNCHER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int64))
BF16 = torch.bfloat16


def _ag_kernel(words) -> None:
    """Each output = the slots' rows (this rank's own shard in its slot) @ B_i: the kernel's product
    with the rows in slot order."""
    w = {name: words[i] for i, name in enumerate(sm90.AG_WORDS)}
    m_loc, k, world, rank = w["m_loc"], w["k"], w["world"], w["rank"]
    own = _matrix(w["a_own"], BF16, (m_loc, k), (w["a_pitch"], 1)).float()
    slots = _matrix(w["a_slots"], BF16, (world * m_loc, k), (w["s_pitch"], 1)).float().clone()
    slots[rank * m_loc:(rank + 1) * m_loc] = own
    for i in range(w["num_b"]):
        n = w[f"n{i}"]
        b = _matrix(w[f"b{i}"], BF16, (n, k), (w[f"b_pitch{i}"], 1)).float()
        _matrix(w[f"c{i}"], BF16, (world * m_loc, n), (n, 1)).copy_((slots @ b.t()).to(BF16))


def _rs_kernel(words) -> None:
    """out = alpha * this rank's rows of A @ B, plus the kernel's epoch (so a wrong one shows)."""
    w = {name: words[i] for i, name in enumerate(sm90.RS_WORDS)}
    m_seg, k, n, rank = w["m_seg"], w["k"], w["n"], w["rank"]
    a = _matrix(w["a"], BF16, (w["world"] * m_seg, k), (w["a_pitch"], 1)).float()[rank * m_seg:(rank + 1) * m_seg]
    b = _matrix(w["b"], BF16, (n, k), (w["b_pitch"], 1)).float()
    alpha = ctypes.c_float.from_buffer(ctypes.c_int32(w["alpha"])).value
    _matrix(w["out"], BF16, (m_seg, n), (n, 1)).copy_((alpha * (a @ b.t()) + w["epoch"]).to(BF16))


class _FakeLib:
    """sm90's library with CPU stand-ins for its launchers; each launch's words kept in `launches`."""

    def __init__(self, launches: list):
        def launcher(names, kernel):
            def run(ptr):
                words = [ptr[i] for i in range(len(names))]
                launches.append(tuple(words))
                with _disable_current_modes():  # a kernel's work: no recording's tap sees it
                    kernel(words)
                return 0
            return LAUNCHER(run)
        self.commopt_sm90_ag_gemm_words = launcher(sm90.AG_WORDS, _ag_kernel)
        self.commopt_sm90_rs_gemm_words = launcher(sm90.RS_WORDS, _rs_kernel)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    forget_kinds(monkeypatch, tmp_path)
    launches: list = []
    lib = _FakeLib(launches)
    monkeypatch.setattr(sm90, "_ready", lambda op, why: lib)
    monkeypatch.setattr(sm90, "_workspaces", {})
    return launches


def _runtimes():
    runtimes = fake_runtimes(2)
    for rt in runtimes:  # what the reduce-scatter kernel's words point at (device tensors on a GPU)
        rt.flag_bases_dev = torch.tensor(rt.flag_bases, dtype=torch.int64)
        buf = rt.buffers[0]
        buf.ptrs_dev = torch.tensor(buf.handle.buffer_ptrs, dtype=torch.int64)
    return runtimes


def _run(call, inputs: list, replay: bool, monkeypatch, runtimes, launches: list) -> tuple:
    """(queue, launches, outputs) of rank 0's calls on `inputs`, addresses in outputs named."""
    for rt in runtimes:
        rt.epoch = 0
    queue, outs, gemms = [], [], []
    launches.clear()
    with faked_cuda(runtimes, queue) as active:
        monkeypatch.setenv(env.HOST_REPLAY, "1" if replay else "0")
        active(0)
        points, keep = entry_points(driver._lib(), gemms)
        host_replay.load(points)
        for a in inputs:
            outs.append(call(a))
    del keep
    return named(queue, outs), named(list(launches), outs), outs


def _ag(sched: str, ns=(256, 128, 128)):
    ws = [torch.randn(n, 64, dtype=BF16).t() for n in ns]  # nn.Linear's (N, K) parameters, viewed
    return lambda a: agm.ag_matmul_gpu(a, ws, [None] * len(ws), 0, "fake", Schedule.parse(sched), False)


def _rs(sched: str, op: str = "sum"):
    w = torch.randn(128, 64, dtype=BF16).t()
    return lambda a: [mr.matmul_rs_gpu(Product(a, w), 0, op, "fake", Schedule.parse(sched))]


CASES = [("ag fused:1:impl=sm90, three weights", lambda: _ag("fused:1:impl=sm90,sms=8"), (128, 64)),
         ("ag fused:2:impl=sm90, four weights: two launches", lambda: _ag("fused:2:impl=sm90,sms=8", (256,) * 4),
          (128, 64)),
         ("rs fused:1:impl=sm90 (barrier and kernel epochs)", lambda: _rs("fused:1:impl=sm90,sms=8"), (512, 64)),
         ("rs fused:2:impl=sm90, average", lambda: _rs("fused:2:impl=sm90,sms=8", "avg"), (512, 64))]


@pytest.mark.parametrize("label,make,shape", CASES, ids=[c[0] for c in CASES])
def test_a_replayed_fused_call_launches_and_queues_what_the_python_host_code_does(fresh, monkeypatch, label, make,
                                                                                 shape):
    torch.manual_seed(0)
    call = make()
    inputs = [torch.randn(*shape, dtype=BF16) for _ in range(CALLS)]  # fresh addresses every call
    runtimes = _runtimes()
    want_queue, want_launches, want_outs = _run(call, inputs, False, monkeypatch, runtimes, fresh)
    assert not host_replay._kinds
    got_queue, got_launches, got_outs = _run(call, inputs, True, monkeypatch, runtimes, fresh)
    traces = [v for v in host_replay._kinds.values() if isinstance(v, host_replay.Trace)]
    assert len(traces) == 2, host_replay._kinds  # one per buffer half
    assert host_replay.STATS["replayed"] > 0
    assert got_launches == want_launches and len(want_launches) >= CALLS
    assert got_queue == want_queue
    for got, want in zip(got_outs, want_outs, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    if label.startswith("rs"):  # the barrier carries each call's epoch, in replayed calls too
        barrier = runtimes[0].flag_address(1, symm.BARRIER + 0)
        assert [op[2] for _, _, op in got_queue if op[:2] == ("write", barrier)] == list(range(1, CALLS + 1))


def test_a_fallback_to_the_triton_kernel_is_never_replayed(fresh, monkeypatch):
    """sm90 refuses the operands (here: its library says so): the Triton kernel runs, which no tap
    sees, so the kind stays on its Python host code."""
    launched = []
    monkeypatch.setattr(sm90, "_ready", lambda op, why: None)
    from torch_commopt.kernels.matmul.gpu import triton_kernels
    monkeypatch.setattr(triton_kernels, "ag_gemm_kernel", _Launchable(launched))
    monkeypatch.setattr(triton_kernels, "num_sms", lambda device: 8)
    call = _ag("fused:1:impl=sm90,sms=8")
    inputs = [torch.randn(128, 64, dtype=BF16) for _ in range(CALLS)]
    _run(call, inputs, True, monkeypatch, _runtimes(), fresh)
    assert len(launched) == CALLS
    assert set(host_replay._kinds.values()) == {"the call launches a Triton kernel"}


class _Launchable:
    """A Triton kernel's stand-in: kernel[grid](...) counts the launch."""

    def __init__(self, launched: list):
        self.launched = launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(grid)


def test_recordings_that_differ_in_more_than_the_epoch_refuse_the_kind():
    e = host_replay.EPOCH
    first = [("write32", 1, (0, 64), 7), ("call", 0, 99, (5, 7, 3), ((0, 1),))]
    second = [("write32", 1, (0, 64), 9), ("call", 0, 99, (5, 9, 3), ((0, 1),))]
    assert host_replay._marked(first, second, (7, 9)) == [("write32", 1, (0, 64), e), ("call", 0, 99, (5, e, 3), ((0, 1),))]
    with pytest.raises(host_replay._Differs):
        host_replay._marked(first, [("write32", 1, (0, 64), 10), second[1]], (7, 9))  # epoch + 1: not the epoch
    with pytest.raises(host_replay._Differs):
        host_replay._marked(first, second[:1], (7, 9))
    # a constant equal to the first epoch is kept, not marked
    assert host_replay._marked([("wait32", 1, (0, 8), 7)], [("wait32", 1, (0, 8), 7)], (7, 9)) == [
        ("wait32", 1, (0, 8), 7)]


def test_an_epoch_where_replay_takes_none_refuses_the_recording():
    with pytest.raises(ValueError, match="an epoch in a memcpy step"):
        host_replay.pack([("memcpy", 1, (0, 64), (0, 128), host_replay.EPOCH)], [], 0, torch.device("cpu"))


def test_a_batch_and_a_launch_take_the_calls_epoch(fresh):
    """replay.c writes the call's epoch where the trace marks it: a batch's operation, a launch's
    word; the launch's other words relocated (tensor 1) or kept."""
    seen = []
    launcher = LAUNCHER(lambda ptr: seen.append([ptr[i] for i in range(3)]) or 0)
    fn = ctypes.cast(launcher, ctypes.c_void_p).value
    e = host_replay.EPOCH
    steps = [("batch", 5, (("write", 64, e), ("wait", 72, 3)), False), ("call", 0, fn, (e, 11, 16), ((2, 1),))]
    t = torch.zeros(8)
    queue: list = []
    with faked_cuda(_runtimes(), queue):
        points, keep = entry_points(driver._lib(), [])
        host_replay.load(points)
        trace = host_replay.pack(steps, [], 0, torch.device("cpu"))
        for epoch in (42, 43):
            host_replay._replay(trace, (t,), None, epoch)
    del keep
    assert [op for _, _, op in queue] == [("write", 64, 42), ("wait", 72, 3), ("write", 64, 43), ("wait", 72, 3)]
    assert seen == [[42, 11, t.data_ptr() + 16], [43, 11, t.data_ptr() + 16]]
