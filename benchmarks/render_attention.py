"""bench_attention's report (`report`), and one report rendered from several runs' records: a run cut
short (its partial.jsonl) next to the run that finished its cases, on the same machine.

    python3 -m benchmarks.render_attention --meta-from RUN.json --stem attention_h200x2_DATE \
        --command "CMD1" --command "CMD2" --note "why two runs" RUN1/partial.jsonl RUN2.json

The machine fields (device, versions, transports) come from --meta-from, a finished run's
JSON; each --command is one run's exact command line.  Records are taken in the order given;
a case measured twice is an error, not a silent pick.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import fmt as _f  # noqa: E402

CASE_KEYS = ("B", "H", "H_kv", "D", "S_total", "causal", "pass", "dtype", "world")


def load_records(path: pathlib.Path) -> list[dict]:
    """A partial.jsonl (one record per line) or a finished run's JSON ({..., "records": [...]})."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)["records"]


def merge(sources: list[list[dict]]) -> list[dict]:
    seen, out = set(), []
    for records in sources:
        for rec in records:
            key = tuple(rec.get(k) for k in CASE_KEYS)
            if key in seen:
                raise ValueError(f"case {dict(zip(CASE_KEYS, key))} appears in two runs")
            seen.add(key)
            out.append(rec)
    return out


def _pred(rec: dict, sched: str) -> str:
    """The model's predicted ms of a timed schedule; '-' where it ranked none by that name (a
    depth named explicitly that is the rule's own, e.g. ulysses:g=2 where `ulysses` means it)."""
    ms = rec["commopt_predicted_ms"].get(sched)
    return "-" if ms is None else f"{ms:.3f}"


def _case_cell(r: dict) -> str:
    return (f"{r['B']} | {r['H']}/{r['H_kv']} | {r['D']} | {r['S_total']} | {'yes' if r['causal'] else 'no'} | "
            f"{r['pass']}")


def _row(r: dict) -> str:
    return (f"B{r['B']} H{r['H']}/{r['H_kv']} D{r['D']} S{r['S_total']} {'causal' if r['causal'] else 'full'} "
            f"{r['pass']}: single {_f(r['single_gpu_full_ms'])} | torch CP ag {_f(r['torch_cp_allgather_ms'])} "
            f"a2a {_f(r['torch_cp_alltoall_ms'])} | commopt {_f(r['commopt_ms'])} ({r['commopt_schedule']}) | "
            f"eff {_f(r['efficiency'], 2)} speedup {_f(r['speedup_vs_torch_cp'])} | best {r['best_schedule']}")


