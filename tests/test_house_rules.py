"""House rules checked on the package's source (docs/architecture.md, the layer contract).

No function takes more than MAX_PARAMS parameters (self / cls not counted): a region or a
call passes a value type whole (tuner.matmul.model.RegionFacts, kernels.matmul.product.Product,
kernels.attention.schedules.CPOptions, ...).  Two kinds of function are exempt, each recognised
from the source, not by a name list of functions:
- Triton kernels (`@triton.jit`): their parameters are the kernel's launch ABI;
- the definitions, kernels and fake impls of the custom ops in CUSTOM_OPS: a custom op's Python
  signature is its schema, which the compiled graphs call with exactly these arguments.  A
  function counts as one where it is decorated by a call naming a listed op by string
  (`torch.library.register_fake("commopt::x")`, `torch.library.custom_op("commopt::x", ...)`,
  or a module's own registration decorator, a function that calls `<Library>.define` /
  `.impl`: kernels/matmul/ops.py's `_op("x")`), or where it is passed to
  `<Library>.impl("x", fn, ...)`.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torch_commopt"
MAX_PARAMS = 8

# The custom ops whose signatures exceed MAX_PARAMS, and why each keeps its arguments.  Anything
# below them (the schedules, kernels, tuner) takes value types.
CUSTOM_OPS = {
    "commopt::ag_matmul": "the schema of an all-gather + matmul region (float8 scales, outputs) the graph calls",
    "commopt::matmul_rs": "the schema of a matmul + reduce-scatter region (float8 scales, K parts)",
    "commopt::matmul_ar": "the schema of a matmul + all-reduce region (float8 scales, K parts)",
    "commopt::cp_attention_fwd": "the schema of context-parallel attention's forward",
    "commopt::cp_attention_bwd": "the schema of its backward (the forward's tensors beside dout)",
    "commopt::cp_attention_fwd_keep": "the schema of the training forward that keeps its moved inputs",
    "commopt::cp_attention_bwd_kept": "the schema of its backward (the kept tensors beside dout)",
    "commopt::cp_flex_attention_fwd": "the schema of FlexAttention CP's forward (the mask's tables, code, buffers)",
    "commopt::cp_flex_attention_bwd": "the schema of its backward (the forward's out and lse beside dout)",
    "commopt::cp_flex_attention_fwd_keep": "the one-group all-gather's forward, its gathered K/V returned too",
    "commopt::cp_flex_attention_bwd_kept": "its backward, on the forward's gathered K/V (nothing gathered)",
    "commopt::gemm_2d": "the schema of a 2D GEMM region (dataflow, slices, both mesh sizes and groups, the gathered copy)",
}


@dataclass(frozen=True)
class Function:
    path: str
    line: int
    name: str
    params: int
    exempt: str | None  # why, or None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional-only, ordinary and keyword-only parameters, self / cls left out (as the rule counts)."""
    a = fn.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    first = (a.posonlyargs + a.args)[:1]
    return count - 1 if first and first[0].arg in ("self", "cls") else count


def _dotted(node: ast.AST) -> str:
    """`torch.library.register_fake` for that attribute chain ('' for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    return ""


def _is_triton_jit(decorator: ast.AST) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return _dotted(target) in ("triton.jit", "jit")


def _op_name(value: str) -> str:
    return value if "::" in value else f"commopt::{value}"


def _registration_helpers(tree: ast.Module) -> set[str]:
    """Module-level functions that register ops themselves (call `<x>.define(...)` or
    `<x>.impl(...)`): decorators such as kernels/matmul/ops.py's `_op`."""
    helpers = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            if any(c.func.attr in ("define", "impl") for c in calls):
                helpers.add(fn.name)
    return helpers


def _op_decorator(decorator: ast.AST, helpers: set[str]) -> str | None:
    """The op a decorator registers the function for, or None."""
    if not isinstance(decorator, ast.Call) or not decorator.args:
        return None
    first = decorator.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    callee = _dotted(decorator.func)
    if callee.split(".")[-1] in ("custom_op", "register_fake", "register_kernel") or callee in helpers:
        return _op_name(first.value)
    return None


