"""Can torch's own inductor compile the DTensor TP+SP MLP with dynamic shapes here?  Two GPUs
(NCCL); the MLP of validate.build("tp_sp_mlp") at dim 4096 / hidden 8192, bf16, compiled with
dynamic=True and called at two sequence lengths, forward and backward, with backend inductor
then commopt.  Session 20 (2x H100, torch 2.11.0+cu130): inductor itself fails
("unhashable type: non-nested SymInt", hashing a DTensorSpec in AOTAutograd), so the GPU test
test_compiled_dynamic_shapes_pick_per_call runs the funcol form of the MLP there instead.

    python3 benchmarks/probe_dynamic_dtensor.py
"""

from __future__ import annotations

import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from torch_commopt.launch import run_distributed  # noqa: E402


def job(rank: int, world: int, backend: str) -> str:
    import torch_commopt  # noqa: F401  (registers the backend)
    from torch_commopt.validate import build

    torch._dynamo.reset()
    shape = {"batch": 1, "dim": 4096, "hidden": 8192, "heads": 32, "seq": 8192}
    model, _ = build("tp_sp_mlp", torch.bfloat16, 0, shape)
    fn = torch.compile(model.cuda(), backend=backend, dynamic=True)
    try:
        for seq in (8192, 256):
            _, x = build("tp_sp_mlp", torch.bfloat16, 0, dict(shape, seq=seq))
            fn(x.cuda()).float().sum().backward()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported, not raised
        lines = str(e).splitlines()
        return f"{type(e).__name__}: " + ([line for line in lines if "Error" in line] or lines[:1] or [""])[0][:200]


if __name__ == "__main__":
    print("torch", torch.__version__, flush=True)
    for backend in ("inductor", "commopt"):
        try:
            print(backend, run_distributed(job, 2, backend, backend="nccl", timeout_s=300), flush=True)
        except Exception as e:  # noqa: BLE001
            print(backend, "run failed:", str(e)[-600:], flush=True)
