"""Numerics of compiled-with-commopt against eager, forward and backward, on a live process group.

Each check runs the same program three times from the same initial weights and inputs:
eager in float64 (the reference), eager in float32, and compiled with commopt in
float32.  A tensor passes when the compiled error is within `factor` times eager's own
error against the reference: the tolerance is set by the reference's own error, not
by a constant picked to pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_commopt.testing.models import FuncolMLP, LlamaBlock, MLPBlock, tp_plan, tp_sp_plan

MODELS = ("funcol_mlp", "tp_sp_mlp", "tp_sp_block", "tp_block")
BLOCKS = ("tp_sp_block", "tp_block")  # the kinds with attention (a LlamaBlock)
TOLERANCE_FACTOR = 4.0  # commopt's error may be this many times eager float32's own error
ERROR_FLOOR = float(torch.finfo(torch.float32).eps)  # below this, errors are rounding noise
# eager's own error above this: the float64 run is not the same computation (different weights or
# inputs), so "as close as eager" would prove nothing -- the check fails instead
EAGER_ERROR_CAP = 0.1


def within_tolerance(compiled: float, eager: float, factor: float = TOLERANCE_FACTOR) -> bool:
    """The numerics rule of the demo and the tests (factor: a looser bound a test states why it needs)."""
    return eager <= EAGER_ERROR_CAP and compiled <= factor * max(eager, ERROR_FLOOR)


@dataclass
class TensorError:
    name: str
    compiled: float
    eager: float

    def ok(self) -> bool:
        return within_tolerance(self.compiled, self.eager)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build(kind: str, dtype: torch.dtype, seed: int, shape: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (parallelized over the default group) and this rank's input shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    b, s, d, h = shape["batch"], shape["seq"], shape["dim"], shape["hidden"]
    check_shape(kind, shape, world)
    x = torch.randn(b, s, d, generator=gen, dtype=torch.float64)
    if kind == "funcol_mlp":
        model = FuncolMLP(d, h // world, dist.group.WORLD.group_name)
        wgen = torch.Generator().manual_seed(seed + 1)  # the weights do not depend on the input's size
        w1, w2 = torch.randn(d, h, generator=wgen) / d**0.5, torch.randn(h, d, generator=wgen) / h**0.5
        with torch.no_grad():
            model.w1.copy_(w1.chunk(world, dim=1)[rank])
            model.w2.copy_(w2.chunk(world, dim=0)[rank])
        x_local = x.reshape(b * s, d).chunk(world, dim=0)[rank]
        return model.to(dtype), x_local.to(dtype)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = (LlamaBlock(d, shape["heads"], h, n_kv_heads=shape.get("kv_heads")) if kind in BLOCKS
             else MLPBlock(d, h)).to(dtype)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    if kind == "tp_block":  # no sequence parallelism: every rank takes the whole input
        parallelize_module(model.to(device), mesh, tp_plan(model))
        return model, x.to(dtype)
    parallelize_module(model.to(device), mesh, tp_sp_plan(model))
    return model, x.chunk(world, dim=1)[rank].to(dtype)


def check_shape(kind: str, shape: dict, world: int) -> None:
    """Raise ValueError unless the sizes `build` shards over `world` ranks split evenly (a clear
    error instead of a size mismatch inside the ranks)."""
    splits = [("hidden", shape["hidden"], world, "ranks")]
    if kind == "funcol_mlp":
        splits.append(("batch x seq", shape["batch"] * shape["seq"], world, "ranks"))
    elif kind != "tp_block":  # sequence parallel: the sequence is sharded
        splits.append(("seq", shape["seq"], world, "ranks"))
    if kind in BLOCKS:
        splits += [("heads", shape["heads"], world, "ranks"), ("dim", shape["dim"], shape["heads"], "heads"),
                   ("kv heads", shape.get("kv_heads") or shape["heads"], world, "ranks")]
    bad = [f"{name} {n} over {by} {what}" for name, n, by, what in splits if n % by]
    if bad:
        raise ValueError(f"commopt validate: {kind}: sizes that do not split evenly: {', '.join(bad)}")


def run_once(fn: Callable, model: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward + backward of fn (model itself or its compiled form); returns the output,
    the input grad and every parameter grad of `model`."""
    x = x.clone().requires_grad_(True)
    out = fn(x)
    (out * probe.to(out.dtype)).sum().backward()
    result = {"out": out.detach(), "grad_x": x.grad}
    result.update({f"grad_{n}": _full(p.grad) for n, p in model.named_parameters()})
    return result


def check(kind: str, options: dict[str, Any], *, seed: int = 0, shape: dict | None = None,
          compile_fn: Callable | None = None, dtype: torch.dtype = torch.float32) -> list[TensorError]:
    """Errors of every output and gradient of `kind`, compiled with commopt `options`;
    eager and compiled run in `dtype`, the reference in float64."""
    shape = shape or {"batch": 2, "seq": 16, "dim": 64, "hidden": 128, "heads": 4}
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    probe = None
    runs = {}
    for label, run_dtype in (("ref", torch.float64), ("eager", dtype), ("compiled", dtype)):
        model, x = build(kind, run_dtype, seed, shape)
        model, x = model.to(device), x.to(device)
        if probe is None:
            gen = torch.Generator().manual_seed(seed + 1)
            probe = torch.randn(model(x).shape, generator=gen, dtype=torch.float64).to(device)
        fn = model
        if label == "compiled":
            fn = (compile_fn or torch.compile)(model, backend="commopt", options=options)
        runs[label] = run_once(fn, model, x, probe)
    return _errors(runs)


def _errors(runs: dict[str, dict]) -> list[TensorError]:
    """Per tensor: compiled's and eager's relative error against the float64 run ("ref")."""
    return [TensorError(k, rel_err(runs["compiled"][k], v), rel_err(runs["eager"][k], v))
            for k, v in runs["ref"].items()]


def check_sizes(kind: str, options: dict[str, Any], seqs: tuple[int, ...], *, dynamic: bool | None = True,
                shape: dict | None = None, dtype: torch.dtype = torch.float32) -> list[tuple[int, list[TensorError]]]:
    """check() for one compiled model called with each global sequence length in `seqs`
    (torch.compile's `dynamic`: True compiles one graph with symbolic sizes at the first call;
    None lets torch recompile with them at the first new size).  Every length is compared with
    eager and float64 runs of the same weights; gradients are cleared between runs."""
    shape = dict(shape or {"batch": 2, "dim": 64, "hidden": 128, "heads": 4}, seq=seqs[0])
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    model, _ = build(kind, dtype, 0, shape)
    model = model.to(device)
    compiled = torch.compile(model, backend="commopt", options=options, dynamic=dynamic)
    out = []
    for seq in seqs:
        ref_model, x64 = build(kind, torch.float64, 0, dict(shape, seq=seq))
        ref_model, x64 = ref_model.to(device), x64.to(device)
        gen = torch.Generator().manual_seed(seq)
        probe = torch.randn(x64.shape[:-1] + (shape["dim"],), generator=gen, dtype=torch.float64).to(device)
        runs = {}
        for label, fn, m, x in (("ref", ref_model, ref_model, x64), ("eager", model, model, x64.to(dtype)),
                                ("compiled", compiled, model, x64.to(dtype))):
            m.zero_grad(set_to_none=True)
            runs[label] = run_once(fn, m, x, probe)
        out.append((seq, _errors(runs)))
    return out
