"""Several compiled variants of one program kept alive side by side (bench_plan, bench_e2e).

Their modules share forward code objects, so every variant is a cache entry of the same code:
one `torch._dynamo.reset()` before they are built (a reset between them dropped the earlier
variants' entries, the timing loop recompiled them, and past Dynamo's recompile limit of 8
the later variants ran uncompiled, eagerly),
`allow_entries` raises the per-code-object limit above what they need and makes hitting it an
error, and `compile_counts` before and after the timing shows nothing compiled meanwhile.
"""

from __future__ import annotations

import torch


def allow_entries(entries: int) -> None:
    """Dynamo's per-code-object recompile limit raised to twice `entries`, and hitting it made
    an error instead of a silent eager fallback (where this torch has the option)."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 2 * entries)
    if "fail_on_recompile_limit_hit" in cfg._config:
        cfg.fail_on_recompile_limit_hit = True


def compile_counts() -> tuple[int, int]:
    """(frames Dynamo converted, graphs it compiled) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"], counters["stats"]["unique_graphs"]


def check_unchanged(before: tuple[int, int], what: str) -> None:
    """RuntimeError if Dynamo compiled anything since `before` (compile_counts())."""
    now = compile_counts()
    if now != before:
        raise RuntimeError(f"{what}: Dynamo compiled again while the variants were timed ({before} -> {now} "
                           "frames/graphs): some figures are not of the variants as compiled")
