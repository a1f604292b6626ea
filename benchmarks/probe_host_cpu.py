"""Host (Python) cost of one GPU-schedule call, measured on the CPU with CUDA faked out.

The eager training step loses to its host: each commopt region call spends hundreds of
microseconds of Python before the GPU sees its work (bench_e2e --host-profile).  This probe
runs the real host code of the GPU schedules (`ag_matmul_gpu`, `matmul_rs_gpu`,
`matmul_ar_gpu`) on tiny CPU tensors, with the CUDA pieces replaced by stand-ins: streams,
events and stream contexts are no-ops, the driver's stream memory operations and copies are
no-op functions, and the symmetric buffers are CPU tensors (a peer's buffer is a second
one).  What it times is therefore the Python and dispatcher work per call, without the
CUDA launch latencies (a few us per kernel, the same for every variant), so it ranks
host-path changes on any machine; the device figure is profile_host.py / bench_e2e.

    python benchmarks/probe_host_cpu.py [--calls 2000] [--profile CASE]

Prints one JSON line per case: {"case", "us_per_call"}.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pathlib
import pstats
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torch_commopt.kernels.gpu import ag_matmul as agm  # noqa: E402
from torch_commopt.kernels.gpu import driver, symm  # noqa: E402
from torch_commopt.kernels.gpu import matmul_reduce as mr  # noqa: E402
from torch_commopt.schedule import Schedule  # noqa: E402

M, K, N = 16, 16, 16  # global rows, contracted dim, output columns (tiny fp32: the host cost only)


class _Stream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass


class _Handle:
    def __init__(self, peer: torch.Tensor, world: int):
        self.peer = peer
        self.buffer_ptrs = [0] * world

    def get_buffer(self, rank, shape, dtype, offset):
        numel = 1
        for s in shape:
            numel *= s
        return self.peer.view(dtype)[offset: offset + numel].view(shape)


def fake_runtime(world: int = 2, rank: int = 0) -> symm.GroupRuntime:
    rt = symm.GroupRuntime.__new__(symm.GroupRuntime)
    rt.group_name, rt.device = "fake", torch.device("cpu")
    rt.rank, rt.world = rank, world
    rt.peers = [(rank + s) % world for s in range(1, world)]
    rt.sources = [(rank - s) % world for s in range(1, world)]
    rt.epoch = 0
    rt.side, rt.local, rt.compute2 = _Stream(), _Stream(), _Stream()
    rt.flags = torch.zeros(symm.FLAG_SLOTS, dtype=torch.int32)
    rt.flag_bases = [1 << 40 + i for i in range(world)]
    rt.flag_bases_dev = None
    rt.status = rt.flags[symm.STATUS: symm.STATUS + 8]
    size = 1 << 20
    rt.buffers = [symm.SymmBuffer(torch.zeros(size, dtype=torch.uint8), _Handle(torch.zeros(size, dtype=torch.uint8), world),
                                  rank, None)]
    rt.owned = {}
    rt._debug_kernel_loaded = False
    rt._warned_capture_debug = False
    rt._order_event, rt._events = 1, []
    rt._new_event = lambda: 1
    return rt


@contextlib.contextmanager
def faked_cuda(rt):
    noop = lambda *a, **k: 0  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(symm, "runtime", lambda *a, **k: rt))
        names = ("cuStreamWaitValue32", "cuStreamWriteValue32", "cuMemcpy2DAsync", "cuMemcpyDtoDAsync", "cuEventCreate",
                 "cuEventRecord", "cuStreamWaitEvent")
        stack.enter_context(mock.patch.object(driver, "_lib", lambda: dict.fromkeys(names, noop)))
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _Stream()))
        stack.enter_context(mock.patch.object(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()))
        stack.enter_context(mock.patch.object(torch.cuda, "Event", _Event))
        stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False))
        stack.enter_context(mock.patch.object(torch.Tensor, "data_ptr", lambda self: 0))
        yield


def cases(world: int):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    a_ag = rnd(1, M // world, K)
    qkv = [rnd(K, N // world) for _ in range(3)]
    a_rs = rnd(1, M, K // world)
    w_rs = rnd(K // world, N)
    s1, s2 = Schedule.parse("ce_push:1"), Schedule.parse("ce_push:2")
    return {
        "ag ce_push:1 3 weights +gathered": lambda: agm.ag_matmul_gpu(a_ag, qkv, [None] * 3, 1, "fake", s1, True),
        "ag ce_push:1 1 weight": lambda: agm.ag_matmul_gpu(a_ag, qkv[:1], [None], 1, "fake", s1, False),
        "ag ce_push:2 1 weight": lambda: agm.ag_matmul_gpu(a_ag, qkv[:1], [None], 1, "fake", s2, False),
        "ag ce_push:1:par=1 1 weight": lambda: agm.ag_matmul_gpu(a_ag, qkv[:1], [None], 1, "fake",
                                                                  Schedule.parse("ce_push:1:par=1"), False),
        "rs ce_push:1": lambda: mr.matmul_rs_gpu(a_rs, w_rs, None, 1, "sum", "fake", s1),
        "rs ce_push:2": lambda: mr.matmul_rs_gpu(a_rs, w_rs, None, 1, "sum", "fake", s2),
        "ar ce_push:1": lambda: mr.matmul_ar_gpu(a_rs, w_rs, None, "sum", "fake", s1),
    }


def time_case(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--profile", default="", help="a case name: print its cProfile (own time)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rt = fake_runtime(args.world)
    with faked_cuda(rt):
        table = cases(args.world)
        for name, fn in table.items():
            print(json.dumps({"case": name, "world": args.world, "us_per_call": round(time_case(fn, args.calls), 1)}))
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                table[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
