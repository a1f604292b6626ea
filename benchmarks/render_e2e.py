"""bench_e2e's records and markdown report: per-variant rows from the workers' results (speedups,
loss agreement, share of the comm-free bound's gain) and the report's tables and notes."""

from __future__ import annotations

import statistics

from benchmarks import comm_free
from benchmarks.step_profile import format_idle, kernel_differences, split
from torch_commopt.core import env

# environment variables a variant's steps run with (read at each call: set around each step)
VARIANT_ENV = {"commopt watchdog off": {env.WATCHDOG: "0"}, "commopt python host": {env.HOST_REPLAY: "0"},
               "commopt tokens on side": {env.TOKENS_ON_SIDE: "1"}, "commopt own rows early": {env.GATHER_OWN_EARLY: "1"}}
COMM_FREE = "inductor comm-free"
SYNC_ONLY = "inductor sync-only"  # the ranks meet at every exchange, no bytes move (benchmarks/comm_free.py)


def records(res: dict, shape: dict, world: int) -> list[dict]:
    rows = []
    for variant, r in res.items():
        if "skipped" in r:
            continue
        rows.append({"model": "llama3-8b-shaped", "layers": shape["layers"], "tp": world, "sp": True,
                     "seq": shape["seq"], "batch": shape["batch"], "backend": variant, "step_ms": r["step_ms"],
                     "tokens_per_s": r["tokens_per_s"], "peak_mem_gib": r["peak_mem_gib"],
                     "loss_first": r["losses"][0], "loss_last": r["losses"][-1], "losses": r["losses"],
                     "breakdown_ms": r.get("breakdown_ms"), "regions": r.get("regions"),
                     "host_enqueue_ms": r.get("host_enqueue_ms"), "step_ms_all": r.get("step_ms_all"),
                     "step_ms_isolated": r.get("step_ms_isolated"),
                     "step_ms_isolated_all": r.get("step_ms_isolated_all"), "burst_enqueue_ms": r.get("burst_enqueue_ms"),
                     "host_profile": r.get("host_profile"), "gpu_clocks": r.get("gpu_clocks"),
                     "profile_gpu_clocks": r.get("profile_gpu_clocks"), "band_notes": r.get("band_notes"),
                     "bound": r.get("bound", False), "sync_only": r.get("sync_only", False),
                     "comm_free": r.get("comm_free")})
    base = {r["backend"]: r for r in rows}
    for r in rows:
        for ref in ("inductor", "inductor+async-TP"):
            if ref in base:
                r[f"speedup_vs_{ref}"] = base[ref]["step_ms"] / r["step_ms"]
                if r.get("step_ms_isolated") and base[ref].get("step_ms_isolated"):
                    r[f"isolated_speedup_vs_{ref}"] = base[ref]["step_ms_isolated"] / r["step_ms_isolated"]
        if "inductor" in base and not r["bound"] and not r["sync_only"]:
            ref_l = base["inductor"]["losses"]
            r["max_loss_rel_diff_vs_inductor"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_l))
    bound = next((r for r in rows if r["bound"]), None)
    if bound and "inductor" in base:  # how much of what hiding all communication could win each variant won
        gap = base["inductor"]["step_ms"] - bound["step_ms"]
        for r in rows:
            r["share_of_comm_free_gain"] = (base["inductor"]["step_ms"] - r["step_ms"]) / gap if gap > 0 else None
    return rows


def _clock_lines(rows: list[dict], key: str) -> list[str]:
    """One line per variant of its `key` clock figures (gpu_clocks.ClockSampler.summary, per GPU)."""
    return [f"- {r['backend']}: " + "; ".join(
        f"GPU {i} ({c['samples']}) {c['sm_mhz_mean']:.0f} MHz [{c['sm_mhz_min']:.0f}..{c['sm_mhz_max']:.0f}], "
        f"{c['power_w_mean']:.0f} W, capped {c['power_capped_share']:.0%}" for i, c in (r.get(key) or {}).items())
        for r in rows]


