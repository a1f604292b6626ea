"""torch's context parallelism as bench_attention runs it (the baseline): one context per
variant with fresh buffers, and checks that leaving the context restored what it patched, so
that no later timing runs through it.  Also the leaves / grads helpers the variants share."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from benchmarks.bench_attention import Case

log = logging.getLogger("torch_commopt.bench_attention")
_ORIGINAL_SDPA = F.scaled_dot_product_attention


def fresh_leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def last_grads(leaves: list[torch.Tensor], kv_heads: int = 0) -> dict[str, torch.Tensor]:
    """dq, dk, dv of the last backward; kv_heads: fold K/V grads that were expanded to H heads
    back to kv_heads (sum over each group of H / kv_heads query heads)."""
    dq, dk, dv = (t.grad for t in leaves)
    if kv_heads and dk.shape[1] != kv_heads:
        b, h, s, d = dk.shape
        dk, dv = (g.view(b, kv_heads, h // kv_heads, s, d).sum(2) for g in (dk, dv))
    return {"dq": dq, "dk": dk, "dv": dv}


def reset_grads(leaves: list[torch.Tensor]) -> None:
    for t in leaves:
        t.grad = None


@dataclass
class TorchCP:
    """How torch CP runs a case: the rotate method, whether load balancing is on (its default)
    and whether K/V are expanded to H heads (GQA fallback)."""

    method: str
    load_balance: bool = True
    expand_kv: bool = False

    def layout(self, case: Case, world: int) -> str:
        # context_parallel's default balancer exists only when S % 2W == 0 (_load_balancer.py)
        return "head_tail" if self.load_balance and case.seq % (2 * world) == 0 else "contiguous"


def _cp_state() -> tuple:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._attention import _cp_options

    return (_cp_options.enable_load_balance, frozenset(DTensor._op_dispatcher._custom_op_handlers))


class TorchCPLeak(RuntimeError):
    """A torch CP context left global state patched: every later timing would be wrong."""


def _repair_torch_cp(handlers: dict) -> None:
    """Put back what a torch CP context had patched.  Its exit after an error raised inside it
    (e.g. load balancing refusing a non-causal call, torch 2.11) leaves
    F.scaled_dot_product_attention wrapped; check_torch_cp_restored runs after this."""
    from torch.distributed.tensor import DTensor

    if F.scaled_dot_product_attention is not _ORIGINAL_SDPA:
        log.info("torch CP: its context exit after an error left SDPA wrapped; restored")
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
    live = DTensor._op_dispatcher._custom_op_handlers
    if live != handlers:
        live.clear()
        live.update(handlers)


def check_torch_cp_restored(before: tuple) -> None:
    """Raise if a torch CP context left SDPA patched (or its dispatcher / options changed): later
    timings would silently run through it."""
    if F.scaled_dot_product_attention is not _ORIGINAL_SDPA:
        raise TorchCPLeak("torch CP context exit left F.scaled_dot_product_attention patched "
                           f"({F.scaled_dot_product_attention!r}); later timings would be contaminated")
    if _cp_state() != before:
        raise TorchCPLeak("torch CP context exit left _cp_options.enable_load_balance or DTensor's custom op "
                           "handlers changed; later timings would be contaminated")


@contextlib.contextmanager
def torch_cp(case: Case, full: dict, how: TorchCP, mesh, warm: bool = False):
    """One torch CP context with fresh full-size buffers (sharded in place by the context, never
    restored: all in no_restore_buffers); leaves requiring grad are made inside from the shards,
    since the context's exit cannot resize tensors that require grad.  warm: one call before
    yielding (a fresh context re-registers CP's DTensor handlers and sharding rules; whatever
    its first call pays for that stays out of the timed window)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    before, handlers, failed = _cp_state(), dict(DTensor._op_dispatcher._custom_op_handlers), False
    set_rotate_method(how.method)
    bufs = [full[n].clone() for n in ("q", "k", "v", "dout")]
    if how.expand_kv:
        rep = case.heads // case.kv_heads
        bufs[1], bufs[2] = (t.repeat_interleave(rep, dim=1) for t in bufs[1:3])
    kwargs = {"is_causal": case.causal, **({"enable_gqa": True} if bufs[1].shape[1] != case.heads else {})}
    old_lb = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = how.load_balance
    last = {}
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            q, k, v, dout = bufs  # now this rank's shards
            if not case.backward:
                def step():
                    with torch.no_grad():
                        last["out"] = F.scaled_dot_product_attention(q, k, v, **kwargs)
                if warm:
                    step()
                yield step, lambda: dict(last)
            else:
                leaves = fresh_leaves(q, k, v)

                def step():
                    reset_grads(leaves)
                    last["out"] = F.scaled_dot_product_attention(*leaves, **kwargs)
                    last["out"].backward(dout)
                if warm:
                    step()
                yield step, lambda: {"out": last["out"].detach(), **last_grads(leaves, case.kv_heads)}
    except BaseException:
        failed = True
        raise
    finally:
        _cp_options.enable_load_balance = old_lb
        if failed:
            _repair_torch_cp(handlers)
        check_torch_cp_restored(before)
