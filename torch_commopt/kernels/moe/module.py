"""Expert parallelism on modules: a GroupedExperts-like module whose tokens go through
`expert_parallel` with a chosen schedule.

A *GroupedExperts-like* module has 3-D weights w1 (E, H, D), w2 (E, D, H), w3 (E, H, D) (a SwiGLU
per expert, stored out x in as nn.Linear stores them) and forward(routed_input (T, D),
num_tokens_per_expert (E,)) over tokens sorted by expert: torchtitan's GroupedExperts.  Under
expert parallelism its weights are DTensors sharded on dim 0 over the EP mesh, and torchtitan's
ExpertParallel moves the tokens in a forward pre-hook (dispatch) and a forward hook (combine)
registered by torch's distribute_module.

`install` replaces such a module's forward: the tokens go through `expert_parallel` and the local
experts run in between (`run_local(rows, per_expert)`: by default the SwiGLU per expert; for a
torchtitan module its own forward, which runs its grouped GEMM or its per-expert loop over the local
weights, its groups padded on a GPU as the grouped GEMM needs).  `swap_expert_parallel` finds the modules torchtitan's
ExpertParallel hooked, removes its two hooks and installs ours on the same EP group.  The new
forward is not compiled (torch.compiler.disable): the exchange's sizes are data, as torchtitan
leaves its own dispatch uncompiled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_commopt import report
from torch_commopt.core.moe_spec import parse_moe_schedule
from torch_commopt.kernels.moe import sync_free
from torch_commopt.kernels.moe.exchange import counts_on, gather_rows, host_counts, inverse_of, post_counts, ranges
from torch_commopt.kernels.moe.schedules import expert_parallel

log = logging.getLogger("torch_commopt.kernels.moe.module")

Local = Callable[[Tensor, Tensor], Tensor]  # (expert-major rows, rows per local expert) -> outputs
ALIGN = 8  # rows per group the CUDA grouped GEMM takes (bf16; torchtitan's TOKEN_GROUP_ALIGN_SIZE_M)


def swiglu_per_expert(w1: Tensor, w2: Tensor, w3: Tensor, rows: Tensor, per_expert: Tensor) -> Tensor:
    """Each local expert's SwiGLU over its run of rows (expert-major), in the rows' dtype."""
    pieces = torch.split(rows, host_counts(per_expert))
    outs = [(F.silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T for e, x in enumerate(pieces)]
    return torch.cat(outs) if outs else rows.new_zeros((0, w2.shape[1]))


def _local(w: Tensor) -> Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether `module` has the GroupedExperts weights (3-D w1, w2, w3 with matching E, H, D)."""
    ws = [getattr(module, name, None) for name in ("w1", "w2", "w3")]
    if not all(isinstance(w, Tensor) and w.dim() == 3 for w in ws):
        return False
    (e1, h1, d1), (e2, d2, h2), (e3, h3, d3) = (tuple(w.shape) for w in ws)
    return e1 == e2 == e3 and h1 == h2 == h3 and d1 == d2 == d3