def report(rows: list[dict], meta: dict) -> str:
    lines = [f"# End-to-end training, Llama-3-8B-shaped stack, {meta['device']} x{meta['world']} ({meta['date']})", "",
             f"torch {meta['torch']}, commit {meta['commit']}, shape {meta['shape']}, bf16, fused AdamW, "
             f"{meta['steps']} steps per backend (the loss curve); then {meta.get('repeats', '?')} rounds, the "
             "variants in turns (order rotated per round); a turn: one step on its own (synchronized before "
             f"and after: 'isolated'), then {meta.get('burst', 1)} steps back to back with one synchronize at "
             "the end, as a training loop runs them (step ms, tokens/s); each the median over rounds, slowest "
             "rank.", "",
             f"Command: `{meta['command']}`", "",
             "| backend | step ms | tokens/s | vs inductor | vs inductor+async-TP | isolated step ms (vs inductor) "
             "| peak GiB | loss first -> last | max loss diff vs inductor |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        iso = (f"{r['step_ms_isolated']:.2f} ({r.get('isolated_speedup_vs_inductor', float('nan')):.3f})"
               if r.get("step_ms_isolated") else "-")
        losses = ("(bound: no communication, losses meaningless) | -" if r.get("bound") else
                  "(no data moved: losses meaningless) | -" if r.get("sync_only") else
                  f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} | {r.get('max_loss_rel_diff_vs_inductor', 0):.1e}")
        lines.append(f"| {r['backend']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r.get('speedup_vs_inductor', float('nan')):.3f} | "
                     f"{r.get('speedup_vs_inductor+async-TP', float('nan')):.3f} | {iso} | "
                     f"{r['peak_mem_gib'] if r['peak_mem_gib'] is None else round(r['peak_mem_gib'], 2)} | "
                     f"{losses} |")
    bound = next((r for r in rows if r.get("bound")), None)
    if bound:
        won = ", ".join(f"{r['backend']} {r['share_of_comm_free_gain']:.2f}" for r in rows
                        if not r.get("bound") and r.get("share_of_comm_free_gain") is not None)
        if not comm_free.valid(bound["comm_free"] or {}):
            lines += ["", f"**{bound['backend']} is not a valid bound in this run: collectives were left in its "
                      f"graphs ({bound['comm_free']}).**"]
        taken = ", ".join(f"{k} {v}" for k, v in sorted(bound["comm_free"].items()))
        at_best = bound.get("speedup_vs_inductor", float("nan"))
        lines += ["", f"{bound['backend']} is a bound, not a backend: inductor's program with every collective "
                  f"taken out of its compiled graphs ({taken} "
                  "per rank; benchmarks/comm_free.py), i.e. the step's computation alone on these GPUs, what "
                  f"hiding all of its communication could reach at best: {at_best:.3f}x "
                  f"inductor. Share of that gain each variant won: {won or '-'}."]
    lines += _sync_only_lines(rows) + _paired_lines(rows)
    lead = meta.get("profile_lead", 0)
    start = f" after {lead} unprofiled ones" if lead else ", from an idle GPU"
    lines += ["", f"Device time per step by kernel category ({meta.get('profile_steps', 1)} steps profiled back to "
              f"back{start}, per step; rank 0, ms; overlapped kernels both count; gpu_busy: the union of all "
              "kernels and copies over gpu_span, the first to the last; host enqueue: the median time until an "
              "isolated step() returned, before the synchronize):", ""]
    for r in rows:
        lines.append(f"- {r['backend']}: {split(r['breakdown_ms'])[0]}; "
                     f"host enqueue {r.get('host_enqueue_ms') or 0:.2f} ms "
                     f"(in a burst {r.get('burst_enqueue_ms') or 0:.2f} ms per step)")
    if any(r.get("gpu_clocks") for r in rows):
        lines += ["", "GPU clocks while the variant's own steps ran (nvidia-smi every 50 ms, the samples inside "
                  "its timed steps; per GPU: samples, mean SM MHz [lowest..highest], mean W, share of samples "
                  "under the software power cap):", ""]
        lines += _clock_lines(rows, "gpu_clocks")
    if any(r.get("profile_gpu_clocks") for r in rows):
        lines += ["", "GPU clocks while the profiled steps (and their lead) ran (nvidia-smi every 20 ms; as "
                  "above):", ""]
        lines += _clock_lines(rows, "profile_gpu_clocks")
    kernels = _kernel_lines(rows)
    if kernels:
        lines += ["", "Kernels whose time differs most from the comm-free bound's, by name (the profiled steps, "
                  "rank 0; what the categories hide: a kernel of the same name running longer, one only one side "
                  "runs):", "", *kernels]
    idle = [x for r in rows for x in format_idle(r["backend"], split(r["breakdown_ms"])[1])]
    if idle:
        lines += ["", "Where the device sat idle in those steps (rank 0, all of them; the kernel before and after "
                  "each gap; a wait for a peer's copy-engine push shows as a gap before the kernel that reads "
                  "it):", "", *idle]
    for r in rows:
        if r.get("host_profile"):
            lines += ["", f"Host profile ({r['backend']}, rank 0; own ms/step | cumulative ms/step | calls/step | "
                      "function):", "", "```", *r["host_profile"], "```"]
    for r in rows:
        if r.get("regions"):
            lines += ["", f"Regions ({r['backend']}):", ""] + [f"- {x}" for x in r["regions"]]
        if r.get("band_notes"):
            lines += ["", f"The host-bound band ({r['backend']}: graph estimates, first-call timings):", ""]
            lines += [f"- {x}" for x in r["band_notes"]]
    return "\n".join(lines) + "\n"


