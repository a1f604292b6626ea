"""Programs compiled with dynamic row counts, run on live gloo groups (importable by spawned
workers): one compiled graph serves every size, each size compared with eager and float64."""

from __future__ import annotations

import dist_programs
import torch

import torch_commopt
from torch_commopt.testing.validate import rel_err


def _graphs_and_schedules() -> tuple[int, list[str]]:
    """(forward/inference graphs compiled, the schedules of their rewritten regions)."""
    graphs = [g for g in torch_commopt.explain().graphs if g.graph_kind != "backward"]
    return len(graphs), [r.schedule for g in torch_commopt.explain().graphs for r in g.rewritten]


# (program, which input dim varies, the sizes of that dim): rows only -- K and N stay fixed
FUNCOL = {
    "ag_dim0_2d": (0, 0, (12, 5, 20)),
    "ag_dim1_3d": (0, 1, (6, 3, 9)),
    "ag_qkv": (0, 0, (6, 7, 2)),
    "rs_dim0_2d": (0, 0, None),  # multiples of the world (a reduce-scatter's dim splits evenly)
    "rs_dim1_3d": (0, 1, None),
    "ar_2d": (0, 0, (10, 3, 17)),
    "ar_3d": (0, 1, (5, 2, 11)),
    "rs_then_ag": (0, 0, None),
}


def run_funcol(rank: int, world: int, options: dict, seed: int = 0) -> list:
    """Per program: (name, graphs compiled, schedules, [(size, [(compiled err, eager err)])])."""
    programs = dist_programs.funcol_programs(world)
    out = []
    for i, (name, (arg, dim, sizes)) in enumerate(FUNCOL.items()):
        fn, shapes, _ = programs[name]
        sizes = sizes or (4 * world, 2 * world, 7 * world)
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        compiled = torch.compile(fn, backend="commopt", options=options)
        per_size = []
        for size in sizes:
            shapes_now = [list(s) for s in shapes]
            shapes_now[arg][dim] = size
            inputs = [dist_programs._inputs(shapes_now, rank, seed + i, dt) for dt in (torch.float64, torch.float32)]
            x = inputs[1][arg].clone()
            torch._dynamo.mark_dynamic(x, dim)
            got = dist_programs._flat(compiled(*[x if j == arg else t for j, t in enumerate(inputs[1])]))
            ref, eager = (dist_programs._flat(fn(*ins)) for ins in inputs)
            per_size.append((size, [(rel_err(c, r), rel_err(e, r)) for c, e, r in zip(got, eager, ref)]))
        out.append((name, *_graphs_and_schedules(), per_size))
    return out


def run_block(rank: int, world: int, options: dict, kind: str, seqs: tuple[int, ...], dynamic: bool | None) -> tuple:
    """validate.check_sizes of `kind` (small float32 sizes): (graphs compiled, schedules,
    [(seq, [(name, compiled err, eager err)])], explain's notes)."""
    from torch_commopt.testing.validate import check_sizes

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    per_seq = check_sizes(kind, options, seqs, dynamic=dynamic, shape={"batch": 2, "dim": 32, "hidden": 64, "heads": 4})
    notes = [n for g in torch_commopt.explain().graphs for n in g.notes]
    return (*_graphs_and_schedules(), [(s, [(e.name, e.compiled, e.eager) for e in errs]) for s, errs in per_seq], notes)