def _impl_targets(tree: ast.Module) -> dict[str, str]:
    """{function name: op} for `<Library>.impl("op", fn, ...)` calls."""
    out = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "impl"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and isinstance(node.args[1], ast.Name)):
            out[node.args[1].id] = _op_name(node.args[0].value)
    return out


def functions(package: pathlib.Path = PACKAGE) -> list[Function]:
    """Every function of the package's source, with its parameter count and exemption."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        helpers, impls = _registration_helpers(tree), _impl_targets(tree)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            exempt = None
            if any(_is_triton_jit(d) for d in fn.decorator_list):
                exempt = "triton kernel"
            ops = [op for op in (_op_decorator(d, helpers) for d in fn.decorator_list) if op]
            if fn.name in impls and fn.col_offset == 0:
                ops.append(impls[fn.name])
            if ops:
                exempt = f"custom op {ops[0]}"
            found.append(Function(str(path.relative_to(package.parent)), fn.lineno, fn.name, _params(fn), exempt))
    return found


def test_no_function_takes_more_than_eight_parameters():
    too_many = [f for f in functions() if f.params > MAX_PARAMS and f.exempt is None]
    assert not too_many, "pass a value type whole instead of:\n" + "\n".join(
        f"  {f.path}:{f.line} {f.name} ({f.params} parameters)" for f in too_many)


def test_only_listed_custom_ops_keep_long_signatures():
    """An op exempted by its registration must be listed in CUSTOM_OPS, with its reason."""
    unlisted = [f for f in functions() if f.params > MAX_PARAMS and f.exempt and f.exempt.startswith("custom op")
                and f.exempt.removeprefix("custom op ") not in CUSTOM_OPS]
    assert not unlisted, "list these ops in CUSTOM_OPS with the reason, or give them value types:\n" + "\n".join(
        f"  {f.path}:{f.line} {f.name} ({f.exempt})" for f in unlisted)


def test_every_listed_custom_op_is_registered_and_needs_its_exemption():
    """No stale entry: each listed op is a torch.ops.commopt op whose source definition the
    exemption recognises, with more than MAX_PARAMS parameters."""
    import torch

    import torch_commopt  # noqa: F401  (registers the matmul ops)
    import torch_commopt.kernels.attention.ops  # noqa: F401  (and the attention ops)

    needed = {f.exempt.removeprefix("custom op ") for f in functions()
              if f.params > MAX_PARAMS and f.exempt and f.exempt.startswith("custom op")}
    for op in CUSTOM_OPS:
        namespace, name = op.split("::")
        assert hasattr(getattr(torch.ops, namespace), name), f"{op} is not a registered op"
        assert op in needed, f"{op} needs no exemption (or its definition is no longer recognised)"


def test_the_rule_sees_what_it_exempts(tmp_path):
    """The recognisers on a small module: a Triton kernel, a decorated fake, an impl passed to
    Library.impl and a registration helper are exempt; a plain long function is not."""
    src = '''
import torch, triton
_LIB = torch.library.Library("commopt", "FRAGMENT")

def _op(name):
    def register(fn):
        _LIB.define(name)
        return fn
    return register

@triton.jit
def kernel(a, b, c, d, e, f, g, h, i): pass

@_op("x")
def x(a, b, c, d, e, f, g, h, i): pass

@torch.library.register_fake("commopt::y")
def _(a, b, c, d, e, f, g, h, i): pass

def y_impl(a, b, c, d, e, f, g, h, i): pass

_LIB.impl("y", y_impl, "CompositeExplicitAutograd")

def plain(a, b, c, d, e, f, g, h, i): pass

class C:
    def method(self, a, b, c, d, e, f, g, h): pass
'''
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(src)
    got = {f.name if f.name != "_" else "fake": (f.params, f.exempt) for f in functions(tmp_path / "pkg")}
    assert got["kernel"] == (9, "triton kernel")
    assert got["x"] == (9, "custom op commopt::x")
    assert got["fake"] == (9, "custom op commopt::y")
    assert got["y_impl"] == (9, "custom op commopt::y")
    assert got["plain"] == (9, None)
    assert got["method"] == (8, None)