def report(records: list[dict], meta: dict) -> str:
    lines = [f"# Context-parallel attention on {meta['device']} x{meta['world']} ({meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, {meta['dtype']}.", "",
             f"Command: `{meta['command']}`; ring transfers: {meta.get('ring_transport', 'nccl')}; Ulysses "
             f"all-to-alls: {meta.get('a2a_transport', 'nccl')}.", ""]
    if meta["device"].startswith("CPU"):
        lines += ["CPU smoke run (gloo): the figures mean nothing. torch CP's ring dispatches only the CUDA SDPA "
                  "kernels; what runs here (if anything) is DTensor's generic SDPA sharding, not its ring.", ""]
    lines += ["| B | H/H_kv | D | S_total | causal | pass | single GPU full | torch CP allgather | torch CP alltoall "
             "| commopt | schedule | efficiency | speedup vs torch CP | best schedule (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        flag = "" if r["numerics_ok"][r["commopt_schedule"]] else " (NUMERICS FAILED)"
        lines.append(f"| {_case_cell(r)} | {_f(r['single_gpu_full_ms'])} | {_f(r['torch_cp_allgather_ms'])} | "
                     f"{_f(r['torch_cp_alltoall_ms'])} | {_f(r['commopt_ms'])} | {r['commopt_schedule']}{flag} | "
                     f"{_f(r['efficiency'], 2)} | {_f(r['speedup_vs_torch_cp'])} | "
                     f"{r['best_schedule']} ({_f(r['best_schedule_ms'])}) |")
    lead = meta.get("lead_calls", 0)
    after = (f"; each sample's timed calls follow {lead} untimed one{'s' if lead > 1 else ''} queued right before "
             "them, so its window opens on a busy device" if lead else
             "; no lead: each sample's window opens on an idle device, its first call carrying the ranks' exit "
             "skew and its host's enqueue")
    lines += ["", f"Times in ms per call (back-to-back calls{after}, median of rounds in rotated order, slowest rank). "
              "Single GPU full: every rank computes the whole-sequence attention on its own device at the same "
              "time. efficiency = single / (W x commopt); speedup = faster torch CP / commopt. commopt's pick "
              "is attention.cost.rank_schedules' first with the figures the compiled path uses "
              f"({records[0]['commopt_pick_by'].split(' with ', 1)[-1] if records else '-'}); "
              "its time is that schedule's. '-': not measured (reason below).", "",
              "## Every commopt schedule (ms; max relative error vs single-device full attention over out, "
              "dq, dk, dv; predicted ms)", ""]
    for r in records:
        cells = ", ".join(f"`{s}` {t:.3f} ({max(r['schedule_errors'][s].values()):.1e}"
                          f"{'' if r['numerics_ok'][s] else ' FAILED'}; pred {_pred(r, s)})"
                          for s, t in r["schedules_ms"].items())
        lines.append(f"- {_row_key(r)}: {cells}")
    zz = [r for r in records if r.get("commopt_zigzag_layout_ms")]
    if zz:
        lines += ["", "## ring_zigzag on zigzag-sharded inputs (torch CP's head-tail layout: no relayouts)", "",
                  "| B | H/H_kv | D | S_total | causal | pass | ms | efficiency | vs faster torch CP | max error |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in zz:
            t = r["commopt_zigzag_layout_ms"]
            cp = [x for x in (r["torch_cp_allgather_ms"], r["torch_cp_alltoall_ms"]) if x is not None]
            err = max(r["zigzag_layout_errors"].values())
            lines.append(f"| {_case_cell(r)} | {_f(t)} | {_f(r['efficiency_zigzag_layout'], 2)} | "
                         f"{_f(min(cp) / t) if cp else '-'} | {err:.1e}"
                         f"{'' if r['zigzag_layout_numerics_ok'] else ' FAILED'} |")
    lines += ["", "## torch CP (per rotate method: layout, GQA, error vs full attention, or why not run)", ""]
    for r in records:
        cells = []
        for m, p in r["torch_cp"].items():
            what = (f"{p['layout']}{', ' + p['gqa'] if p['gqa'] else ''}, err "
                    f"{max(p['errors'].values()):.1e}" if p["errors"] else f"not run: {p['reason']}")
            cells.append(f"{m}: {what}")
        lines.append(f"- {_row_key(r)}: " + "; ".join(cells))
    lines += ["", "## Spread (fastest..slowest round, ms)", ""]
    for r in records:
        lines.append(f"- {_row_key(r)}: " + ", ".join(f"{k} {lo:.3f}..{hi:.3f}"
                                                     for k, (lo, hi) in r["round_range_ms"].items()))
    return "\n".join(lines) + "\n"


def _row_key(r: dict) -> str:
    return (f"B{r['B']} H{r['H']}/{r['H_kv']} D{r['D']} S{r['S_total']} {'causal' if r['causal'] else 'full'} "
            f"{r['pass']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="partial.jsonl or finished-run JSON files")
    parser.add_argument("--meta-from", required=True, help="a finished run's JSON: its machine fields")
    parser.add_argument("--command", action="append", required=True, help="each run's command line")
    parser.add_argument("--note", default="", help="why the records come from several runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--stem", required=True, help="result file name without extension")
    args = parser.parse_args(argv)

    meta = {k: v for k, v in json.loads(pathlib.Path(args.meta_from).read_text()).items() if k != "records"}
    records = merge([load_records(pathlib.Path(s)) for s in args.sources])
    worlds = {r["world"] for r in records}
    if worlds != {meta["world"]}:
        raise ValueError(f"records at worlds {sorted(worlds)}, machine fields at world {meta['world']}")
    meta["command"] = " ; ".join(args.command)
    meta["runs"] = args.command
    meta["note"] = args.note
    text = report(records, meta)
    if args.note:
        head, rest = text.split("\n\n", 1)
        text = f"{head}\n\n{args.note}\n\n{rest}"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps({**meta, "records": records}, indent=1))
    (out / f"{args.stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
