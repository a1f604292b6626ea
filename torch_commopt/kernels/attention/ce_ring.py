"""Copy-engine ring shifts for the ring schedules on CUDA: K/V pushed by the copy engine.

NCCL's send/recv run as kernels that take SMs from the attention kernels beside them
(docs/context-parallel-attention.md#the-ring-by-copy-engine).  Here a ring step is a
cudaMemcpyAsync from this rank's current block into the next rank's symmetric ring buffer on
the runtime's side stream (the copy engine, no SM), flagged by a stream memory write; the
compute stream waits on its own flag with a stream memory wait.  Same interface as
comm.RingShift (current / start / wait, and finish after the last step), selected by
comm.ring_shift.

Protocol (rank p of n, channel c, steps i = 0, 1, ...; kernels/gpu/symm.py's RING_ flags):
  start (step i, half h = i % 2), side stream: wait for the compute stream (the current
      block is complete), take the token RING_FREE[c, h] (rank p+1 has finished reading
      slot (c, h) of its buffer: the push of step i-2; at step 0 the other half's token
      too, not taken: slots follow the blocks, and the ring before, of other blocks, may
      have ended in that half), copy the block into p+1's slot (c, h), then set p+1's
      RING_DATA[c, h] = 1.
  wait (step i), compute stream: hold until this rank's RING_DATA[c, h] = 1 (p-1's block
      has landed in slot (c, h): the current block of step i+1), then join the side stream
      (the push of step i has read the old current block) and release the old block's
      slot: lower its RING_DATA and give p-1 its token back.
  finish: release the last block's slot after its last use.
Every value is a constant and every flag is back at rest after finish, as in symm.py.
Channel 1 runs a second ring at the same time (FlexAttention's backward: its dK/dV sums beside
K/V), in a buffer of its own (channel_purpose).

Off by default: TORCH_COMMOPT_ATTENTION_TRANSPORT=ce (core/env.py) turns it on (logged once);
inside a CUDA-graph capture before the ring buffer exists, NCCL runs (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from torch_commopt.core import env
from torch_commopt.kernels.attention import switches

log = logging.getLogger(__name__)
ENV = env.ATTENTION_TRANSPORT
PURPOSE = "attention ring"  # the runtime's own_buffer key (channel 0's; channel_purpose)


def channel_purpose(channel: int) -> str:
    """A channel's own buffer key: each channel a buffer of its own, since two rings may run at
    once (FlexAttention's backward shifts K/V and the dK/dV sums together), each laid out by its
    own blocks, and a buffer that grows for one must not be let go under the other."""
    return PURPOSE if channel == 0 else f"{PURPOSE} {channel}"


_ALIGN = 256  # bytes: every tensor of a message starts aligned in its slot


def _once(key: str, level: int, msg: str, *args) -> None:
    switches.once(log, key, level, msg, *args)


def transport() -> str:
    """The transport the environment asks for: "auto" (the default: the copy engine where it
    measured faster than NCCL, the flex all-gather's moves; NCCL for the rings), "nccl" or
    "ce" (everywhere it can); an unknown value is logged and read as nccl: a typo must not
    stop a training step."""
    return switches.transport(log, ENV, env.attention_transport(), ("auto", *switches.TRANSPORTS))


def _layout(tensors: Sequence[Tensor]) -> tuple[list[int], int]:
    """(offset of each tensor in a slot, the slot's bytes): every piece starts aligned."""
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, off


def slot_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes one message of these tensors takes in a slot."""
    return _layout(tensors)[1]


def usable(tensors: Sequence[Tensor], group, channel: int = 0) -> bool:
    """Whether a ring shift of these tensors over `group` runs on the copy engine: asked for
    (transport() == "ce"), CUDA tensors, two or more ranks, and outside a CUDA-graph capture
    unless the ring buffer already exists (creating it is collective and synchronizes)."""
    if transport() != "ce" or group is None or group.size() < 2 or tensors[0].device.type != "cuda":
        return False
    if torch.cuda.is_current_stream_capturing():
        from torch_commopt.kernels.gpu import symm

        rt = symm.existing(group.group_name, tensors[0].device)
        if rt is None or not rt.has_own_buffer(channel_purpose(channel), 2 * slot_bytes(tensors)):
            _once("capture", logging.INFO, "commopt attention: copy-engine ring buffer not yet allocated inside a "
                  "CUDA-graph capture; the ring runs on NCCL (run a call outside the graph first)")
            return False
    _once("on", logging.INFO, "commopt attention: ring transfers by the copy engine (%s=ce)", ENV)
    return True


class CEShift:
    """comm.RingShift's interface with copy-engine pushes into the next rank's symmetric ring
    buffer (see the module docstring).  tensors: this rank's block (any dtypes, CUDA)."""

    def __init__(self, tensors: Sequence[Tensor], group, channel: int = 0) -> None:
        from torch_commopt.kernels.gpu import symm

        self.symm, self.channel = symm, channel
        self.rt = rt = symm.runtime(group.group_name, tensors[0].device)
        self.specs = [(t.shape, t.dtype) for t in tensors]
        self.offsets, self.slot = _layout(tensors)
        self.buf = rt.own_buffer(channel_purpose(channel), 2 * self.slot)  # two halves
        n, p = rt.world, rt.rank
        self.next, self.prev = (p + 1) % n, (p - 1) % n
        self.views = [t.contiguous() for t in tensors]
        self.step, self.held = 0, None  # held: the half of this rank's slot holding the current block
        # bounded waits (TORCH_COMMOPT_DEBUG_WAITS): the runtime loads the wait kernel first
        self.debug = rt.debug_waits()
        self.compute = torch.cuda.current_stream(tensors[0].device)
        # watched from here to finish(), on the compute stream; each channel in a lane of its own
        self.watched = rt.begin_call("cp attention ring", lane=f"ring{channel}", label=f"copy-engine ring, channel {channel}")

    def _base(self, half: int) -> int:
        return half * self.slot

    def _index(self, region: int, half: int) -> int:
        return region + self.channel * self.symm.HALVES + half

    def current(self) -> list[Tensor]:
        return self.views

    def start(self) -> None:
        rt, half, side = self.rt, self.step % 2, self.rt.side
        side.wait_stream(self.compute)
        with torch.cuda.stream(side):
            free = self._index(self.symm.RING_FREE, half)
            if self.step == 0:  # the ring before may have left its last block in the other half
                rt.wait(side, self._index(self.symm.RING_FREE, 1 - half), 1, debug=self.debug, what="free ring slot",
                        src=self.next, chunk=-1, watched=self.watched)
            rt.wait(side, free, 1, debug=self.debug, what="free ring slot", src=self.next, chunk=self.step,
                    watched=self.watched)
            self.symm.driver.write_value32(side, rt.flag_address(rt.rank, free), 0)
            for t, off in zip(self.views, self.offsets):
                self.buf.view(self.next, self._base(half) + off, t.shape, t.dtype).copy_(t, non_blocking=True)
                if self.held is None:  # the inputs (step 0), from the caching allocator, read here
                    t.record_stream(side)
            rt.signal(side, self.next, self._index(self.symm.RING_DATA, half), 1)

    def wait(self) -> None:
        rt, half = self.rt, self.step % 2
        rt.wait(self.compute, self._index(self.symm.RING_DATA, half), 1, debug=self.debug, what="ring block",
                src=self.prev, chunk=self.step, watched=self.watched)
        self.compute.wait_stream(rt.side)  # the push of this step has read the old block
        self._release()
        self.held, self.step = half, self.step + 1
        self.views = [self.buf.view(rt.rank, self._base(half) + off, shape, dtype)
                      for (shape, dtype), off in zip(self.specs, self.offsets)]

    def finish(self) -> None:
        """After the last use of the current block: its slot back to the previous rank."""
        self._release()
        self.held = None
        self.rt.end_call(self.watched)
        self.watched = None
        if self.debug:
            self.rt.check_status("cp attention ring")

    def _release(self) -> None:
        if self.held is None:
            return
        rt = self.rt
        data = self._index(self.symm.RING_DATA, self.held)
        self.symm.driver.write_value32(self.compute, rt.flag_address(rt.rank, data), 0)
        rt.signal(self.compute, self.prev, self._index(self.symm.RING_FREE, self.held), 1)
