"""Render one bench_attention report from several runs' records: a run cut short (its
partial.jsonl) next to the run that finished its cases, on the same machine.

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="partial.jsonl or finished-run JSON files")
    parser.add_argument("--meta-from", required=True, help="a finished run's JSON: its machine fields")
    parser.add_argument("--command", action="append", required=True, help="each run's command line")
    parser.add_argument("--note", default="", help="why the records come from several runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--stem", required=True, help="result file name without extension")
    args = parser.parse_args(argv)

    from benchmarks.bench_attention import report

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
