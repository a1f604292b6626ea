"""Probe: how fast can the Ulysses all-to-all's exposed moves go, by mechanism?

At 16K tokens with one head group (2x H100, session 33 timeline) every push of the training
call is exposed -- q, k, v in (3 x 32 MiB a rank), out back, dout in, dq, dk, dv back -- at
~89 us per 32 MiB by the copy engine (~377 GB/s while both ranks push), and each result's
staged copy out of the slot takes 41 us (32 MiB).  Nothing runs on the SMs meanwhile, so an SM
copy is free there.  Timed here, both ranks moving at once (CUDA events, median of rounds,
slowest rank), for 96 MiB a rank laid out as the all-to-all lays it (rows of 2 MiB, the
source's pitch twice that):

    ce_2d        three 2-D copies on one stream (what ce_a2a queues)
    ce_2d_2      the same rows split over two streams (two copy engines?)
    ce_flat      one contiguous 96 MiB copy
    sm_<b>       a Triton copy kernel with b blocks storing into the peer (NVLink stores)
    local_ce_2d  the staged copies: three 32 MiB 2-D copies within the GPU
    local_sm     the same by torch's copy_ (SM kernel)

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_push_paths.py OUTDIR
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torch_commopt.launch import run_distributed  # noqa: E402

ROW, ROWS, TENSORS = 2 << 20, 16, 3  # bytes a row, rows a tensor: 32 MiB, three tensors
ROUNDS, CALLS = 7, 10


def probe(rank: int, world: int) -> dict:
    from torch_commopt.kernels.gpu import driver, symm
    from torch_commopt.kernels.gpu.triton_kernels import copy_rows

    rt = symm.runtime(dist.group.WORLD.group_name, torch.device("cuda", rank))
    nbytes = TENSORS * ROWS * ROW
    buf = rt.buffer(2 * nbytes)
    peer = (rank + 1) % world
    # sources as the all-to-all reads them: every other 2 MiB row of a tensor twice the size
    srcs = [torch.randn(ROWS * 2 * ROW // 2, device="cuda", dtype=torch.bfloat16) for _ in range(TENSORS)]
    flat = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    local = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    to_peer = buf.address(peer, 0)
    own = buf.address(rank, nbytes)
    peer_view = buf.view(peer, 0, (nbytes // 2,), torch.bfloat16)
    cur, side, other = torch.cuda.current_stream(), rt.side, rt.local
    part = ROWS * ROW

    def on(streams, body):
        for s in streams:
            s.wait_stream(cur)
        body()
        for s in streams:
            cur.wait_stream(s)

    def ce_2d():
        for t, x in enumerate(srcs):
            driver.memcpy2d_async(side, to_peer + t * part, ROW, x.data_ptr(), 2 * ROW, ROW, ROWS)

    def ce_2d_2():
        for t, x in enumerate(srcs):
            for j, s in enumerate((side, other)):
                h = ROWS // 2
                driver.memcpy2d_async(s, to_peer + t * part + j * h * ROW, ROW, x.data_ptr() + j * h * 2 * ROW,
                                      2 * ROW, ROW, h)

    def ce_flat():
        driver.memcpy_async(side, to_peer, flat.data_ptr(), nbytes)

    def local_ce_2d():
        for t, x in enumerate(srcs):
            driver.memcpy2d_async(side, local.data_ptr() + t * part, ROW, own + t * part, ROW, ROW, ROWS)
            # (within the GPU: the staged copies read the slot, write ordinary memory)

    staged = buf.view(rank, nbytes, (TENSORS, ROWS, ROW // 2), torch.bfloat16)
    dst_view = local.view(TENSORS, ROWS, ROW // 2)

    variants = {
        "ce_2d": lambda: on([side], ce_2d),
        "ce_2d_2": lambda: on([side, other], ce_2d_2),
        "ce_flat": lambda: on([side], ce_flat),
        "sm_132": lambda: copy_rows(flat, peer_view, 132),
        "sm_264": lambda: copy_rows(flat, peer_view, 264),
        "sm_528": lambda: copy_rows(flat, peer_view, 528),
        "local_ce_2d": lambda: on([side], local_ce_2d),
        "local_sm": lambda: dst_view.copy_(staged),
    }
    times = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(ROUNDS):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / CALLS)
        ms = torch.tensor([statistics.median(samples)], device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        times[name] = round(ms.item(), 4)
    dist.barrier()
    return times


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    times = run_distributed(probe, 2, backend="nccl", timeout_s=300)[0]
    mib = TENSORS * ROWS * ROW / 2**20
    rows = {name: {"ms": ms, "GB_s": round(mib * 2**20 / (ms * 1e-3) / 1e9, 1)} for name, ms in times.items()}
    for name, r in rows.items():
        print(f"{name:12s} {r['ms']:.4f} ms  {r['GB_s']} GB/s ({mib:.0f} MiB a rank)")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "mib_per_rank": mib, "rows": rows,
              "command": " ".join(["python3", *sys.argv])}
    (out / "probe_push_paths.json").write_text(json.dumps(result, indent=1))
