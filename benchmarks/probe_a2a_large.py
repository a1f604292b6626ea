"""Does the copy-engine Ulysses all-to-all (attention/ce_a2a.py) stay exact once its buffer
passes 1 GiB?  Two ranks; for each case the forward (and, where asked, backward) of a
ulysses:g=G call with the copy engine is compared with the same call on NCCL's all-to-alls
(same inputs; both run the same local attention, so they agree to the last bit when the moves
are right).  Session 20 saw ulysses:g=1 at B1 H32/32 S32768 (a 1028 MiB buffer -> the 2 GiB
size class) 0.6 off in bench_attention; every smaller case was exact.

    torchrun --nproc-per-node 2 benchmarks/probe_a2a_large.py OUTDIR
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_commopt.attention.schedules import cp_attention_bwd, cp_attention_fwd  # noqa: E402

ENV = "TORCH_COMMOPT_ATTENTION_A2A"
CASES = [  # (S_total, H, H_kv, G, backward)
    (32768, 32, 32, 1, False), (32768, 32, 32, 1, False), (32768, 32, 8, 1, False),
    (16384, 32, 32, 1, False), (65536, 32, 32, 2, False), (32768, 32, 32, 1, True),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _run(q, k, v, dout, g: int, backward: bool, transport: str) -> list[torch.Tensor]:
    os.environ[ENV] = transport
    kw = dict(schedule=f"ulysses:g={g}", causal=True, head_groups=g)
    out, lse = cp_attention_fwd(q, k, v, **kw)
    res = [out, lse]
    if backward:
        res += list(cp_attention_bwd(dout, q, k, v, out, lse, **kw))
    torch.cuda.synchronize()
    return [r.clone() for r in res]


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1])
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    rows = []
    for i, (s, h, hkv, g, backward) in enumerate(CASES):
        torch.manual_seed(100 + i * world + rank)
        mk = lambda heads: torch.randn(1, heads, s // world, 128, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, dout = mk(h), mk(hkv), mk(hkv), mk(h)
        ref = _run(q, k, v, dout, g, backward, "nccl")
        got = _run(q, k, v, dout, g, backward, "ce")
        names = ["out", "lse", "dq", "dk", "dv"][:len(ref)]
        errs = {n: _rel(a, b) for n, a, b in zip(names, got, ref)}
        again = _run(q, k, v, dout, g, backward, "ce")
        errs2 = {n: _rel(a, b) for n, a, b in zip(names, again, ref)}
        from torch_commopt.attention import ce_a2a
        from torch_commopt.kernels.gpu import symm
        rt = symm.existing(dist.group.WORLD.group_name, q.device)
        owned = [b.nbytes >> 20 for b in rt.owned.get(ce_a2a.PURPOSE, [])] if rt is not None else None
        row = dict(rank=rank, S=s, H=h, H_kv=hkv, G=g, backward=backward, first=errs, second=errs2, buffers_mib=owned)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"a2a_large_rank{rank}.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
