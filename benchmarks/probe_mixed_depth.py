"""Probe (timing only): would Ulysses gain from a forward and a backward of different depths?

The forward over two head groups hides half of its moves for a split that costs its cuDNN
kernel little (2x H100, 16K tokens, two groups on two streams: +0.05 / +0.01 ms MHA / GQA,
probe_attention_streams), while splitting the backward costs its kernel 0.32 / 0.09 ms for the
~0.19 ms of moves it hides.  Timed here before building it: the training pair
cp_attention_fwd_keep / cp_attention_bwd_kept with the forward at depth F and the backward at
depth B, back to back like profile_cp_attention.py (eager, the same sharded inputs), the four
(F, B) of {1, 2}, in an order rotated per round.

F != B runs the backward on the forward's kept tensors viewed at the other depth (B = 1 only:
(G, 1, h, S, D) as (1, 1, G h, S, D)), so it moves the same bytes and launches the same kernels
as a built mixed schedule would, but over another head assignment: its gradients are WRONG and
only its time means anything.  B 1 only.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_mixed_depth.py OUTDIR [--seq 16384] [--heads 32/32,32/8]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torch_commopt.launch import run_distributed  # noqa: E402

DEPTHS = [(1, 1), (2, 2), (2, 1), (1, 2)]
ROUNDS, CALLS = 9, 10


def _regroup(kept, groups: int):
    """The kept tensors (G, 1, h, S, ...) viewed at `groups` head groups (B 1: a view)."""
    out = []
    for t in kept:
        g, b, h = t.shape[:3]
        assert b == 1, "B 1 only"
        out.append(t.view((groups, 1, g * h // groups) + tuple(t.shape[3:])))
    return tuple(out)


def worker(rank: int, world: int, args) -> dict:
    import torch_commopt  # noqa: F401
    from torch_commopt.attention import schedules

    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    res = {}
    for heads in args.heads.split(","):
        h, h_kv = (int(x) for x in heads.split("/"))
        gen = torch.Generator(device="cuda").manual_seed(7)
        s_loc = args.seq // world

        def mk(hh):
            return torch.randn(1, hh, s_loc, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
        q, k, v, dout = mk(h), mk(h_kv), mk(h_kv), mk(h)
        kw = dict(schedule="ulysses", causal=True, group=group)

        def step_of(f: int, b: int):
            def step():
                _, kept = schedules.cp_attention_fwd_keep(q, k, v, head_groups=f, **kw)
                return schedules.cp_attention_bwd_kept(dout, kept if f == b else _regroup(kept, b), **kw)
            return step
        steps = {f"fwd{f}_bwd{b}": step_of(f, b) for f, b in DEPTHS}
        for step in steps.values():
            for _ in range(2):
                step()
        torch.cuda.synchronize()
        samples = {name: [] for name in steps}
        for r in range(ROUNDS):
            names = list(steps)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    steps[name]()
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - t0) / CALLS * 1e3)
        for name, xs in samples.items():
            ms = torch.tensor([statistics.median(xs)], dtype=torch.float64, device="cuda")
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            res[f"{heads} {name}"] = {"ms": round(ms.item(), 4), "rounds_rank": [round(x, 3) for x in xs]}
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", default="32/32,32/8")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run_distributed(worker, 2, args, backend="nccl", timeout_s=400)[0]
    for name, r in res.items():
        print(f"{name:24s} {r['ms']:.3f} ms")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "seq": args.seq, "records": res,
              "command": " ".join(["python3", *sys.argv]),
              "note": "fwd F != bwd B: timing only, the backward's head assignment is not the forward's"}
    (out / "probe_mixed_depth.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
