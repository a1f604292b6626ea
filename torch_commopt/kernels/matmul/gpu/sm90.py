"""The CUDA (sm_90a) fused GEMMs: warp-specialized persistent kernels with wgmma and the TMA unit,
built from native/*.cu (sm90_common.cuh; ag_gemm_sm90.cu, the all-gather consumer; rs_gemm_sm90.cu,
the reduce-scatter producer) with nvcc on first use and called through ctypes.

Triton 3.6 does not warp-specialize for sm_90 (docs/gpu-schedules.md): its fused GEMMs pipeline
loads and MMAs within one instruction stream and reach 0.85-0.94 of cuBLAS at the training step's
GEMMs.  These kernels give the loads a warpgroup of their own, so a flag wait or a tile's
epilogue never stalls the tensor cores' next k step.  Where they cannot run (no sm_90 GPU, no
nvcc, operands they do not take) the Triton kernels run, and the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch

from torch_commopt.core import env
from torch_commopt.kernels.gpu import driver

log = logging.getLogger(__name__)
NATIVE = pathlib.Path(__file__).with_name("native")
SOURCES = [NATIVE / "ag_gemm_sm90.cu", NATIVE / "rs_gemm_sm90.cu"]
HEADERS = [NATIVE / "sm90_common.cuh"]
BM, BN, BK = 128, 256, 64  # both kernels' tile and k step (cooperative warpgroups: sm90_common.cuh)
RS_BN = 128  # the reduce-scatter counts BM x RS_BN tiles on its flags, as the Triton kernel does
GROUP_M = 16  # row tiles a group sweeps before its next column tile (B's tiles stay in L2)
NVCC_FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC"]
_state: dict = {"lib": None, "why": None}
_logged: set = set()
_workspaces: dict = {}  # (device, stream) -> (fp32 partials grid x BM x BN, int32 counters grid)


class Launch(NamedTuple):
    """How a kernel launches: GROUP_M row tiles a column sweep, `grid` persistent blocks (at most
    one a multiprocessor), and the debug waits' bound in ns (0: none)."""

    group_m: int
    grid: int
    bound_ns: int = 0

    @classmethod
    def of(cls, params: dict, device: torch.device, debug: bool, world: int = 1) -> "Launch":
        """A schedule's launch: its gm (else GROUP_M), a block per SM (its sms, else the device's),
        less one under debug waits (their one-block kernels need an SM), and their bound.  With
        the `world` ranks on one GPU (env.shared_device, correctness runs), a world-th of the SMs:
        each rank's kernel waits on data the others' kernels and copies make, and two ranks'
        full-grid all-gather kernels queued back to back deadlocked there, where half grids ran."""
        from torch_commopt.kernels.gpu import symm

        sms = params.get("sms") or torch.cuda.get_device_properties(device).multi_processor_count
        if world > 1 and env.shared_device():
            sms = max(1, sms // world)
        return cls(params.get("gm", GROUP_M), max(1, sms - (1 if debug else 0)), symm.wait_bound() if debug else 0)


def _nvcc() -> Optional[str]:
    for cand in (shutil.which("nvcc"), *env.nvcc_candidates()):
        if cand and os.path.exists(cand):
            return cand
    return None


def _compile() -> pathlib.Path:
    text = b"".join(f.read_bytes() for f in SOURCES + HEADERS)
    digest = hashlib.sha256(text + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    out = env.cache_dir() / "native" / f"gemm_sm90_{digest}.so"
    if not out.exists():
        nvcc = _nvcc()
        if nvcc is None:
            raise OSError("no nvcc (PATH, $CUDA_HOME/bin)")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run([nvcc, *NVCC_FLAGS, "-o", str(tmp), *map(str, SOURCES)], capture_output=True,
                             text=True, timeout=300)
        if run.returncode != 0:
            raise OSError(f"nvcc failed: {run.stderr.strip()[-800:]}")
        tmp.replace(out)
    return out


# The launchers' int64 argument words (native/*.cu, commopt_sm90_*_gemm_words), and which hold
# device addresses (a host replay relocates those into a later call's tensors).
AG_WORDS = ("a_own", "a_pitch", "a_slots", "s_pitch", "m_loc", "k", "world", "rank", "lin", "chunk_rows", "flag_base",
            "epoch", "flags", "status", "bound", "num_b", "b0", "b1", "b2", "b_pitch0", "b_pitch1", "b_pitch2", "n0",
            "n1", "n2", "c0", "c1", "c2", "bias0", "bias1", "bias2", "group_m", "grid", "workspace", "counters",
            "stream")
AG_ADDRESSES = tuple(AG_WORDS.index(w) for w in ("a_own", "a_slots", "flags", "status", "b0", "b1", "b2", "c0", "c1",
                                                  "c2", "bias0", "bias1", "bias2", "workspace", "counters"))
RS_MAX_RANKS = 8  # rs_gemm_sm90.cu's MAX_RANKS: a tensor map per destination segment in its parameters
RS_WORDS = ("a", "a_pitch", "b", "b_pitch", "n", "k", "out", "bias", "alpha", "bias_scale", "recv", "flag_bases",
            "flags", "status", "bound", "m_seg", "lin", "world", "rank", "chunk_mt", "data_base", "epoch", "counters",
            "direct", "group_m", "grid", "stream", *(f"dst{s}" for s in range(RS_MAX_RANKS)))
RS_ADDRESSES = tuple(RS_WORDS.index(w) for w in ("a", "b", "out", "bias", "recv", "flag_bases", "flags", "status",
                                                  *(f"dst{s}" for s in range(RS_MAX_RANKS))))


def _declared(lib):
    """`lib` with its entry points' signatures set."""
    for fn in (lib.commopt_sm90_ag_gemm_words, lib.commopt_sm90_rs_gemm_words):
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int64)]
    return lib


