"""Every environment variable torch_commopt reads, in one place (docs/configuration.md lists them).

One accessor per variable, read when it is called (so a test's `monkeypatch.setenv`, or a
launcher that sets the variable before a rank starts, takes effect); the caller decides when
that is.  The parsing of each value is part of its contract: an unset variable reads as its
default, and the few values that mean "off" are spelled out per variable.  Validation that
needs a logger (an unknown transport name is logged and read as a fallback) stays with the
caller, which gets the normalized string.

A leaf module: imports nothing from torch_commopt.
"""

from __future__ import annotations

import math
import os
import pathlib

CACHE_DIR = "TORCH_COMMOPT_CACHE_DIR"
DEBUG_WAITS = "TORCH_COMMOPT_DEBUG_WAITS"
WAIT_TIMEOUT_S = "TORCH_COMMOPT_WAIT_TIMEOUT_S"
SHARED_DEVICE = "TORCH_COMMOPT_SHARED_DEVICE"
CALL_GRAPHS = "TORCH_COMMOPT_CALL_GRAPHS"
HOST_TIMING = "TORCH_COMMOPT_HOST_TIMING"
ATTENTION_TRANSPORT = "TORCH_COMMOPT_ATTENTION_TRANSPORT"
ATTENTION_A2A = "TORCH_COMMOPT_ATTENTION_A2A"
ATTENTION_GROUP_STREAMS = "TORCH_COMMOPT_ATTENTION_GROUP_STREAMS"
ATTENTION_LANE = "TORCH_COMMOPT_ATTENTION_LANE"
FLEX_GATHER_CUT = "TORCH_COMMOPT_FLEX_GATHER_CUT"
SYMM_CAP_MIB = "TORCH_COMMOPT_SYMM_CAP_MIB"
AGREE_TIMEOUT_S = "TORCH_COMMOPT_AGREE_TIMEOUT_S"
WATCHDOG = "TORCH_COMMOPT_WATCHDOG"
MOE_TRANSPORT = "TORCH_COMMOPT_MOE_TRANSPORT"
DECODE_TRANSPORT = "TORCH_COMMOPT_DECODE_TRANSPORT"
HOST_REPLAY = "TORCH_COMMOPT_HOST_REPLAY"
TOKENS_ON_SIDE = "TORCH_COMMOPT_TOKENS_ON_SIDE"
GATHER_OWN_EARLY = "TORCH_COMMOPT_GATHER_OWN_EARLY"

# Every variable above (tests/test_env.py checks that docs/configuration.md lists each one).
NAMES = (CACHE_DIR, DEBUG_WAITS, WAIT_TIMEOUT_S, SHARED_DEVICE, CALL_GRAPHS, HOST_TIMING, ATTENTION_TRANSPORT,
         ATTENTION_A2A, ATTENTION_GROUP_STREAMS, ATTENTION_LANE, FLEX_GATHER_CUT, SYMM_CAP_MIB, AGREE_TIMEOUT_S, WATCHDOG,
         MOE_TRANSPORT, DECODE_TRANSPORT, HOST_REPLAY, TOKENS_ON_SIDE,
         GATHER_OWN_EARLY)

# CPython's POSIX os.environ keeps the encoded strings in `_data`; os.environ.get encodes the name
# and decodes the value at every read (~1 us on a slow host, several reads in a GPU schedule's call).
_POSIX = os.name == "posix"
_NAMES: dict[str, bytes] = {}
_DECODED: dict[str, tuple[bytes, str]] = {}  # name -> (the encoded value last read, its decoding)