def padded(run: Local, align: int = ALIGN) -> Local:
    """`run` over groups padded with zero rows to a multiple of `align` rows, at least `align` (the
    CUDA grouped GEMM takes no empty group), the padding's outputs dropped."""
    def call(rows: Tensor, per_expert: Tensor) -> Tensor:
        counts = host_counts(per_expert)
        sizes = [max(align, -(-c // align) * align) for c in counts]
        starts = [sum(sizes[:e]) for e in range(len(sizes))]
        at = ranges(list(zip(starts, counts)), rows.device)  # each real row's place among the padded
        taken = inverse_of(at, sum(sizes))  # each padded row's real row, or none (a zero row)
        out = run(gather_rows(rows, taken, inverse=at), counts_on(sizes, per_expert.device, per_expert.dtype))
        return gather_rows(out, at, inverse=taken)
    return call


class PaddedLocal:
    """A Local whose grouped GEMM takes groups padded to `align` rows (at least `align`): called as
    a Local it pads its input itself (`padded`) where `pads(device)`; a schedule that places the
    received rows into padded groups directly (schedules._a2a) calls `unpadded` instead, sparing
    two copies of every row.  `on_cpu`: pad on the CPU too (torch's CPU grouped GEMM takes any
    groups; the tests use it to check the schedules' own padding)."""

    def __init__(self, run: Local, align: int = ALIGN, on_cpu: bool = False) -> None:
        self.unpadded, self.align, self.on_cpu = run, align, on_cpu
        self._padded = padded(run, align)

    def pads(self, device: torch.device) -> bool:
        return device.type != "cpu" or self.on_cpu

    def __call__(self, rows: Tensor, per_expert: Tensor) -> Tensor:
        return self._padded(rows, per_expert) if self.pads(rows.device) else self.unpadded(rows, per_expert)


Choose = Callable[..., str]  # (routing, x, weights, group) -> a schedule (tuner/moe/choose.py)
_told_capture: list[bool] = []


def _capture_once() -> None:
    """Log, once a process, that a CUDA-graph capture runs the exchange as sync_free."""
    if not _told_capture:
        _told_capture.append(True)
        log.info("commopt moe: inside a CUDA-graph capture the token exchange runs as sync_free (every other "
                 "schedule reads the counts on the host), its capacity the most rows the eager calls routed")


class ExpertParallelForward:
    """The forward `install` puts on a module: its tokens through `expert_parallel`.  With schedule
    "auto", `choose` picks each call's schedule from its Routing (the same on every rank)."""

    def __init__(self, group, schedule: str, run_local: Local, module: nn.Module, choose: Choose | None = None):
        self.group, self.schedule, self.run_local, self.module, self.choose = group, schedule, run_local, module, choose
        self.last: str | None = None  # the schedule of the latest call (for inspection)
        # work to queue while the counts travel (EarlyShared.run): the GPU runs it while the host
        # waits for the counts and plans the exchange, where it would idle
        self.early: Callable[[], None] | None = None

    @torch.compiler.disable
    def __call__(self, routed_input: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        m = self.module
        weights = (_local(m.w1), _local(m.w2), _local(m.w3))
        # a module on the grouped GEMM computes its experts in bf16 (torchtitan's _run_experts_grouped_mm)
        dtype = torch.bfloat16 if getattr(m, "use_grouped_mm", False) else None
        if self.schedule == "sync_free" or sync_free.capturing(routed_input.device):
            # no counts' host read to fill: the early work just runs first
            if self.schedule != "sync_free":
                _capture_once()
            if self.early is not None:
                self.early()
            self.last = "sync_free"
            return expert_parallel(routed_input, num_tokens_per_expert, self.run_local, self.group, "sync_free",
                                   weights=weights, compute_dtype=dtype)
        pending = post_counts(num_tokens_per_expert, self.group)
        if self.early is not None:
            self.early()
        routing, schedule = pending.routing(), self.schedule
        sync_free.note_peak(self.group, routing.peak)  # sizes a later capture's exchange
        if schedule == "auto":
            schedule = self.choose(routing, routed_input, weights, self.group)
        self.last = schedule
        return expert_parallel(routed_input, num_tokens_per_expert, self.run_local, self.group, schedule,
                               routing=routing, weights=weights if schedule.startswith("by_expert") else None,
                               compute_dtype=dtype)


def install(module: nn.Module, group, schedule: str, run_local: Local | None = None,
            choose: Choose | None = None) -> None:
    """Make `module` (GroupedExperts-like, its weights this rank's experts or DTensors sharded on
    dim 0 over `group`) exchange its tokens over `group` with `schedule` ("auto": `choose` picks
    per call; torch_commopt.optimize passes the tuner's)."""
    try:
        parse_moe_schedule(schedule)
    except ValueError as e:
        raise ValueError(f"commopt moe: {e}") from e
    if schedule == "auto" and choose is None:
        raise ValueError("commopt moe: schedule 'auto' needs a chooser (torch_commopt.tuner.moe.choose.chooser; "
                         "torch_commopt.optimize and the torchtitan recipe pass it)")
    if not is_grouped_experts(module):
        raise TypeError(f"commopt moe: {type(module).__name__} has no GroupedExperts weights (3-D w1, w2, w3)")
    if run_local is None:
        def run_local(rows: Tensor, per_expert: Tensor) -> Tensor:
            return swiglu_per_expert(_local(module.w1), _local(module.w2), _local(module.w3), rows, per_expert)
    module.forward = ExpertParallelForward(group, schedule, run_local, module, choose)
    module._commopt_moe_schedule = schedule  # noqa: SLF001  (for inspection)


def _closure(fn) -> list:
    return [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ())]


def _hooked_by(fn, name: str):
    """(the style object, the mesh) when hook `fn` is distribute_module's wrapper of a bound
    method called `name` (torchtitan's ExpertParallel._token_dispatch / _token_combine)."""
    cells = _closure(fn)
    methods = [c for c in cells if getattr(c, "__name__", None) == name and hasattr(c, "__self__")]
    meshes = [c for c in cells if hasattr(c, "get_group") and hasattr(c, "mesh")]
    return (methods[0].__self__, meshes[0]) if methods and meshes else None


def torchtitan_ep_hooks(module: nn.Module):
    """(pre-hook id, hook id, mesh) of torchtitan's ExpertParallel on `module`, or None."""
    pre = [(i, _hooked_by(h, "_token_dispatch")) for i, h in module._forward_pre_hooks.items()]  # noqa: SLF001
    post = [(i, _hooked_by(h, "_token_combine")) for i, h in module._forward_hooks.items()]  # noqa: SLF001
    pre, post = [p for p in pre if p[1]], [p for p in post if p[1]]
    if len(pre) != 1 or len(post) != 1 or pre[0][1][0] is not post[0][1][0]:
        return None
    return pre[0][0], post[0][0], pre[0][1][1]


def swap_expert_parallel(root: nn.Module, schedule: str, choose: Choose | None = None) -> list[str]:
    """In `root`, every GroupedExperts-like module that torchtitan's ExpertParallel parallelized
    exchanges its tokens with `schedule` instead: its two hooks removed, `install` on the same EP
    group (torchtitan's grouped GEMM kept as the local experts when the module uses it).  The
    names of the modules swapped."""
    swapped = []
    for name, module in root.named_modules():
        found = torchtitan_ep_hooks(module)
        if found is None or not is_grouped_experts(module):
            continue
        pre, post, mesh = found
        if mesh.ndim != 1:
            log.warning("commopt moe: %s's expert parallelism runs over a %d-D mesh; left to torchtitan", name, mesh.ndim)
            continue
        del module._forward_pre_hooks[pre]  # noqa: SLF001
        del module._forward_hooks[post]  # noqa: SLF001
        install(module, mesh.get_group(), schedule, torchtitan_local(module), choose)
        parent = _parent_with_shared(root, module)
        if parent is not None:
            module.forward.early = EarlyShared(parent).run
            log.info("commopt moe: %s's shared experts run while its routed tokens' counts travel", name)
        swapped.append(name)
        report.record_module(report.ModuleReport(name, "moe", f"token exchange {schedule} over {mesh.size()} ranks "
                                                               f"(was torchtitan's ExpertParallel)"))
    if swapped:
        log.info("commopt moe: expert parallelism of %s runs schedule %s", ", ".join(swapped), schedule)
    return swapped


def torchtitan_local(module: nn.Module) -> Local:
    """The module's own forward over the local experts' rows (its class's, not the hooked call):
    its grouped GEMM or its per-expert loop, on the local shards of its weights.  On a GPU its
    grouped GEMM gets groups padded to ALIGN rows: under an "ep" mesh torchtitan expects its
    dispatch to have padded them."""
    forward = type(module).forward

    def local(rows: Tensor, per_expert: Tensor) -> Tensor:
        return forward(module, rows, per_expert)

    if getattr(module, "use_grouped_mm", False):
        return PaddedLocal(local)  # torch's CPU kernel takes any groups: padded on GPUs only
    return local


def _parent_with_shared(root: nn.Module, experts: nn.Module) -> nn.Module | None:
    """The module whose `experts` is `experts` and which has shared experts (torchtitan's MoE)."""
    for m in root.modules():
        if getattr(m, "experts", None) is experts and isinstance(getattr(m, "shared_experts", None), nn.Module):
            return m
    return None


class EarlyShared:
    """A torchtitan MoE's shared experts, run between the routed experts' counts exchange and its
    host read (ExpertParallelForward.early), where the GPU would otherwise idle while the host
    waits for the counts and plans the exchange.  torchtitan's MoE.forward calls its shared
    experts after its routed ones, on x.view(-1, dim); during each forward the MoE's
    `shared_experts` is a stand-in that returns the early output for that very tensor (same
    storage, shape and version), and calls the real module for anything else.  Nothing happens
    while the MoE's forward is being traced by a compiler (the stand-in would be traced)."""

    def __init__(self, parent: nn.Module):
        self.shared: nn.Module = parent.shared_experts
        self.x: Tensor | None = None
        self.out: Tensor | None = None
        self.key: tuple | None = None
        self.runs = 0  # early runs taken by the MoE's forward (for tests)
        parent.register_forward_pre_hook(self._enter)
        parent.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling() or not args or not isinstance(args[0], Tensor) or args[0].dim() < 2:
            return
        self.x, self.out = args[0], None
        module.shared_experts = _Deferred(self)

    def run(self) -> None:
        if self.x is None or self.out is not None:
            return
        x = self.x.reshape(-1, self.x.shape[-1])
        self.key = (x.data_ptr(), tuple(x.shape), x._version)  # noqa: SLF001
        self.out = self.shared(x)

    def take(self, x: Tensor) -> Tensor:
        if self.out is not None and self.key == (x.data_ptr(), tuple(x.shape), x._version):  # noqa: SLF001
            out, self.out = self.out, None
            self.runs += 1
            return out
        return self.shared(x)

    def _leave(self, module: nn.Module, args, output) -> None:
        if isinstance(module._modules.get("shared_experts"), _Deferred):  # noqa: SLF001
            module.shared_experts = self.shared
        self.x = self.out = None


class _Deferred(nn.Module):
    """The stand-in for a MoE's shared experts during its forward (EarlyShared)."""

    def __init__(self, early: EarlyShared):
        super().__init__()
        self.early = early  # not a Module: no child registered, no parameter listed

    def forward(self, x: Tensor) -> Tensor:
        return self.early.take(x)
