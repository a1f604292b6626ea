"""Context-parallel attention (issue 6): the building blocks the attention region rewrites to.

    local.py      attention of a query block against one K/V block -> (out, lse), and its
                  backward given the global out/lse; math (reference, CPU default) and fused
                  backends (fused.py: aten flash / cuDNN / efficient, flash-attn) by device/dtype
    merge.py      merging partial (out, lse) in fp32
    spec.py       schedule names ("allgather", "ring", "ring_zigzag", "ulysses", "hybrid:U:R")
                  and `refusal` (why a schedule cannot take a shape)
    comm.py       ring shift, packed all-to-all, relayouts, sub-groups
    ring.py       the ring step loop (forward, backward), contiguous and zigzag block plans
    schedules.py  cp_attention_fwd / cp_attention_bwd over a process group
    ops.py        torch.ops.commopt.cp_attention_fwd / _bwd and the autograd wrapper cp_attention
    cost.py       alpha-beta + launch + FLOP estimates per schedule, candidates and their ranking
                  (pure arithmetic)
    detect.py     find context-parallel attention in an FX graph (K/V all-gathered into SDPA with
                  Q local; all-to-all -> SDPA -> all-to-all); analysis only, not imported here

Importing registers the two ops; it touches neither CUDA nor a process group.
"""

from torch_commopt.attention.cost import CPMachine, candidates, estimate_ms, rank_schedules
from torch_commopt.attention.local import attend_bwd, attend_fwd
from torch_commopt.attention.merge import merge, merge_
from torch_commopt.attention.ops import CPAttention, cp_attention
from torch_commopt.attention.schedules import cp_attention_bwd, cp_attention_fwd
from torch_commopt.attention.spec import AttentionShape, CPSchedule, refusal

__all__ = ["AttentionShape", "CPAttention", "CPMachine", "CPSchedule", "attend_bwd", "attend_fwd", "candidates",
           "cp_attention", "cp_attention_bwd", "cp_attention_fwd", "estimate_ms", "merge", "merge_", "rank_schedules",
           "refusal"]