def library():
    """The built library with both kernels loaded on the current GPU (before any launch of theirs:
    sm90_common.cuh's ready), or None (the reason logged once, kept in `why_not`)."""
    if _state["lib"] is None and _state["why"] is None:
        try:
            lib = _declared(ctypes.CDLL(str(_compile())))
            failed = {tag: getattr(lib, f"commopt_sm90_{tag}_ready")() for tag in ("ag", "rs")}
            if any(failed.values()):
                raise OSError(f"a kernel did not load on this GPU (CUDA error by kernel: {failed})")
        except (OSError, subprocess.SubprocessError) as e:
            _state["why"] = f"the sm_90a kernels could not be built or loaded: {e}"
            log.warning("commopt: %s; the Triton fused kernels run", _state["why"])
            return None
        _state["lib"] = lib
    return _state["lib"]


def why_not() -> Optional[str]:
    return _state["why"]


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1])


def ag_refusal(a2: torch.Tensor, slots2: torch.Tensor, weights: Sequence[torch.Tensor],
               outs: Sequence[torch.Tensor], biases: Sequence) -> Optional[str]:
    """Why the sm_90a all-gather consumer cannot take these operands (None: it can)."""
    dev = a2.device
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) != (9, 0):
        return "not an sm_90 GPU"
    if any(t.dtype != torch.bfloat16 for t in [a2, slots2, *weights, *outs]):
        return "not bfloat16"
    if any(b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()) for b in biases):
        return "a bias is not a contiguous bfloat16 vector"
    if not all(w.stride(0) == 1 for w in weights):
        return "a weight is not K-major (nn.Linear's layout)"
    ops = [a2, slots2, *(w.t() for w in weights)]
    if not all(t.stride(-1) == 1 and _aligned(t) for t in ops):
        return "a base or row pitch is not 16-byte aligned"
    if any(not o.is_contiguous() or o.data_ptr() % 16 for o in outs):
        return "an output is not contiguous and 16-byte aligned"
    if any(w.shape[-1] % 8 for w in weights):
        return "an N is not a multiple of 8"
    if a2.shape[0] < BM or a2.shape[1] < BK or any(w.shape[-1] < BN for w in weights):
        return "a tensor is smaller than one tile"
    return None


