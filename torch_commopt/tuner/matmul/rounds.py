"""The statistics of the tuner's timing rounds (autotune.measure_candidates): the order a round
times its candidates in, each candidate's figure paired with a reference's sample of the same
round, the median's distribution-free confidence interval; and the progress a measurement shows."""

from __future__ import annotations

import logging
import math
import random
import statistics
import sys

log = logging.getLogger("torch_commopt.tuner.matmul.autotune")  # the measurement's own logger name


def round_order(indices: list[int], round_: int, order: str, first_round: int = 0) -> list[int]:
    """The candidates `indices` in the order the `round_`-th of a run of rounds starting at
    measurement round `first_round` times them: rotated by `round_`, or ("shuffle") permuted by a
    generator seeded with the measurement round (every rank the same order: each sample is a
    collective call)."""
    if order == "shuffle":
        return random.Random(first_round + round_).sample(indices, len(indices))
    if order != "rotate":
        raise ValueError(f"commopt autotune: unknown round order {order!r} (rotate, shuffle)")
    return [indices[(j + round_) % len(indices)] for j in range(len(indices))]


def paired_ms(rows: list[tuple[int, str, float]], ref: str) -> dict[str, float]:
    """{schedule: ms}: `ref`'s median, times the median over rounds of the schedule's sample
    divided by ref's sample of the same round.  A round's candidates run within milliseconds of
    each other, so clocks and heat that move between rounds (a few percent within a second on a
    power-capped card) cancel in the ratio, where two medians taken over those rounds keep them."""
    ref_ms = statistics.median(ms for _, s, ms in rows if s == ref)
    out = {}
    for s in dict.fromkeys(s for _, s, _ in rows):
        ratios = round_ratios(rows, s, ref)
        out[s] = ref_ms * statistics.median(ratios) if ratios else math.inf
    return out


def round_ratios(rows: list[tuple[int, str, float]], num: str, den: str) -> list[float]:
    """num's sample over den's, in every round of `rows` (round, schedule, ms) that timed both."""
    by_round: dict[int, dict[str, float]] = {}
    for r, s, ms in rows:
        by_round.setdefault(r, {})[s] = ms
    return [row[num] / row[den] for row in by_round.values() if num in row and den in row]


def ratio_summary(rows: list[tuple[int, str, float]], num: str, den: str) -> dict[str, float] | None:
    """num / den per round (round_ratios): {"median", "lo", "hi" (its 95% CI, median_ci), "rounds"};
    None where no round timed both."""
    ratios = round_ratios(rows, num, den)
    if not ratios:
        return None
    lo, hi = median_ci(ratios)
    return {"median": statistics.median(ratios), "lo": lo, "hi": hi, "rounds": len(ratios)}


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median (order statistics of the sample,
    binomial(n, 1/2) coverage); (-inf, inf) where n is too small for the confidence."""
    xs, n = sorted(values), len(values)
    tail = (1.0 - confidence) / 2
    k, mass = 0, 0.0  # the largest k with P(Bin(n, 1/2) < k) <= tail
    while k < n and mass + math.comb(n, k) / 2**n <= tail:
        mass += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return -math.inf, math.inf
    return xs[k - 1], xs[n - k]


class Progress:
    """A progress bar on one rank: tqdm when it is installed, else a one-line bar on a
    terminal's stderr, else (not a terminal, or bar=False) log lines at INFO."""

    def __init__(self, total: int, desc: str, show: bool, bar: bool = True):
        self.total, self.desc, self.done, self.show = total, desc, 0, show
        self._tqdm, self._tty = None, False
        if not show or not bar:
            return
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc=desc, leave=False)
        except ImportError:
            self._tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        if not self.show:
            return
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(what, refresh=False)
            self._tqdm.update(1)
        elif self._tty:
            filled = int(20 * self.done / self.total)
            sys.stderr.write(f"\r{self.desc} [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} {what:<24}")
            sys.stderr.flush()
        else:
            log.info("%s: %d/%d %s", self.desc, self.done, self.total, what)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.show and self._tty:
            sys.stderr.write("\r" + " " * (len(self.desc) + 60) + "\r")
            sys.stderr.flush()