def _get(name: str, default: str) -> str:
    """os.environ.get(name, default) for the switches read on every call: the same value, read
    from os.environ's own encoded mapping, decoded again only when the variable was set anew
    (a new value is a new object there)."""
    encoded = getattr(os.environ, "_data", None) if _POSIX else None  # (read each time: os.environ may be replaced)
    if not isinstance(encoded, dict):
        return os.environ.get(name, default)
    key = _NAMES.get(name)
    if key is None:
        key = _NAMES[name] = os.fsencode(name)
    raw = encoded.get(key)
    if raw is None:
        return default
    hit = _DECODED.get(name)
    if hit is None or hit[0] is not raw:
        hit = _DECODED[name] = (raw, os.fsdecode(raw))
    return hit[1]


DEFAULT_WAIT_TIMEOUT_S = 60.0
DEFAULT_AGREE_TIMEOUT_S = 30.0
ATTENTION_GROUP_STREAMS_DEFAULT = "1"


def cache_dir() -> pathlib.Path:
    """The tuner cache directory: TORCH_COMMOPT_CACHE_DIR when set and non-empty, else
    $XDG_CACHE_HOME/torch_commopt, else ~/.cache/torch_commopt.  `Config.cache_dir` overrides
    it for one compile."""
    if os.environ.get(CACHE_DIR):
        return pathlib.Path(os.environ[CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "torch_commopt"


def nvcc_candidates() -> list[str]:
    """Where the sm_90a kernels look for nvcc besides PATH: $CUDA_HOME/bin (CUDA's own variable),
    else /usr/local/cuda/bin."""
    return [os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nvcc")]


def debug_waits() -> bool:
    """TORCH_COMMOPT_DEBUG_WAITS (default off): bound every spin-wait of the GPU schedules and
    the attention transports in wall time and raise an error naming the op, rank and piece
    instead of hanging, as `Config.debug_waits` does for one compile.  Off when unset or
    "", "0", "false", "False"; on for any other value."""
    return _get(DEBUG_WAITS, "0") not in ("", "0", "false", "False")


def wait_timeout_s() -> float:
    """TORCH_COMMOPT_WAIT_TIMEOUT_S (default 60): the wall-clock seconds a GPU wait of a commopt call
    may last before it becomes an error -- the watchdog's bound in production
    (kernels/gpu/watchdog.py) and a debug-mode wait's bound.  Wall time rather than an iteration
    count, because a peer that is JIT-compiling a Triton specialization is seconds behind, not
    stuck.  Parsed with float(); a value that does not parse, or is not a positive finite number,
    raises ValueError naming the variable."""
    return _number(WAIT_TIMEOUT_S, DEFAULT_WAIT_TIMEOUT_S, "a positive finite number of seconds",
                   lambda x: 0 < x < math.inf)


def watchdog() -> bool:
    """TORCH_COMMOPT_WATCHDOG (default on): whether the GPU schedules' calls are watched
    (kernels/gpu/watchdog.py), so that a wait stuck past TORCH_COMMOPT_WAIT_TIMEOUT_S becomes a
    WaitTimeout naming the op, schedule and peer.  "0", "false", "False" or "off" turn it off
    (a stuck peer then hangs the program, as NCCL without its watchdog would); anything else,
    "" included, leaves it on."""
    return _get(WATCHDOG, "1") not in ("0", "false", "False", "off")


def watch_calls() -> bool:
    """Whether a GPU schedule's call is watched by the watchdog, as far as the environment says:
    TORCH_COMMOPT_WATCHDOG on and TORCH_COMMOPT_DEBUG_WAITS off (a debug-mode call bounds its
    waits itself).  One function for the two switches: it is read at every call's start."""
    return (_get(WATCHDOG, "1") not in ("0", "false", "False", "off")
            and _get(DEBUG_WAITS, "0") in ("", "0", "false", "False"))


def under_ci() -> bool:
    """$CI (set by CI runners; not one of ours): whether the test harness runs under CI, where an
    optional package the test extras install must be there (testing/optional.py)."""
    return bool(os.environ.get("CI"))


def shared_device() -> bool:
    """TORCH_COMMOPT_SHARED_DEVICE (default off): several ranks on one GPU, for correctness runs
    only -- the symmetric buffers are mapped between the ranks' processes by CUDA IPC over a gloo
    group (kernels/gpu/shared_device.py).  Off when unset, "" or "0"; on for any other value."""
    return os.environ.get(SHARED_DEVICE, "0") not in ("", "0")


def call_graphs() -> bool:
    """TORCH_COMMOPT_CALL_GRAPHS (default on): whether schedules with cg=1 (`Config.call_graphs`)
    may capture and replay per-call CUDA graphs in this process.  "0", "false", "False" or "off"
    turn the replays off (those calls then run eagerly); any other value, "" included, leaves
    them on."""
    return _get(CALL_GRAPHS, "1") not in ("0", "false", "False", "off")


def host_replay() -> bool:
    """TORCH_COMMOPT_HOST_REPLAY (default on): an eager GPU schedule's later calls are queued from
    the trace its first calls recorded, in native code (kernels/gpu/host_replay.py); "0", "false",
    "False" or "off" keep every call's Python host code."""
    return _get(HOST_REPLAY, "1") not in ("0", "false", "False", "off")


def tokens_on_side() -> bool:
    """TORCH_COMMOPT_TOKENS_ON_SIDE (default off; experimental: it did not pay on 2x H200): a matmul
    schedule's eager call gives its peers their tokens back from the side stream, after the
    call's reads, instead of from the caller's stream, so that the caller's next kernel does not
    wait behind those remote writes (symm.GroupRuntime.done_reading).  "1", "true", "True" or
    "on" turn it on; read at every call."""
    return _get(TOKENS_ON_SIDE, "0") in ("1", "true", "True", "on")


def gather_own_early() -> bool:
    """TORCH_COMMOPT_GATHER_OWN_EARLY (default off: on 2xH200 it did not pay): an all-gather
    region that keeps its gathered input (the cuBLAS consumer) copies this rank's rows into it
    under the own shard's GEMM, on the local copy stream, instead of with the first peer's rows
    under that peer's GEMM (kernels/matmul/gpu/ag_matmul.py).  "1", "true", "True" or "on" turn
    it on; read at every call."""
    return _get(GATHER_OWN_EARLY, "0") in ("1", "true", "True", "on")


def host_timing() -> bool:
    """TORCH_COMMOPT_HOST_TIMING (default off): "1" wraps every commopt op so that its host time
    is added up per (op, thread) in `kernels.matmul.ops.HOST_TIMES`.  The ops read it once, when
    they are registered (import of kernels.matmul.ops): set it before importing torch_commopt."""
    return os.environ.get(HOST_TIMING) == "1"


def _choice(name: str, default: str) -> str:
    """The variable's value stripped and lower-cased; `default` when unset or empty."""
    return os.environ.get(name, default).strip().lower() or default


def attention_transport() -> str:
    """TORCH_COMMOPT_ATTENTION_TRANSPORT (default "auto"): how the ring attention schedules move
    K/V, and the flex all-gather schedule its K/V and their gradients -- "nccl" (send/recv, an
    all-gather and a reduce-scatter), "ce": the copy engine over symmetric memory
    (kernels/attention/ce_ring.py, ce_gather.py), or "auto": the copy engine for the flex
    all-gather, NCCL for the rings.  Case and surrounding spaces ignored; the caller logs an
    unknown value and reads it as "nccl"."""
    return _choice(ATTENTION_TRANSPORT, "auto")


def attention_a2a() -> str:
    """TORCH_COMMOPT_ATTENTION_A2A (default "ce"): how Ulysses's all-to-alls run on CUDA -- "ce",
    the copy engine over symmetric memory (kernels/attention/ce_a2a.py), or "nccl".  Case and
    surrounding spaces ignored; the caller logs an unknown value and reads it as "nccl"."""
    return _choice(ATTENTION_A2A, "ce")


def flex_gather_cut() -> bool:
    """TORCH_COMMOPT_FLEX_GATHER_CUT (default off; experimental): over two ranks, the flex all-gather
    schedule's copy-engine K/V gather pulls from the peer's buffer only the keys this rank's rows
    keep tiles of (kernels/attention/ce_gather.py, all_gather_kv_pulled).  "1", "true", "True" or
    "on" turn it on; the group's ranks agree on it at their first call."""
    return _get(FLEX_GATHER_CUT, "0") in ("1", "true", "True", "on")


def moe_transport() -> str:
    """TORCH_COMMOPT_MOE_TRANSPORT (default "ce"): how by_expert's transfers run on CUDA -- "ce",
    the copy engine over symmetric memory (kernels/moe/ce_exchange.py), or "nccl".  Case and
    surrounding spaces ignored; the caller logs an unknown value and reads it as "nccl"."""
    return _choice(MOE_TRANSPORT, "ce")


def decode_transport() -> str:
    """TORCH_COMMOPT_DECODE_TRANSPORT (default "ll"): how the decoding attention's partials travel
    on CUDA -- "ll", the low-latency all-gather over symmetric memory (kernels/gpu/lowlat.py), or
    "nccl".  Case and surrounding spaces ignored; the caller logs an unknown value and reads it
    as "nccl"."""
    return _choice(DECODE_TRANSPORT, "ll")


def attention_group_streams() -> str:
    """TORCH_COMMOPT_ATTENTION_GROUP_STREAMS (default "1"): which passes of pure Ulysses run their
    odd head groups on a second compute stream -- "1" forward and backward, "fwd" the forward
    only, "0" neither.  Case and surrounding spaces ignored; the caller logs an unknown value and
    reads it as the default."""
    return _choice(ATTENTION_GROUP_STREAMS, ATTENTION_GROUP_STREAMS_DEFAULT)


def attention_lane() -> bool:
    """TORCH_COMMOPT_ATTENTION_LANE (default off): "1" runs the attention schedules' NCCL
    all-to-alls, with their packing and unpacking, on a side stream (kernels/attention/lane.py).
    Only the exact value "1" turns it on."""
    return os.environ.get(ATTENTION_LANE, "0") == "1"


def symm_cap_mib() -> float | None:
    """TORCH_COMMOPT_SYMM_CAP_MIB (default: None, which the runtime reads as 1/8 of the device's
    memory, kernels/gpu/symm_cap.py): the most MiB of symmetric memory (buffers, flag arrays and
    their signal pads) this process may hold on one device, over all process groups.  Unset or
    empty: None.  Parsed with float(): "inf" means no cap, "0" no symmetric memory at all (every
    GPU schedule and copy-engine transport runs NCCL).  A value that does not parse, a negative
    one or nan raises ValueError naming the variable."""
    return _number(SYMM_CAP_MIB, None, "a number of MiB >= 0 (or inf)", lambda x: x >= 0)


def agree_timeout_s() -> float:
    """TORCH_COMMOPT_AGREE_TIMEOUT_S (default 30): how long a run-time agreement -- the vote on
    a symmetric allocation at a region's first call -- waits for the group's other ranks before
    every rank runs NCCL for that call and the missing ranks are named.  (Compile-time
    agreements take Config.consistency_timeout_s.)  Parsed with float(); it must be finite and
    positive, else ValueError naming the variable."""
    return _number(AGREE_TIMEOUT_S, DEFAULT_AGREE_TIMEOUT_S, "a positive finite number of seconds",
                   lambda x: 0 < x < math.inf)


def _number(name: str, default, expected: str, ok) -> float:
    """The variable parsed with float() (surrounding spaces ignored); `default` when unset or
    empty; ValueError naming the variable when it does not parse or ok(value) is false (nan never
    passes a comparison)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected {expected}") from None
    if not ok(value):
        raise ValueError(f"{name}={text!r}: expected {expected}")
    return value
