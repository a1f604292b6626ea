"""Runs what faked GPU schedules queued (fake_cuda.py) the way the GPUs would, to check the
flag protocol of symm.GroupRuntime across ranks without GPUs.

Every stream runs its operations in order; a flag wait holds its stream until the flag is >= its
value (modulo 2**32, as cuStreamWaitValue32's GEQ); an event wait holds it until the record it
bound to has run.  The streams of all ranks interleave in an order a seeded scheduler picks.
A write into a symmetric buffer is a copy (copy engine, SM copy) or a store (a compute kernel's:
a GEMM's out=, an in-place op, Tensor.copy_ -- fake_cuda records both, on the stream they were
issued on); both are checked alike.  Reported as errors:
- Deadlock: no stream can move while some still have work (what each one waits for);
- Race: a write by rank r into rank p's buffer while p still reads what that place held: the
  write lands the piece whose data flag r raises next on that stream, to the value it writes
  (a flag may count pieces: 1, 2, ...), and p reads the pieces up to the value it waited for
  from that wait until it lowers the flag again -- the bytes the pieces' writes wrote, so a
  write of a piece already waited for, or of another piece (or an untagged one, e.g. p's own
  local copy or GEMM) that lands on any of those bytes or on a piece landed and not yet read,
  is one too (calls whose slot layouts differ reuse the same bytes under different flags);
- Race (pulls): a write into rank q's buffer over bytes a reader p still pulls from there
  (ce_pull: p's copy out of q's buffer, after p waited for the piece's data flag from q on the
  same stream).  p reads them from that wait until it gives q's token of the flag's half back
  (FREE[h, p] in q's flags): q may rewrite its half only once it has taken the token again, so a
  write by anyone -- q's next GEMM or copy into its own half (a call of another shape whose slots
  overlap, as after a CUDA-graph replay, which takes no epoch: commit 9f13be4) or a peer's push --
  in between is one;
- Early read: a copy by rank p out of a buffer p's op owns (the attention's; the shared one only
  where asked: simulate(shared_reads=True), for calls whose every write into it is recorded, a
  copy or a store -- a fused Triton kernel's stores are not) from bytes that no write has put
  there since p last lowered the flag of the piece they held (landed pieces, waited for or not,
  and p's own local copies and stores count) -- a piece read before it landed, which a wait on
  the wrong flag or value lets happen in some interleavings (stores record no reads, so a GEMM
  reading a slot early is not seen);
- NotAtRest: after everything ran, a token not back at 1 or a data flag not back at 0 (the
  protocol is closed: a CUDA graph may replay a call only if every flag returns to rest)."""

from __future__ import annotations

import random
from collections import defaultdict, deque

from fake_cuda import FLAG_BASE

from torch_commopt.kernels.gpu import symm


class Deadlock(AssertionError):
    pass


class Race(AssertionError):
    pass


class NotAtRest(AssertionError):
    pass


def _flag(address: int) -> tuple[int, int]:
    """(rank, int32 index) of a flag address."""
    return address // FLAG_BASE - 1, (address % FLAG_BASE) // 4


TOKENS = [(symm.FREE, symm.HALVES * symm.MAX_WORLD), (symm.A2A_FREE, 2 * symm.HALVES * symm.MAX_WORLD),
          (symm.RING_FREE, 2 * symm.HALVES), (symm.MOE_FREE, 2 * symm.MAX_WORLD)]
DATA_FLAGS = [(symm.DATA, 2 * symm.HALVES * symm.PHASE_SLOTS),  # DATA and DATA2 (matmul_ar's second phase)
              (symm.A2A_DATA, 2 * symm.HALVES * symm.MAX_WORLD), (symm.RING_DATA, 2 * symm.HALVES),
              (symm.MOE_DATA, 2 * symm.MAX_WORLD)]


def _within(index: int, regions) -> bool:
    return any(start <= index < start + size for start, size in regions)