def _workspace(device: torch.device, stream: int, grid: int):
    """The stream-K tail's partials and counters for launches on `stream` (one pair per stream: a
    launch leaves its counters at zero, and launches on one stream never overlap); None under a
    CUDA-graph capture (the kernel then runs whole tiles only): a replay may run on another stream
    than the one whose pair it would have baked in, beside that stream's own launches."""
    if torch.cuda.is_current_stream_capturing():
        return None
    key = (device.index, stream)
    have = _workspaces.get(key)
    if have is not None and have[1].numel() >= grid:
        return have
    have = (torch.empty(grid * BM * BN, device=device, dtype=torch.float32),
            torch.zeros(grid, device=device, dtype=torch.int32))
    _workspaces[key] = have
    return have


def _log_once(op: str, why: str) -> None:
    if (op, why) not in _logged:
        _logged.add((op, why))
        log.info("commopt %s impl=sm90: %s; the Triton kernel runs", op, why)


def _ready(op: str, why: Optional[str]):
    """The library where the operands suit it (why: the refusal, None if they do) and it is built,
    else None with the reason logged once."""
    lib = library() if why is None else None
    if why is None and lib is None:
        why = why_not()
    if why is not None:
        _log_once(op, why)
    return lib


def ag_gemm(a2, slots2, mm, at, launch: Launch) -> bool:
    """mm.outs[i] (full rows) = gathered A @ mm.weights[i] (+ mm.biases[i]) by the sm_90a kernel, up
    to three weights a launch: a2 (M_loc, K) this rank's shard, slots2 (world * M_loc, K) the slots,
    `at` the arrivals (ag_matmul.Arrivals).  Returns False, queueing nothing, where it cannot run
    (logged once per reason)."""
    weights, outs, biases = mm.weights, mm.outs, mm.biases
    group_m, grid, bound_ns = launch
    lib = _ready("ag_matmul", ag_refusal(a2, slots2, weights, outs, biases))
    if lib is None:
        return False
    m_loc, k = a2.shape
    stream = driver.current_handle(a2.device)
    work = _workspace(a2.device, stream, grid)
    work_ptr, counters_ptr = (work[0].data_ptr(), work[1].data_ptr()) if work is not None else (0, 0)
    head = [a2.data_ptr(), a2.stride(0), slots2.data_ptr(), slots2.stride(0), m_loc, k, at.world, at.rank, at.lin,
            at.chunk_rows, at.flag_base, at.epoch, at.flags.data_ptr(), at.status.data_ptr(), bound_ns]
    for first in range(0, len(weights), 3):
        ws, cs, bs = weights[first:first + 3], outs[first:first + 3], biases[first:first + 3]
        pad = [0] * (3 - len(ws))
        words = head + [len(ws), *(w.data_ptr() for w in ws), *pad, *(w.stride(1) for w in ws), *pad,
                        *(w.shape[-1] for w in ws), *pad, *(c.data_ptr() for c in cs), *pad,
                        *(b.data_ptr() if b is not None else 0 for b in bs), *pad, group_m, grid, work_ptr,
                        counters_ptr, stream]
        rc = driver.native_call(lib.commopt_sm90_ag_gemm_words, words, AG_ADDRESSES)
        if rc != 0:
            raise RuntimeError(f"commopt sm90 ag_gemm: launch failed with CUDA error {rc}")
    return True


