"""Schedules of a distributed operator, and their string form carried by the custom ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Schedule:
    """How a region runs.

    sequential: the collective, then the compute (NCCL + cuBLAS on the GPU).
    chunked(S): the collective cut into S pieces along one dimension, each piece
        consumed (or produced) by the compute as it arrives, so that transfer of
        piece j+1 overlaps the compute of piece j (MeshSlice slicing, Mercury shift).
    """

    name: str
    chunks: int = 1

    NAMES: ClassVar[tuple[str, ...]] = ("sequential", "chunked")

    def __post_init__(self) -> None:
        if self.name not in self.NAMES:
            raise ValueError(f"schedule: unknown name {self.name!r}; known: {self.NAMES}")
        if self.chunks < 1:
            raise ValueError(f"schedule: chunks must be >= 1, got {self.chunks}")

    def __str__(self) -> str:
        return self.name if self.name == "sequential" else f"{self.name}:{self.chunks}"

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        name, _, chunks = text.partition(":")
        if name not in cls.NAMES:
            raise ValueError(f"schedule: cannot parse {text!r}")
        return cls(name, int(chunks) if chunks else 1)

    def clamp(self, size: int) -> "Schedule":
        """The same schedule with at most `size` chunks (a dimension of `size` rows)."""
        if self.name == "chunked" and self.chunks > size:
            return Schedule(self.name, max(1, size))
        return self
