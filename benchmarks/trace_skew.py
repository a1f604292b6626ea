"""Where one rank's device sat idle, and how much of it was waiting for its peer (Chrome
traces of the same steps on two ranks, CPU only).

bench_e2e with COMMOPT_TRACE_DIR set writes the profiled steps of every variant and rank
(`<variant>_sustained_rank<r>.json`, step_profile.breakdown).  The two ranks of one host share
its clock (in session 39's traces their NCCL kernels ended within 0.6 us of each other), so
their timelines can be laid side by side.  Each idle gap of a rank (no kernel and no copy on
any of its streams for at least --min-us) is counted as

  peer: the gap ends within --slack-us after the peer finished something this rank was
        waiting for: a copy-engine push into it (`Memcpy PtoP` on the peer), or, where the
        rank's next device event is a copy (a pull after the peer's flag), a kernel of the
        peer's -- the rank was waiting for the slower rank;
  local: everything else -- stream memory operations and cross-stream waits between the
        rank's own kernels (a few us each), the host falling behind.

With NCCL the same waiting for the slower rank is spent inside the NCCL kernels and counts as
busy, so idle time alone is not comparable between a variant that synchronizes through flags
and one that synchronizes through NCCL: this splits it.

    python3 benchmarks/trace_skew.py RANK0.json RANK1.json [--min-us 5] [--slack-us 20] [--steps 3]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from trace_compare import device_events, trace_events  # noqa: E402


def idle_gaps(events: list[dict], min_us: float) -> list[tuple[float, float, dict, dict]]:
    """(start, end, event before, event after) of every gap of at least min_us in the union of
    a rank's device events (sorted by start)."""
    out, end, last = [], None, None
    for e in events:
        if end is not None and e["start"] - end >= min_us:
            out.append((end, e["start"], last, e))
        if end is None or e["end"] > end:
            end, last = e["end"], e
    return out


def _ended_just_before(ends: list[float], lo: float, hi: float, slack: float) -> bool:
    """Whether one of the sorted `ends` falls in (lo, hi] no more than `slack` before hi."""
    i = bisect.bisect_right(ends, hi) - 1
    return i >= 0 and lo < ends[i] and hi - ends[i] <= slack


def split_idle(mine: list[dict], peer: list[dict], min_us: float = 5.0, slack_us: float = 20.0) -> dict:
    """{"idle_us", "gaps", "peer_us", "peer_gaps", "local_us", "local_gaps", "span_us", "by_pair"}:
    one rank's idle split into waiting for the peer and the rest (module docstring); by_pair: the
    local gaps summed by (event before, event after) names, largest first."""
    pushes = sorted(e["end"] for e in peer if e["copy"] and "ptop" in e["name"].lower())
    kernels = sorted(e["end"] for e in peer if not e["copy"])
    out = collections.Counter()
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for lo, hi, before, after in idle_gaps(mine, min_us):
        waited = _ended_just_before(pushes, lo, hi, slack_us) or (
            "memcpy" in after["name"].lower() and _ended_just_before(kernels, lo, hi, slack_us))
        kind = "peer" if waited else "local"
        out[f"{kind}_us"] += hi - lo
        out[f"{kind}_gaps"] += 1
        if not waited:
            acc = pairs[(before["name"][:48], after["name"][:48])]
            acc[0] += hi - lo
            acc[1] += 1
    result = {k: out[k] for k in ("peer_us", "peer_gaps", "local_us", "local_gaps")}
    result["idle_us"] = result["peer_us"] + result["local_us"]
    result["gaps"] = result["peer_gaps"] + result["local_gaps"]
    result["span_us"] = (max(e["end"] for e in mine) - mine[0]["start"]) if mine else 0.0
    result["by_pair"] = sorted(((b, a, us, n) for (b, a), (us, n) in pairs.items()), key=lambda r: -r[2])
    return result


def report(path0: str, path1: str, min_us: float, slack_us: float, steps: int, top: int = 8) -> list[str]:
    ranks = [device_events(trace_events(p)) for p in (path0, path1)]
    lines = [f"`{pathlib.Path(path0).name}` / `{pathlib.Path(path1).name}`: gaps of >= {min_us:g} us; "
             f"waiting for the peer: the gap ends <= {slack_us:g} us after the peer's push (or, before a pull, "
             f"the peer's kernel); ms per step over {steps} steps", "",
             "| rank | span | idle | waiting for the peer | local |", "|---|---|---|---|---|"]
    splits = []
    for r, (mine, peer) in enumerate([(ranks[0], ranks[1]), (ranks[1], ranks[0])]):
        s = split_idle(mine, peer, min_us, slack_us)
        splits.append(s)
        lines.append(f"| {r} | {s['span_us'] / 1e3 / steps:.2f} "
                     f"| {s['idle_us'] / 1e3 / steps:.3f} ({s['gaps'] / steps:.0f} gaps) "
                     f"| {s['peer_us'] / 1e3 / steps:.3f} ({s['peer_gaps'] / steps:.1f}) "
                     f"| {s['local_us'] / 1e3 / steps:.3f} ({s['local_gaps'] / steps:.0f}) |")
    for r, s in enumerate(splits):
        lines += ["", f"Rank {r}'s local gaps by the device events around them (ms per step, gaps per step):", ""]
        lines += [f"- {b} -> {a}: {us / 1e3 / steps:.3f} ({n / steps:.1f})" for b, a, us, n in s["by_pair"][:top]]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rank0")
    p.add_argument("rank1")
    p.add_argument("--min-us", dest="min_us", type=float, default=5.0)
    p.add_argument("--slack-us", dest="slack_us", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=3, help="steps in the traces (figures are per step)")
    args = p.parse_args()
    print("\n".join(report(args.rank0, args.rank1, args.min_us, args.slack_us, args.steps)))


if __name__ == "__main__":
    main()
