"""What do ce_push:1's stream memory operations cost per call, replayed, on one GPU?

AG 512x8192x8192 at world 2 replayed from CUDA graphs (2x H200, results/
matmul_collectives_h200x2_2026-11-24_s13b): ce_push:1 0.082 ms a call where its two per-shard
GEMMs take 0.056 (probe_gemm_split) and torch's async-TP 0.079.  This probe queues, on one
GPU, exactly the operations a ce_push:1 call queues at world 2 (kernels/gpu/ag_matmul.py with
symm.GroupRuntime's acquire / signal / wait / done_reading), with the peer played by this GPU
itself: its flags are this GPU's flags and the push is a device-local copy.  So what it times
is the front end's cost of the fork/join events and the flag operations, without NVLink's
latency.  Variants (each 20 back-to-back calls captured in one CUDA graph, median of replays):

    gemms         the two 256-row GEMMs alone
    copy          + the copy of the shard on the side stream (fork / join by events)
    protocol      + the tokens and flags, as ce_push:1 queues them (every write fenced)
    flags_only    protocol without the GEMMs and the copy: the operations' own cost
    batched       protocol with each stream's writes in one cuStreamBatchMemOp (driver.batch):
                  the token is taken in the same node as the signal, after the copy, and
                  done_reading's two writes are one node (4 nodes a call instead of 6)
    batched_flags_only   the same without the GEMMs and the copy
    gemms_par     the two GEMMs on two streams (the peer's forked from the caller's): how much
                  of the serial GEMMs' time is quantization (a 256-row GEMM fills few SMs)
    batched_par   batched, with the peer's GEMM on a second compute stream that waits on the
                  data flag (ag ce_push:S:par=1)

Shapes (--shapes MxKxN of one rank's shard GEMM, default 256x8192x4096,1024x8192x4096,
2048x8192x14336): AG 512, 2048 (K = N = 8192) and 4096x8192x28672 at world 2, the three where
ce_push:1 replayed ran 0.957x / 0.988x / 0.995x torch's async-TP in s13b.

(Unfenced writes, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER, are not to be had: the _v2 entry
point refuses the flag with 1, invalid value, and the unversioned one fails with 801, not
supported, on the H100 of 2026-11-25.)

    python3 benchmarks/probe_protocol_cost.py OUTDIR [--shapes 256x8192x4096,...]
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

import torch
from replay_timing import replayed_ms_per_call  # benchmarks/, the script's own folder

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_commopt.kernels.gpu import driver  # noqa: E402

CALLS, REPLAYS = 20, 30
SHAPES = "256x8192x4096,1024x8192x4096,2048x8192x14336"
VARIANTS = ["gemms", "gemms_par", "copy", "protocol", "batched", "batched_par", "flags_only", "batched_flags_only"]
FREE, DATA = 0, 8  # int32 indices into the flag tensor, per buffer half


class Call:
    def __init__(self, variant: str, m: int, k: int, n: int):
        self.variant, self.m = variant, m
        dev = torch.device("cuda")
        self.a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        self.w = torch.randn(k, n, device=dev, dtype=torch.bfloat16) / k ** 0.5
        self.out = torch.empty(2 * m, n, device=dev, dtype=torch.bfloat16)
        self.slots = torch.empty(2, m, k, device=dev, dtype=torch.bfloat16)  # two buffer halves
        self.second = torch.cuda.Stream()  # par: the peer's GEMM
        self.fork2, self.join2 = driver.event_create(), driver.event_create()
        self.flags = torch.zeros(64, device=dev, dtype=torch.int32)
        self.flags[FREE:FREE + 2] = 1  # both halves' tokens at rest: free
        self.side = torch.cuda.Stream(priority=-1)
        self.fork, self.join = driver.event_create(), driver.event_create()
        self.epoch = 0

    def flag(self, index: int) -> int:
        return self.flags.data_ptr() + 4 * index

    def __call__(self) -> None:
        v, cur = self.variant, torch.cuda.current_stream()
        half = self.epoch % 2
        self.epoch += 1
        gemms = not v.endswith("flags_only")
        copy = v not in ("gemms", "gemms_par", "flags_only", "batched_flags_only")
        flags, batched = v not in ("gemms", "gemms_par", "copy"), v.startswith("batched")
        par = v.endswith("_par")
        peer = self.second if par else cur  # the stream of the peer shard's GEMM
        if par:
            driver.stream_after(self.second, self.fork2, cur)
        free, data = self.flag(FREE + half), self.flag(DATA + half)
        if copy or flags:
            driver.stream_after(self.side, self.fork, cur)
        if flags:  # acquire: wait for the peer's token of this half (and take it, unless batched below)
            driver.wait_value32(self.side, free, 1)
            if not batched:
                driver.write_value32(self.side, free, 0)
        if copy:
            nbytes = self.a.numel() * self.a.element_size()
            driver.memcpy_async(self.side, self.slots[half].data_ptr(), self.a.data_ptr(), nbytes)
        if flags:  # signal: the piece has landed (batched: the token is taken here, one node)
            if batched:
                driver.batch(self.side, [("write", free, 0), ("write", data, 1)])
            else:
                driver.write_value32(self.side, data, 1)
        if gemms:
            torch.mm(self.a, self.w, out=self.out[:self.m])
        if flags:
            driver.wait_value32(peer, data, 1)
        if gemms:
            with torch.cuda.stream(peer):
                torch.mm(self.slots[half], self.w, out=self.out[self.m:])
        if par:
            driver.stream_after(cur, self.join2, self.second)
        if copy or flags:
            driver.stream_after(cur, self.join, self.side)
        if flags:  # done_reading: lower the data flag, give the token back
            if batched:
                driver.batch(cur, [("write", data, 0), ("write", free, 1)])
            else:
                driver.write_value32(cur, data, 0)
                driver.write_value32(cur, free, 1)


def time_variant(variant: str, m: int, k: int, n: int) -> float:
    call = Call(variant, m, k, n)

    def check() -> None:
        if call.flags[FREE:FREE + 2].tolist() != [1, 1] or call.flags[DATA:DATA + 2].tolist() != [0, 0]:
            raise RuntimeError(f"{variant}: flags not at rest after a replay: {call.flags[:16].tolist()}")
    return replayed_ms_per_call(call, calls=CALLS, replays=REPLAYS, warmups=2, check=check)


def main() -> None:
    args = sys.argv[1:]
    shapes = SHAPES
    if "--shapes" in args:
        at = args.index("--shapes")
        shapes = args[at + 1]
        del args[at:at + 2]
    out = pathlib.Path(args[0] if args else ".")
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for shape in shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        results, errors = {}, {}
        for _ in range(3):  # rounds, variants interleaved: the median of the rounds' medians
            for v in VARIANTS:
                if v in errors:
                    continue
                try:
                    results.setdefault(v, []).append(time_variant(v, m, k, n))
                except RuntimeError as e:  # a driver refusing an operation: say so, time the rest
                    errors[v] = str(e)
                    results.pop(v, None)
        records.append({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "m_shard": m, "k": k,
                        "n": n, "calls_per_replay": CALLS,
                        "ms_per_call": {v: statistics.median(t) for v, t in results.items()},
                        "rounds": results, "errors": errors})
        print(json.dumps(records[-1]["ms_per_call"] | {"shape": shape}), flush=True)
    (out / "probe_protocol_cost.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
