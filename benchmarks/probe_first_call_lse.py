"""Probe: the world-4 precision deviation of the compiled Ulysses program on CPU/gloo.

About one run in 20 (6 of 122, session 26, the 2-core CI-class machine, two intra-op threads
per rank) ended with every rank 40-100x eager float32's error.  In each, one rank's first local
attention (the `math` backend) had a logsumexp 1e-5..5e-5 too high in one batch half, on inputs
that were bit-exact, and the same call repeated at once was exact.  This runs the test's program
(tests/attention/compiled_programs.compiled_ulysses) `--runs` times on `--world` gloo ranks with
`--threads` intra-op threads each, checks every rank's first local-attention call against float64
on the same inputs, repeats that call, and prints one JSON line per run:

    python3 benchmarks/probe_first_call_lse.py --runs 60 --threads 2   # deviations expected
    python3 benchmarks/probe_first_call_lse.py --runs 60 --threads 1   # none seen in 70 runs
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "attention")]

from torch_commopt.launch import run_distributed  # noqa: E402


def worker(rank: int, world: int, causal: bool) -> dict:
    import compiled_programs
    import torch

    from torch_commopt.attention import local

    seen: dict = {}
    pick = local.pick

    class Checked:  # the picked backend, its first forward checked against float64
        def __init__(self, backend):
            self.backend, self.name = backend, backend.name

        def fwd(self, q, k, v, scale, causal_block):
            out, lse = self.backend.fwd(q, k, v, scale, causal_block)
            if "first" not in seen:
                out64, lse64 = self.backend.fwd(q.double(), k.double(), v.double(), scale, causal_block)
                again, again_lse = self.backend.fwd(q, k, v, scale, causal_block)
                seen["first"] = {"backend": self.name, "out_err": _rel(out, out64), "again_err": _rel(again, out64),
                                 "lse_max_dev_per_batch": [float((lse[b] - lse64[b]).abs().max())
                                                           for b in range(lse.shape[0])],
                                 "again_equal": bool(torch.equal(again, out) and torch.equal(again_lse, lse))}
            return out, lse

        def bwd(self, *args):
            return self.backend.bwd(*args)

    local.pick = lambda q, k, name="auto": Checked(pick(q, k, name))
    errs, notes, _ = compiled_programs.compiled_ulysses(rank, world, (2 * world, world), causal)
    (_, err, eager), = errs
    return {"rank": rank, "threads": torch.get_num_threads(), "err": err, "eager_err": eager, "notes": notes, **seen}


def _rel(x, ref) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads per rank (OMP_NUM_THREADS)")
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the spawned ranks inherit it (launch keeps it)
    deviating = 0
    for i in range(args.runs):
        ranks = run_distributed(worker, args.world, args.causal)
        worst = max(r["err"] / max(r["eager_err"], 1e-30) for r in ranks)
        deviating += worst > 4.0
        print(json.dumps({"run": i, "worst_x_eager": round(worst, 1), "ranks": ranks}), flush=True)
    print(json.dumps({"runs": args.runs, "threads": args.threads, "world": args.world, "deviating": deviating}))


if __name__ == "__main__":
    main()