def _sync_only_lines(rows: list[dict]) -> list[str]:
    """What the sync-only variant is, beside the bound (empty where it did not run)."""
    sync = next((r for r in rows if r.get("sync_only")), None)
    if sync is None:
        return []
    met = ", ".join(f"{k} {v}" for k, v in sorted((sync["comm_free"] or {}).items()) if k.startswith("synced"))
    return ["", f"{SYNC_ONLY} is not a backend either: the bound's program with a one-element all-reduce where "
            f"each collective was ({met or 'none'} per rank): the ranks meet wherever the program exchanges "
            "data and move no bytes, so its distance from the bound is what meeting costs -- each rank waits for "
            "the slower one at every exchange, where the bound pays the slower rank once a step -- apart from "
            f"moving the data: {sync.get('speedup_vs_inductor', float('nan')):.3f}x inductor, "
            f"{sync.get('share_of_comm_free_gain') or float('nan'):.2f} of the bound's gain."]


def _quartiles(values: list[float], form: str) -> str | None:
    """'median (first..third quartile)' of `values` in `form` (None: fewer than two)."""
    if len(values) < 2:
        return None
    q1, med, q3 = statistics.quantiles(values, n=4)
    return f"{form.format(med)} ({form.format(q1)}..{form.format(q3)})"


def _per_round(rows: list[dict], r: dict, key: str) -> list[str]:
    """r's per-round comparisons on `key` (the burst's or the isolated step's times)."""
    by = {x["backend"]: x for x in rows if x.get(key)}
    ind, bound, mine = by.get("inductor"), next((x for x in by.values() if x.get("bound")), None), r.get(key) or []
    parts = []
    if ind is not None and r is not ind:
        parts.append(("× inductor", _quartiles([a / b for a, b in zip(ind[key], mine)], "{:.3f}")))
        if bound is not None and r is not bound and not r.get("bound"):
            shares = [(i - v) / (i - b) for i, v, b in zip(ind[key], mine, bound[key]) if i > b]
            parts.append(("share of the bound's gain", _quartiles(shares, "{:.2f}")))
    if r["backend"] in VARIANT_ENV and "commopt" in by:  # commopt with one switch flipped
        cost = [(a / b - 1) * 100 for a, b in zip(by["commopt"][key], mine)]
        parts.append(("commopt's cost over it", _quartiles(cost, "{:+.2f}%")))
    return [f"{what} {text}" for what, text in parts if text]


def _paired_lines(rows: list[dict]) -> list[str]:
    """Each variant against inductor round by round (and against the bound's gain, and a
    VARIANT_ENV variant against commopt): the variants ran back to back in each round, so a drift
    of the power-capped clocks between rounds cancels; medians and quartiles of the per-round
    figures, rank 0's times."""
    out = []
    for r in rows:
        burst, isolated = _per_round(rows, r, "step_ms_all"), _per_round(rows, r, "step_ms_isolated_all")
        if burst or isolated:
            rounds = len(r.get("step_ms_all") or [])
            out.append(f"- {r['backend']} ({rounds} rounds): back to back {', '.join(burst) or '-'}; "
                       f"isolated {', '.join(isolated) or '-'}")
    if not out:
        return []
    return ["", "Paired by round (each round's figures from variants that ran back to back; median "
            "(quartiles) over rounds, rank 0):", "", *out]


def _kernel_lines(rows: list[dict]) -> list[str]:
    """Each commopt variant's kernels against the comm-free bound's (step_profile.kernel_differences)."""
    bound = next((r for r in rows if r["backend"] == COMM_FREE), None)
    if bound is None:
        return []
    theirs = (bound.get("breakdown_ms") or {}).get("kernels")
    return [x for r in rows if r["backend"].startswith("commopt")
            for x in kernel_differences(r["backend"], (r.get("breakdown_ms") or {}).get("kernels"),
                                        "the bound", theirs)]