def rs_refusal(a2: torch.Tensor, weight: torch.Tensor, targets, segments) -> Optional[str]:
    """Why the sm_90a reduce-scatter producer cannot take these operands (None: it can)."""
    out, send, recv, _bases, recv_off, direct, bases_aligned, host_bases = targets
    rank, world, lin, m_seg, chunk_mt = segments
    if a2.device.type != "cuda" or torch.cuda.get_device_capability(a2.device) != (9, 0):
        return "not an sm_90 GPU"
    if any(t.dtype != torch.bfloat16 for t in (a2, weight, out, recv)):
        return "not bfloat16"
    if weight.stride(0) != 1:
        return "the weight is not K-major (nn.Linear's layout)"
    n = weight.shape[-1]
    if n % 8 or n < RS_BN or a2.shape[-1] < BK or a2.shape[0] < BM:
        return "N not a multiple of 8, or a tensor smaller than one tile"
    if not (_aligned(a2) and _aligned(weight.t()) and out.is_contiguous() and out.data_ptr() % 16 == 0):
        return "a base or row pitch is not 16-byte aligned"
    if direct and not (bases_aligned and (recv_off * out.element_size()) % 16 == 0):
        return "a peer's receive slot is not 16-byte aligned"
    if not direct and (not send.is_contiguous() or send.data_ptr() % 16):
        return "the send buffer is not contiguous and 16-byte aligned"
    if not (recv.is_contiguous() and recv.data_ptr() % 16 == 0):
        return "the receive slots are not contiguous and 16-byte aligned"
    if not (lin == m_seg or lin % BM == 0):
        return f"a tile's rows span two runs of A (run of {lin} rows, tile {BM})"
    if chunk_mt < 1:
        return "no tile in a chunk"
    if world > RS_MAX_RANKS:
        return f"more than {RS_MAX_RANKS} ranks (a tensor map per destination in the kernel's parameters)"
    if direct and len(host_bases) != world:
        return "the peers' receive buffers are not known on the host (their tensor maps are encoded there)"
    return None


def rs_destinations(targets, segments, n: int) -> list:
    """Where segment s's (m_seg, n) rows go, RS_MAX_RANKS words (device addresses; 0 past the world
    and at this rank's own): direct, the peer's receive slot `rank` (its buffer's base + recv_off
    elements + rank segments); store=ce, the local send buffer's segment s."""
    out, send, _recv, _bases, recv_off, direct, _aligned_bases, host_bases = targets
    rank, world, _lin, m_seg, _chunk_mt = segments
    elt, seg_bytes = out.element_size(), m_seg * n * out.element_size()
    if direct:
        dst = [host_bases[s] + recv_off * elt + rank * seg_bytes for s in range(world)]
    else:
        dst = [send.data_ptr() + s * seg_bytes for s in range(world)]
    dst[rank] = 0
    return dst + [0] * (RS_MAX_RANKS - world)


def rs_gemm(a2, weight, targets, signals, segments, alpha: float, launch: Launch) -> bool:
    """The sm_90a reduce-scatter producer (matmul_reduce.launch_rs_fused's arguments).  Returns
    False, queueing nothing, where it cannot run (logged once per reason)."""
    from torch_commopt.kernels.gpu.symm import COUNTERS

    lib = _ready("matmul_rs", rs_refusal(a2, weight, targets, segments))
    if lib is None:
        return False
    out, recv, direct = targets.out, targets.recv, targets.direct
    flags, flag_bases, status, data_base, epoch = signals
    rank, world, lin, m_seg, chunk_mt = segments
    group_m, grid, bound_ns = launch
    n, k = weight.shape[-1], a2.shape[-1]
    words = [a2.data_ptr(), a2.stride(0), weight.data_ptr(), weight.stride(1), n, k, out.data_ptr(), 0,
             _float_bits(alpha), _float_bits(0.0), recv.data_ptr(), flag_bases.data_ptr(), flags.data_ptr(),
             status.data_ptr(), bound_ns, m_seg, lin, world, rank, chunk_mt, data_base, epoch, COUNTERS, int(direct),
             group_m, grid, driver.current_handle(a2.device), *rs_destinations(targets, segments, n)]
    rc = driver.native_call(lib.commopt_sm90_rs_gemm_words, words, RS_ADDRESSES)
    if rc != 0:
        raise RuntimeError(f"commopt sm90 rs_gemm: launch failed with CUDA error {rc}")
    return True


def _float_bits(x: float) -> int:
    return ctypes.c_int32.from_buffer(ctypes.c_float(x)).value
