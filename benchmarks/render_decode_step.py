"""decode_step's derived figures and markdown report: tokens/s, the speedup over inductor+nccl,
the HBM floor, each variant's all-reduce time and agreement, one table per case."""

from __future__ import annotations

from benchmarks.common import fmt

# H200's nominal HBM3e bandwidth (NVIDIA's data sheet, 4.8 TB/s): the HBM floor's denominator.
# A nominal figure, not a measured one: no kernel reaches it, so the floor is a lower bound.
HBM_BYTES_PER_S = 4.8e12
BOUND = "inductor comm-free"


def hbm_floor_ms(nbytes: int) -> float:
    """The time to read `nbytes` at HBM_BYTES_PER_S."""
    return nbytes / HBM_BYTES_PER_S * 1e3


def derive(records: list[dict]) -> list[dict]:
    """Each case's figures from its raw ones only: tokens/s, the speedup over inductor+nccl, the
    HBM floor, each variant's all-reduce time (its step minus the comm-free bound's), and agreement:
    an error vs the truth within TOLERANCE_FACTOR x the reference variant's own (at least float32
    rounding at the logits' scale), with the same logits on every rank. The bound is not compared."""
    from torch_commopt.testing.validate import TOLERANCE_FACTOR

    for c in records:
        ms, base, bound = c["ms"], c["ms"].get("inductor+nccl"), c["ms"].get(BOUND)
        c["tokens_per_s"] = {v: c["batch"] / (t / 1e3) for v, t in ms.items()}
        c["speedup_vs_inductor_nccl"] = {v: base / t for v, t in ms.items()} if base else {}
        c["hbm_floor_ms"] = hbm_floor_ms(c["bytes_per_step"])
        c["all_reduce_ms"] = {v: t - bound for v, t in ms.items() if v != BOUND} if bound is not None else {}
        ref_err = c["max_abs_vs_truth"].get(c["reference"])
        allowed = None if ref_err is None else TOLERANCE_FACTOR * max(ref_err, c["logit_scale"] * 2.0 ** -24)
        c["allowed_error_vs_truth"] = allowed
        c["agree"] = {v: allowed is not None and e <= allowed and c["same_on_every_rank"][v]
                      for v, e in c["max_abs_vs_truth"].items() if v != BOUND}
    return records


def table_row(c: dict, v: str) -> str:
    """A variant's line of a case's table."""
    compared = v != BOUND
    agree = "bound"
    if compared:
        agree = "yes" if c["agree"][v] else "NO (ranks differ)" if not c["same_on_every_rank"][v] else "NO"

    def err(key: str) -> str:
        x = c[key].get(v) if compared else None
        return "-" if x is None else f"{x:.2e}"

    calls = c.get("collective_calls", {}).get(v)
    program = "-" if calls is None else ", ".join(f"{n} {k}" for k, n in calls.items() if n) or "none"
    regions = c["regions"].get(v)
    if regions:
        program += f" ({', '.join(regions['schedules'])}; {regions['kept']} kept)"
    return (f"| {v} | {fmt(c['ms'][v], 3)} | {fmt(c['tokens_per_s'][v], 0)} | "
            f"{fmt(c['speedup_vs_inductor_nccl'].get(v), 3)} | {fmt(c['all_reduce_ms'].get(v), 3)} | "
            f"{err('max_abs_vs_reference')} | {err('max_abs_vs_truth')} | {agree} | {program} | "
            f"{fmt(c['compile_s'].get(v), 1)} |")


def report(records: list[dict], meta: dict) -> str:
    """The Markdown report: one table per case (derive() first)."""
    truth_dtype = "float64" if meta["mode"] == "cpu" else "float32"
    lines = [f"# A whole decoder step, {meta['shape_name']} ({meta['device']}, {meta['world']} ranks, {meta['mode']})",
             "", f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}; shape {meta['shape']}. ms/token: "
             f"median of {meta['rounds']} rounds of {meta['steps']} decode steps back to back, the slowest rank, the "
             "variants in turns (order rotated each round). HBM floor: the bytes a rank reads per step (its weights, "
             f"its KV heads' cache over ctx) / {HBM_BYTES_PER_S / 1e12:.1f} TB/s (nominal). AR ms: the step minus the "
             f"comm-free bound's. Δ: max |Δ logits| vs the reference variant and vs the same step in {truth_dtype} "
             "(the truth); agree: the error vs the truth within "
             "validate.TOLERANCE_FACTOR x the reference's own, and the same logits on every rank. All-reduces in "
             "its program: the calls in the code Inductor wrote for the variant (commopt's with the schedules of "
             "its regions, and how many it kept as compiled).", "",
             f"Command: `{meta['command']}`", ""]
    if meta["mode"] == "shared":
        lines += ["The ranks share one GPU (TORCH_COMMOPT_SHARED_DEVICE=1, gloo): a correctness run. Its times are "
                  "of processes time-slicing one GPU, not timings.", ""]
    for c in records:
        peak = f"; peak {c['peak_gib_per_rank']:.1f} GiB per rank" if c.get("peak_gib_per_rank") else ""
        lines += [f"## batch {c['batch']}, context {c['ctx']}", "",
                  f"HBM floor {fmt(c['hbm_floor_ms'], 3)} ms ({c['bytes_per_step'] / 1e9:.3f} GB per rank per step)"
                  f"; reference: {c['reference']}; allowed error vs truth "
                  f"{'-' if c['allowed_error_vs_truth'] is None else format(c['allowed_error_vs_truth'], '.2e')}{peak}.",
                  "", "| variant | ms/token | tokens/s | × inductor+nccl | AR ms | Δ vs reference | Δ vs truth | agree "
                  "| all-reduces in its program | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [table_row(c, v) for v in c["ms"]]
        if meta["mode"] != "cpu":  # every variant replayed from CUDA graphs, or said here
            lines += [f"- NOT replayed from CUDA graphs: {v} (Inductor skipped {n} graph(s))"
                      for v, n in c.get("cudagraph_skips", {}).items() if n]
        lines += [f"- not run: {v}: {why}" for v, why in c["not_run"].items()] + [""]
    return "\n".join(lines)
