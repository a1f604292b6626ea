"""Inductor's once-per-process work, done at import: the fork server imports this module before
it forks any rank (launch.PRELOAD), so every forked rank starts with it done.

A rank's first CPU compile otherwise spends about 3 s of its own on work whose result is the same
in every process: probing which vector ISAs g++ can build (it compiles and loads a test program),
tracing inductor's joint-graph replacement patterns (attention, pad_mm and the rest), hashing
Triton's sources for the cache key, and importing what the compile imports lazily (inductor's
device back-ends, sympy's simplifier with sympy.physics, commopt's passes).  On the 2-core CI
machine, with a few hundred ranks forked over the suite, that was about a quarter of the CPU
suite's time (tests/passes: 190 s before, 155 s with the first three done here).

Nothing here touches CUDA (the fork server only serves ranks without CUDA) or leaves a thread
running (a rank forked while another thread held a lock could hang on it: tracing the patterns
shows a tqdm bar, whose monitor thread is kept from starting), and a failure only means the rank
does the work itself, as before.
"""

from __future__ import annotations

import contextlib
import importlib
import logging

log = logging.getLogger(__name__)

# imported lazily by a CPU compile through commopt (a rank's first compile imported ~140 modules);
# a name another torch version lacks is skipped
MODULES = ("sympy.physics.units", "sympy.combinatorics", "torch._inductor.graph", "torch._inductor.scheduler",
           "torch._inductor.choices", "torch._inductor.hooks", "torch._inductor.extern_node_serializer",
           "torch._inductor.codegen.cpp", "torch._inductor.codegen.cpp_wrapper_cpu",
           "torch._inductor.codegen.memory_planning", "torch._inductor.fx_passes.efficient_conv_bn_eval",
           "torch._functorch._aot_autograd.subclass_codegen", "torch._higher_order_ops.passes.inline_invoke_subgraph",
           "torch._subclasses.schema_check_mode", "torch._dynamo.repro.after_dynamo", "torch.export._trace",
           "torch.fx.experimental.validator", "torch.distributed.tensor.experimental", "torch_commopt.backend",
           "torch_commopt.passes.pipeline", "torch_commopt.passes.joint", "torch_commopt.passes.attention.rewrite",
           "torch_commopt.passes.attention.ulysses_joint", "torch_commopt.passes.matmul.ar_split",
           "torch_commopt.passes.matmul.coconet", "torch_commopt.passes.matmul.regather",
           "torch_commopt.tuner.attention.cost")


@contextlib.contextmanager
def _no_tqdm_monitor():
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    interval, tqdm.monitor_interval = tqdm.monitor_interval, 0
    try:
        yield
    finally:
        tqdm.monitor_interval = interval


def warm() -> None:
    """Fill inductor's per-process caches that a CPU compile reads first."""
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            log.debug("warm-up: %s not imported: %s", name, e)
    try:
        import torch._dynamo

        torch._dynamo.list_backends(exclude_tags=())  # imports every registered backend's module
        from torch._inductor import codecache, cpu_vec_isa
        from torch._inductor.codegen.common import init_backend_registration
        from torch._inductor.fx_passes import joint_graph, post_grad

        init_backend_registration()
        cpu_vec_isa.valid_vec_isa_list()
        codecache.triton_key()
        with _no_tqdm_monitor():
            joint_graph.lazy_init(torch.device("cpu"))  # cached per input device: a CPU compile's
            post_grad.lazy_init()
    except Exception as e:  # noqa: BLE001 - only a head start: each rank does it itself otherwise
        log.debug("inductor warm-up skipped: %s", e)


warm()
