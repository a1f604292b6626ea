"""Ranks sharing one GPU (gloo process group, both on cuda:0, TORCH_COMMOPT_SHARED_DEVICE=1):
which gloo collectives take CUDA tensors, and whether the runtime's IPC-mapped buffers
(kernels/gpu/shared_device.py) are written across processes.  The GPU tests themselves run
this way through `bash tests/gpu/device_run.sh OUT shared`.  PROBE_ONLY=compiled runs
tests/gpu's compiled TP+SP MLP instead, with every thread's stack printed every PROBE_DUMP_S
seconds and faulthandler files in PROBE_DUMP_DIR (how the functional collectives' segfault over
gloo was found).  Nothing here times anything.
Usage: python benchmarks/probe_shared_gpu.py OUTDIR
"""

from __future__ import annotations

import json
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]


def _step(report, name, fn):
    try:
        report[name] = {"ok": True, "value": fn()}
    except Exception:
        report[name] = {"ok": False, "error": traceback.format_exc()[-2500:]}
    return report[name]["ok"]


def _ipc_buffers(rank, world):
    import torch
    import torch.distributed as dist

    from torch_commopt.kernels.gpu import symm

    rt = symm.runtime(dist.group.WORLD.group_name, torch.device("cuda", 0))
    buf = rt.buffer(1 << 20)
    peer = (rank + 1) % world
    buf.view(peer, 0, (1024,), torch.float32).fill_(float(rank + 10))
    torch.cuda.synchronize()
    dist.barrier()
    got = buf.view(rank, 0, (4,), torch.float32).tolist()
    return {"got": got, "expected": float((rank - 1) % world + 10)}


def _gloo_cuda(rank, world):
    import torch
    import torch.distributed as dist

    out = {}
    x = torch.full((4, 3), float(rank + 1), device="cuda")
    for name, fn in {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(x.new_empty(4 * world, 3), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x.new_empty(4 // world, 3), x),
        "all_to_all_single": lambda: dist.all_to_all_single(x.new_empty(4, 3), x),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
    }.items():
        try:
            fn()
            torch.cuda.synchronize()
            out[name] = "ok"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
        dist.barrier()
    return out


def _stack_dumps(rank, every_s):
    """Print every thread's stack every `every_s` seconds (where a hang sits)."""
    import threading
    import time

    def loop():
        while True:
            time.sleep(every_s)
            for tid, frame in sys._current_frames().items():
                if tid != threading.get_ident():
                    print(f"rank {rank} thread {tid}:\n" + "".join(traceback.format_stack(frame)[-12:]), file=sys.stderr,
                          flush=True)

    threading.Thread(target=loop, daemon=True).start()
    import faulthandler
    import os

    _stack_dumps.file = open(os.path.join(os.environ.get("PROBE_DUMP_DIR", "."), f"faulthandler_rank{rank}.txt"), "w")
    faulthandler.enable(file=_stack_dumps.file)  # a crash in native code: where
    faulthandler.dump_traceback_later(every_s, repeat=True, file=_stack_dumps.file)
    print(f"rank {rank}: stack dumps every {every_s} s", file=sys.stderr, flush=True)


def worker(rank, world):
    import os

    import torch

    print(f"rank {rank}: worker started", file=sys.stderr, flush=True)
    report = {}
    if os.environ.get("PROBE_ONLY") == "compiled":
        import kernel_cases

        _stack_dumps(rank, float(os.environ.get("PROBE_DUMP_S", "60")))
        shape = {"batch": 2, "seq": 64, "dim": 256, "hidden": 512, "heads": 4}
        _step(report, "compiled", lambda: kernel_cases.run_compiled_models(
            rank, world, {"schedule": "ce_push", "chunks": 2}, ("tp_sp_mlp",), shape, "bfloat16"))
        return report
    report["device"] = torch.cuda.get_device_name(0)
    _step(report, "gloo_cuda", lambda: _gloo_cuda(rank, world))
    _step(report, "ipc_buffers", lambda: _ipc_buffers(rank, world))
    return report


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import os

    from torch_commopt.launch import run_distributed

    os.environ["TORCH_COMMOPT_SHARED_DEVICE"] = "1"

    try:
        reports = run_distributed(worker, 2, backend="gloo", timeout_s=420)
    except Exception:
        reports = [{"launch_error": traceback.format_exc()[-4000:]}]
    (out / "shared_gpu.json").write_text(json.dumps(reports, indent=1, default=str))
    for r, rep in enumerate(reports):
        for k, v in rep.items():
            print(r, k, json.dumps(v, default=str)[:1500])


if __name__ == "__main__":
    main()
