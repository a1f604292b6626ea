"""Inductor's joint-graph pass (joint_custom_post_pass) for commopt: the rewrites that need
the forward and the backward in one graph.

  1. context-parallel attention in training (passes/attention/joint.py, pattern "attention");
  2. which forward all-gathers are gathered again in backward instead of saved
     (passes/matmul/regather.py: Config.regather_for_backward, or a choice under
     Config.saved_gather_budget_mib).

Its notes go to the log and to the report of the next graph the post-grad pass sees.
"""

from __future__ import annotations

import logging

from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from torch_commopt.passes.matmul.regather import choose_regather, mark_regather

log = logging.getLogger("torch_commopt.passes.joint")

class JointPass(CustomGraphPass):
    """Inductor's joint_custom_post_pass (a CustomGraphPass: `uuid` keys Inductor's caches):
    the two jobs of the module docstring, in that order."""

    def __init__(self, config):
        self.config = config

    def __call__(self, graph: Graph) -> None:
        notes = []
        if "attention" in self.config.patterns:
            from torch_commopt.passes.attention.joint import rewrite_joint_attention

            try:
                timeout = self.config.consistency_timeout_s if self.config.check_rank_consistency else None
                notes += rewrite_joint_attention(graph, self.config.attention_schedule, timeout, self.config.cache_dir,
                                                 mode=self.config.mode, top_k=self.config.autotune_top_k,
                                                 tune_timeout_s=self.config.consistency_timeout_s,
                                                 keep_gathered=_keeps_gathered(self.config))
            except Exception as e:  # noqa: BLE001 - the joint graph is left as far as it got: each
                # region is edited only after it matched, so a failure leaves whole regions
                log.exception("commopt: attention rewrite of the joint graph stopped")
                notes.append(f"attention rewrite (joint graph) stopped ({type(e).__name__}: {e})")
        try:
            notes += self._regather(graph)
        except Exception as e:  # noqa: BLE001 - marks only: what is marked recomputes, the rest is saved
            log.exception("commopt: re-gather marking of the joint graph stopped")
            notes.append(f"re-gather for backward stopped ({type(e).__name__}: {e})")
        for note in notes:
            log.info("commopt joint graph: %s", note)
        PENDING_NOTES.extend(notes)

    def _regather(self, graph: Graph) -> list[str]:
        if self.config.regather_for_backward:
            return mark_regather(graph)
        if self.config.saved_gather_budget_mib is None:
            return []
        timeout = self.config.consistency_timeout_s
        chosen, note = choose_regather(graph, self.config.saved_gather_budget_mib, self.config.cache_dir, timeout)
        return [note] + (mark_regather(graph, chosen) if chosen else [])

    def uuid(self) -> str:
        import pathlib

        from torch._inductor.custom_graph_pass import get_hash_for_files

        files = tuple(sorted(str(p) for p in pathlib.Path(__file__).parents[1].rglob("*.py")))
        return get_hash_for_files(files, self.config.to_json()).hex()


# notes of the joint-graph pass, picked up by the report of the next graph the post-grad pass sees
PENDING_NOTES: list[str] = []


def _keeps_gathered(config) -> bool:
    """Whether flex attention's all-gather keeps its gathered K/V for the backward, as the program's
    own gather does: not where the backward is asked to gather again (regather_for_backward), nor
    under a saved-gather budget, which counts the matmul gathers only."""
    return not config.regather_for_backward and config.saved_gather_budget_mib is None