def _data_flag(index: int) -> bool:
    """Whether the index is a data flag (raised by a sender, lowered by its reader)."""
    return _within(index, DATA_FLAGS)


def _pull_token(index: int, reader: int):
    """For a wait on shared-buffer data flag `index` (DATA/DATA2): (its source, the index in the
    source's flags of the FREE token `reader` gives back for that half); None for other flags."""
    offset = index - symm.DATA
    if not 0 <= offset < 2 * symm.HALVES * symm.PHASE_SLOTS:
        return None
    half = (offset // symm.PHASE_SLOTS) % symm.HALVES
    return (offset % symm.PHASE_SLOTS) // symm.MAX_CHUNKS, symm.FREE + half * symm.MAX_WORLD + reader


def _token(index: int) -> bool:
    """Whether the index is a token (1 while the peer has no unfinished reads)."""
    return _within(index, TOKENS)


class Machine:
    def __init__(self, runtimes, seed: int, shared_reads: bool = False):
        self.runtimes, self.rng = runtimes, random.Random(seed)
        self.mem: dict[tuple[int, int], int] = defaultdict(int)
        for rank in range(len(runtimes)):  # every token starts free
            for start, size in TOKENS:
                for index in range(start, start + size):
                    self.mem[rank, index] = 1
        self.records: set = set()
        # (reader, flag index) of data flags a reader waited for and has not lowered -> the
        # highest value waited for (the pieces up to it are being read)
        self.reading: dict = {}
        # every rank's symmetric buffers: the shared one and those an op owns (the attention's)
        self.buffers = [[(b.local.data_ptr(), b.nbytes) for b in [rt.buffers[0], *(
            bufs[0] for bufs in getattr(rt, "owned", {}).values())]] for rt in runtimes]
        # (reader, flag index) -> [(value, byte intervals)]: what copies tagged with that flag and
        # value wrote since they were last read
        self.landed: dict = defaultdict(list)
        self.read_bytes: dict = {}  # piece being read -> the byte intervals it is read from
        self.own_copies: dict = defaultdict(list)  # rank -> what its untagged writes wrote into its buffers
        # (source, index of the token the reader gives back in the source's flags) -> (reader,
        # the byte intervals of the source's buffer it pulls): pulls waited for, token not back
        self.pulls: dict = {}
        # the buffers ops own (the attention's), whose every write is a recorded copy: reads are
        # checked there (the shared one's too where asked: a fused kernel's stores go unrecorded)
        self.owned = [[(b.local.data_ptr(), b.nbytes) for bufs in getattr(rt, "owned", {}).values()
                       for b in bufs[:1]] for rt in runtimes]
        self.shared = [(rt.buffers[0].local.data_ptr(), rt.buffers[0].nbytes) for rt in runtimes]
        if shared_reads:  # the shared buffer too (its every write a recorded copy or store)
            self.owned = [spans + [shared] for spans, shared in zip(self.owned, self.shared)]

    def ready(self, rank: int, op) -> bool:
        kind = op[0]
        if kind == "wait":
            value = self.mem[_flag(op[1])]
            return ((value - op[2]) & 0xFFFFFFFF) < (1 << 31)
        if kind == "wait_event":
            return op[2] == 0 or (rank, op[1], op[2]) in self.records
        return True

    def execute(self, rank: int, op) -> None:
        kind = op[0]
        if kind == "write":
            owner, index = _flag(op[1])
            self.mem[owner, index] = op[2] & 0xFFFFFFFF
            if owner == rank and op[2] == 0:  # a reader lowers a data flag: its reads of that piece are done
                self.reading.pop((rank, index), None)
                self.read_bytes.pop((rank, index), None)
            elif op[2] != 0:  # a token given back: the reader's pulls of that half are done
                self.pulls.pop((owner, index), None)
        elif kind == "wait":
            self._waited(rank, op)
        elif kind == "record":
            self.records.add((rank, op[1], op[2]))
        elif kind in ("copy", "store"):
            self._write(rank, op)

    def _waited(self, rank: int, op) -> None:
        """A wait passed: on a data flag of the rank's own, the pieces landed up to its value are
        being read; the pulls attached to it (_attach_pulls) are pending until the token."""
        owner, index = _flag(op[1])
        if owner == rank and _data_flag(index):
            key = rank, index
            self.reading[key] = max(self.reading.get(key, 0), op[2])
            pending = self.landed.pop(key, [])
            self.read_bytes.setdefault(key, []).extend(s for v, spans in pending if v <= op[2] for s in spans)
            later = [(v, spans) for v, spans in pending if v > op[2]]
            if later:
                self.landed[key] = later
        for source, token, spans in op[3] if len(op) > 3 else ():
            self.pulls.setdefault((source, token), (rank, []))[1].extend(spans)

    def _write(self, rank: int, op) -> None:
        """A copy or store by `rank`: its reads checked, then its writes (module docstring)."""
        piece, value = _tag(op)
        self._check_read(rank, op[4])
        verb = "copies" if op[0] == "copy" else "stores"
        if piece is not None and value <= self.reading.get(piece, 0):
            reader, index = piece
            raise Race(f"rank {rank} {verb} the piece of data flag {index} into rank {reader}'s buffer while "
                       f"rank {reader} still reads what was there")
        owner = self._owner(op[1])
        self._check_pending(rank, op, owner, verb)
        if piece is not None:
            self.landed[piece].append((value, op[3]))
        elif owner == rank:
            self.own_copies[rank].extend(op[3])

    def _check_pending(self, rank: int, op, owner, verb: str) -> None:
        """Race if the write covers bytes of `owner`'s buffer that a reader still reads: a piece
        waited for, one landed and not yet read, or one a peer still pulls."""
        tag = _tag(op)
        piece = tag[0]
        for (reader, index), spans in self.read_bytes.items():
            if reader == owner and _overlap(op[3], spans):
                raise Race(f"rank {rank} {verb} into rank {reader}'s buffer (piece {piece}) over bytes rank "
                           f"{reader} still reads as the piece of data flag {index}")
        for (reader, index), pending in self.landed.items():
            for v, spans in pending:
                if reader == owner and tag != ((reader, index), v) and _overlap(op[3], spans):
                    raise Race(f"rank {rank} {verb} into rank {reader}'s buffer (piece {piece}) over bytes "
                               f"that landed as piece {v} of data flag {index}, not yet read")
        for (source, token), (reader, spans) in self.pulls.items():
            if source == owner and _overlap(op[3], spans):
                raise Race(f"rank {rank} {verb} into rank {source}'s buffer over bytes rank {reader} still "
                           f"pulls from there (its token {token} of rank {source} not given back yet)")

    def _check_read(self, rank: int, reads) -> None:
        """A copy by `rank` reading `reads`: those in its own symmetric buffers must have landed
        (Early read in the module docstring)."""
        mine = [(s, e) for s, e in reads if any(base <= s < base + size for base, size in self.owned[rank])]
        if not mine:
            return
        present = [span for (reader, _), spans in self.read_bytes.items() if reader == rank for span in spans]
        present += [span for (reader, _), pending in self.landed.items() if reader == rank
                    for _, spans in pending for span in spans]
        uncovered = _uncovered(mine, present + self.own_copies[rank])
        if uncovered:
            raise Race(f"rank {rank} reads bytes {uncovered[0]} of its buffer before any piece landed there")

    def _owner(self, address: int):
        """The rank whose symmetric buffer holds `address` (None: ordinary memory)."""
        for rank, spans in enumerate(self.buffers):
            if any(base <= address < base + size for base, size in spans):
                return rank
        return None

    def _pieces(self, ops: list) -> list:
        """Each copy or store into a rank's buffer annotated with the (rank, data flag, value) the
        stream raises next for that rank: the piece the write lands."""
        out, nxt = [], None
        for op in reversed(ops):
            if op[0] == "write" and op[2] != 0 and _data_flag(_flag(op[1])[1]):
                nxt = (*_flag(op[1]), op[2])
            if op[0] in ("copy", "store") and nxt is not None:
                if any(base <= op[1] < base + size for base, size in self.buffers[nxt[0]]):
                    op = op + (nxt,)
            out.append(op)
        return out[::-1]

    def _attach_pulls(self, rank: int, ops: list) -> list:
        """Each of `rank`'s copies out of another rank q's shared buffer (a ce_pull) attached to
        the wait before it, on the same stream, on a data flag from q: that wait gets a fourth
        element, (q, the token `rank` gives q back for the flag's half, the bytes pulled) per
        pull, which it holds pending from when it passes (module docstring)."""
        out, last = list(ops), {}  # source -> position of the latest wait on a data flag from it
        for i, op in enumerate(out):
            if op[0] == "wait" and _flag(op[1])[0] == rank:
                pull = _pull_token(_flag(op[1])[1], rank)
                if pull is not None:
                    last[pull[0]] = i
            if op[0] != "copy" or not last:  # no pull without a wait on a data flag before it
                continue
            for source in {self._shared_owner(s) for s, _ in op[4]} - {rank, None}:
                if source in last:
                    spans = tuple(span for span in op[4] if self._shared_owner(span[0]) == source)
                    wait = out[last[source]]
                    token = _pull_token(_flag(wait[1])[1], rank)[1]
                    out[last[source]] = wait[:3] + ((*(wait[3] if len(wait) > 3 else ()), (source, token, spans)),)
        return out

    def _shared_owner(self, address: int):
        """The rank whose shared symmetric buffer (the matmul schedules') holds `address`."""
        for rank, (base, size) in enumerate(self.shared):
            if base <= address < base + size:
                return rank
        return None

    def run(self, queue) -> None:
        ops: dict = defaultdict(list)
        for rank, stream, op in queue:
            ops[rank, stream].append(op)
        streams = {key: deque(self._attach_pulls(key[0], self._pieces(stream_ops)))
                   for key, stream_ops in ops.items()}
        while True:
            busy = [key for key, ops in streams.items() if ops]
            if not busy:
                break
            movable = [key for key in busy if self.ready(key[0], streams[key][0])]
            if not movable:
                heads = {f"rank {k[0]} stream {k[1]}": (streams[k][0][0], *_describe(streams[k][0])) for k in busy}
                raise Deadlock(f"no stream can move: {heads}")
            key = self.rng.choice(movable)
            self.execute(key[0], streams[key].popleft())

    def check_at_rest(self) -> None:
        bad = {}
        for (rank, index), value in self.mem.items():
            if _token(index) and value != 1 or _data_flag(index) and value != 0:
                bad[f"rank {rank} flag {index}"] = value
        if bad:
            raise NotAtRest(f"flags not at rest after every call: {bad}")


def _tag(op) -> tuple:
    """(piece, value) a write lands (_pieces), or (None, 0) for an untagged one."""
    return (op[5][:2], op[5][2]) if len(op) > 5 else (None, 0)


def _uncovered(reads, spans) -> list:
    """The intervals of `reads` not wholly inside the union of `spans`."""
    merged: list = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in reads if not any(ms <= s and e <= me for ms, me in merged)]


def _overlap(a, b) -> bool:
    """Whether two lists of [start, end) byte intervals share a byte."""
    return any(s0 < e1 and s1 < e0 for s0, e0 in a for s1, e1 in b)


def _describe(op) -> tuple:
    if op[0] in ("wait", "write"):
        return (*_flag(op[1]), op[2])
    return op[1:]


def simulate(queue, runtimes, seed: int, shared_reads: bool = False) -> None:
    """Run `queue` (fake_cuda's) on a machine of len(runtimes) GPUs; raise on a deadlock, a
    race or flags not at rest.  shared_reads: copies out of the shared symmetric buffer are
    checked for early reads too (module docstring)."""
    machine = Machine(runtimes, seed, shared_reads)
    machine.run(queue)
    machine.check_at_rest()
