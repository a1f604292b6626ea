"""What the Ulysses all-to-all's first call on a grown buffer reads (bench_attention's wrong call).

Session 21 (2x H100) reproduced session 20's wrong result: bench_attention with --seq
16384,32768 --heads 32/32 and `ulysses:g=1` beside a second schedule (ulysses:g=2 or
ring_zigzag) checks `ulysses:g=1` at S32768 wrong (relative error 0.71 or 0.61, the same
values run after run) at the call that grows the copy-engine all-to-all buffer 512 -> 1024 MiB;
`ulysses:g=1` alone (one run) and benchmarks/stress_cp_attention.py (1248 calls, the same
growth) were exact.  A wrong result at a fresh (zero-filled) buffer that later calls on the same
data would hide points at a read before the data landed.

This runs bench_attention's own worker (its cases, schedules, order and timing rounds) with a
hook in ce_a2a: right after each of the first `--uses` pipelines on every buffer has waited for
its data (compute stream, before the attention reads it), the fraction of exactly-zero elements
in every source's block of the IN slot and of the OUT staging slot (bf16 randn inputs have
practically none).  --prepare off: without the library's settling of a new buffer
(symm.GroupRuntime._settle: zeroed here and the device synchronized before the rendezvous, the
session-21 fix), i.e. as the failing runs were; library (default): with it; warm: with it, and
every page of each peer's copy written once by the copy engine before the first use.
--later-ms T: the first use's zeros measured again T ms later (zeros that stay: the data went
elsewhere, e.g. a peer mapping that is not this buffer; zeros that go: it came late).

Session 22 (2x H100): the measurement hides the race.  With it (`--uses 2`) `off` was exact
too; with `--uses 0` (no hook: only the settling removed) `off` was wrong in 2 of 3 runs with
session 21's exact errors and `library` exact (results/a2a_growth_h100x2_2026-11-25_s22.md).
So the A/B of the fix is `--uses 0 --later-ms 0`; the hooked runs say what a first use reads
once the host has synchronized right after its waits (nothing missing, in every variant).

    python benchmarks/probe_a2a_growth.py OUTDIR [--uses 2] [--prepare off|library|warm] [--later-ms 50] -- <bench_attention args>
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_attention  # noqa: E402

_FOUND: list[dict] = []


def _zero_fraction(t: torch.Tensor) -> torch.Tensor:
    return (t == 0).float().mean()


def _install(uses: int, prepare: str, later_ms: float) -> None:
    from torch_commopt.attention import ce_a2a
    from torch_commopt.kernels.gpu import driver, symm

    uses_of: dict[int, int] = {}
    init, arrived, own_buffer = ce_a2a._Pipeline.__init__, ce_a2a._Pipeline._arrived, symm.GroupRuntime.own_buffer

    def hooked_init(self, xs, group, groups, outs):
        init(self, xs, group, groups, outs)
        self._probe_use = uses_of.get(id(self.buf), 0)
        uses_of[id(self.buf)] = self._probe_use + 1

    def hooked_arrived(self, region, half, g):
        arrived(self, region, half, g)
        if self._probe_use >= uses:
            return
        lay, s_loc, n = self.layout, self.seq_local, self.n
        base = half * lay.half
        blocks = []
        if region == ce_a2a.IN:
            for i, (x, off) in enumerate(zip(self.xs, lay.ins)):
                b, h, _, _ = ce_a2a._rows(x.shape)
                shape = (b, h // (self.groups * n), s_loc * n) + tuple(x.shape[3:])
                view = self.buf.view(self.me, base + off, shape, x.dtype)
                blocks += [(i, src, view[:, :, src * s_loc:(src + 1) * s_loc]) for src in range(n)]
        else:
            for src in self.rt.sources:
                for i, ((shape, dtype), off) in enumerate(zip(self.specs, lay.outs)):
                    b, h, _, _ = ce_a2a._rows(shape)
                    hr = h // (self.groups * n)
                    staged = (b, hr, s_loc) + tuple(shape[3:])
                    blocks.append((i, src, self.buf.view(self.me, base + lay.in_bytes + src * lay.out_bytes + off,
                                                          staged, dtype)))
        found = []
        for i, src, block in blocks:  # queued on the compute stream, right after the waits
            found.append({"buffer_mib": self.buf.nbytes >> 20, "use": self._probe_use,
                          "region": "IN" if region == ce_a2a.IN else "OUT", "half": half, "group": g, "tensor": i,
                          "src": src, "own": src == self.me, "shape": list(block.shape),
                          "zero_fraction": _zero_fraction(block)})
        if later_ms and self._probe_use == 0:  # again after a pause: zeros that stay never came here
            torch.cuda._sleep(int(later_ms * 1.5e6))
            for f, (_, _, block) in zip(found, blocks):
                f["zero_fraction_later"] = _zero_fraction(block)
        _FOUND.extend(found)

    def warmed_own_buffer(self, purpose, nbytes):
        before = len(self.owned.get(purpose, []))
        buf = own_buffer(self, purpose, nbytes)
        if prepare == "warm" and len(self.owned.get(purpose, [])) > before:
            torch.cuda.synchronize(self.device)
            dist.barrier()
            scratch = torch.empty(1 << 20, dtype=torch.uint8, device=self.device)
            for peer in self.peers:  # every page of the peer's copy written once by the copy engine
                for start in range(0, buf.nbytes, scratch.numel()):
                    driver.memcpy_async(self.side, buf.address(peer, start), scratch.data_ptr(),
                                        min(scratch.numel(), buf.nbytes - start))
            torch.cuda.synchronize(self.device)
            dist.barrier()
        return buf

    ce_a2a._Pipeline.__init__, ce_a2a._Pipeline._arrived = hooked_init, hooked_arrived
    symm.GroupRuntime.own_buffer = warmed_own_buffer
    if prepare == "off":  # the library before session 21's fix: peers write a buffer nobody settled
        symm.GroupRuntime._settle = lambda self, local: None


def hooked_worker(rank: int, world: int, cases, args, partial_path, uses: int, prepare: str, later_ms: float):
    if torch.cuda.is_available():
        _install(uses, prepare, later_ms)
    records = bench_attention.worker(rank, world, cases, args, partial_path)
    found = [{k: float(v) if isinstance(v, torch.Tensor) else v for k, v in f.items()} for f in _FOUND]
    return records, found


def main() -> None:
    argv = sys.argv[1:]
    bench_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--uses", type=int, default=2, help="pipelines per buffer to inspect (fwd and bwd each count)")
    parser.add_argument("--prepare", choices=("off", "library", "warm"), default="library",
                        help="what a rank does with a new buffer before peers write it: nothing, the "
                             "library's (symm.GroupRuntime._settle), or that and a write of every page "
                             "of each peer's copy")
    parser.add_argument("--later-ms", type=float, default=0.0,
                        help="measure the first use's zeros again after this pause (GPU sleep; ~1.5 GHz clocks)")
    mine = parser.parse_args(own)
    args = bench_attention.parse_args(bench_argv)
    cases = bench_attention.sweep(args)
    from torch_commopt.launch import run_distributed

    results = run_distributed(hooked_worker, args.world, cases, args, None, mine.uses, mine.prepare, mine.later_ms,
                              backend="gloo" if args.cpu else "nccl", timeout_s=1800)
    out = pathlib.Path(mine.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"bench_args": bench_argv, "prepare": mine.prepare, "uses": mine.uses, "later_ms": mine.later_ms,
               "errors": [{"case": f"S{r['S_total']} H{r['H']}/{r['H_kv']}", "schedule_errors": r["schedule_errors"]}
                          for r in results[0][0]],
               "found": {rank: found for rank, (_, found) in enumerate(results)}}
    (out / "probe_a2a_growth.json").write_text(json.dumps(summary, indent=1))
    for e in summary["errors"]:
        print(json.dumps(e))
    for rank, found in summary["found"].items():
        for f in found:
            if not f["own"] or f["zero_fraction"] > 0.01:
                print(json.dumps({"rank": rank, **{k: v for k, v in f.items() if k != "shape"}}))


if __name__ == "__main__":
    main()
