"""Per-rank programs for the reference 2D GEMMs (kernels/mesh2d/reference.py): every rank makes
the same global float64 tensors from one seed, runs its blocks on an R x C DeviceMesh of gloo
ranks, and returns its blocks' largest errors against the unsharded products."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh


def _blocks(shape: tuple[int, int], rank: int):
    r, c = shape
    i, j = divmod(rank, c)

    def block(t: torch.Tensor) -> torch.Tensor:
        h, w = t.shape[0] // r, t.shape[1] // c
        return t[i * h:(i + 1) * h, j * w:(j + 1) * w].contiguous()
    return block


def run_gemms(rank: int, world: int, shape: tuple[int, int], slices: tuple[int, ...]) -> dict[str, float]:
    """{case: max abs error} for os / ls / rs in each slice count and by SUMMA, and the FC layer's
    forward and backward in every dataflow and its transposed form (two by SUMMA too)."""
    from torch_commopt.kernels.mesh2d.reference import fc_2d, gemm_2d, summa

    mesh = init_device_mesh("cpu", shape)
    rows, cols = mesh.get_group(0), mesh.get_group(1)
    block = _blocks(shape, rank)
    m = k = 16 * shape[0] * shape[1]
    n = m + 8 * shape[0] * shape[1]  # not square: a mixed-up dimension would not fit
    gen = torch.Generator().manual_seed(3)

    def rand(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)
    x, w, w_t, x_t = rand(m, k), rand(k, n), rand(n, k), rand(k, m)  # w_t: W stored [N, K]
    errors = {}
    for s in slices:
        errors[f"os S={s}"] = (gemm_2d("os", block(x), block(w), rows, cols, s) - block(x @ w)).abs().max().item()
        errors[f"ls S={s}"] = (gemm_2d("ls", block(x), block(w_t), rows, cols, s) - block(x @ w_t.T)).abs().max().item()
        errors[f"rs S={s}"] = (gemm_2d("rs", block(x_t), block(w), rows, cols, s) - block(x_t.T @ w)).abs().max().item()
    errors["summa os"] = (summa("os", block(x), block(w), rows, cols) - block(x @ w)).abs().max().item()
    errors["summa ls"] = (summa("ls", block(x), block(w_t), rows, cols) - block(x @ w_t.T)).abs().max().item()
    errors["summa rs"] = (summa("rs", block(x_t), block(w), rows, cols) - block(x_t.T @ w)).abs().max().item()
    # the FC layers in their stored forms (reference.FC_GEMMS): T tokens, I in, O out features,
    # three sizes, so that a mixed-up dimension does not fit
    rc = shape[0] * shape[1]
    t, i_f, o_f = 16 * rc, 32 * rc, 24 * rc
    stored = {("os", False): ((t, i_f), (i_f, o_f), lambda x, w: x @ w),
              ("ls", False): ((t, i_f), (o_f, i_f), lambda x, w: x @ w.T),
              ("rs", False): ((i_f, t), (i_f, o_f), lambda x, w: x.T @ w),
              ("os", True): ((i_f, t), (o_f, i_f), lambda x, w: w @ x),
              ("ls", True): ((i_f, t), (i_f, o_f), lambda x, w: w.T @ x),
              ("rs", True): ((t, i_f), (o_f, i_f), lambda x, w: w @ x.T)}
    layers = [(flow, tr, slices[-1]) for flow, tr in stored] + [("os", False, 0), ("rs", True, 0)]
    for flow, tr, slices_here in layers:
        x_shape, w_shape, product = stored[(flow, tr)]
        xg, wg = rand(*x_shape).requires_grad_(), rand(*w_shape).requires_grad_()
        want = product(xg, wg)
        dy = rand(*want.shape)
        want.backward(dy)
        xb, wb = block(xg.detach()).requires_grad_(), block(wg.detach()).requires_grad_()
        got = fc_2d(xb, wb, flow, rows, cols, slices_here, transposed=tr)
        got.backward(block(dy))
        tag = f"fc {flow}{'^T' if tr else ''}" + (" summa" if slices_here == 0 else "")
        errors[f"{tag} y"] = (got - block(want.detach())).abs().max().item()
        errors[f"{tag} dx"] = (xb.grad - block(xg.grad)).abs().max().item()
        errors[f"{tag} dw"] = (wb.grad - block(wg.grad)).abs().max().item()
    return errors


def run_gemms_staged(rank: int, world: int, shape: tuple[int, int], slices: tuple[int, ...]) -> dict[str, float]:
    """run_gemms with every all-gather and reduce-scatter of the reference kernels staged through
    host memory, as where ranks sharing one GPU run gloo on CUDA tensors (collectives.staged)."""
    from torch_commopt.kernels import collectives

    collectives.staged = lambda t, group: True
    return run_gemms(rank, world, shape, slices)


def run_axis_schedules(rank: int, world: int, shape: tuple[int, int], schedules: tuple[str, ...]) -> dict[str, float]:
    """{case: max abs error} of commopt's 2D GEMM op (kernels/mesh2d/ops.py) for ls and rs in 1
    and 2 slices, each slice's GEMM + reduce-scatter run as the 1-D op with each per-axis
    schedule (its reference twin on gloo), against the unsharded float64 product."""
    import torch_commopt  # noqa: F401  (registers the commopt ops)

    mesh = init_device_mesh("cpu", shape)
    rows, cols = mesh.get_group(0).group_name, mesh.get_group(1).group_name
    block = _blocks(shape, rank)
    rc = shape[0] * shape[1]
    m, k, n = 16 * rc, 32 * rc, 24 * rc
    gen = torch.Generator().manual_seed(5)
    x, w_t, x_t, w = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((m, k), (n, k), (k, m), (k, n)))
    errors = {}
    for axis in schedules:
        for s in (1, 2):
            ls = torch.ops.commopt.gemm_2d(block(x), block(w_t), "ls", s, *shape, rows, cols, False, axis)[0]
            rs, gathered = torch.ops.commopt.gemm_2d(block(x_t), block(w), "rs", s, *shape, rows, cols, True, axis)
            errors[f"ls S={s} {axis}"] = (ls - block(x @ w_t.T)).abs().max().item()
            errors[f"rs S={s} {axis}"] = (rs - block(x_t.T @ w)).abs().max().item()
            # rs hands back X's rows gathered along cols: [M, K/R], this rank's column block of X
            want_gathered = x_t.T[:, (rank // shape[1]) * (k // shape[0]):(rank // shape[1] + 1) * (k // shape[0])]
            errors[f"rs S={s} {axis} gathered"] = (gathered - want_gathered).abs().max().item()
    return errors
