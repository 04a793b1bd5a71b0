"""What a step costs, measured as the engine runs: the basis for keeping mixed steps short.

A step's time is close to a + b * rows on both devices: a fixed part (the weight stream and the
per-layer work of a decode step) and a per-row part (compute, which dominates a prompt chunk). Steps
are kept in bins by their number of rows (powers of two: 1, 2-3, 4-7, ...), each bin a running
average of (rows, seconds); averaging keeps a point on the line, and a bin is only updated by steps of
its own size, so a rare prefill is not forgotten among many decode steps. The *decode step* is the
bin of fewest rows (a one-row step at batch 1; at batch 16 the 16-row decode step, with its drafts),
`row_s` the slope from it to the bin of most rows, once they are LARGE_ROWS - SMALL_ROWS rows apart.
`row_cap(factor)` is then the number of rows a step may carry to cost about `factor` decode steps;
the scheduler caps prompt chunks with it while other requests decode or wait (engine/scheduler.py),
so a long prompt slows them by about that factor instead of stalling them for a whole token budget's
worth of prefill. This works at any batch size: a batch that decodes more than SMALL_ROWS rows from
its first step still has decode steps smaller than its prefill steps.

`rows_within(seconds)` bounds every step, a lone prompt's too, to about `seconds` (the server sets
it, engine.py): a request that arrives during a long prefill waits for the step in flight, so that
step must be short; at steps of at least ~20 decode steps the fixed part costs the prefill a few %.
"""
from __future__ import annotations

FIRST_STEP_ROWS = 128  # a bounded step's rows before any step was measured (a fresh server's first prompt)
SMALL_ROWS = 8  # the decode step and the steps that measure the per-row cost are at least
LARGE_ROWS = 64  # LARGE_ROWS - SMALL_ROWS rows apart, so timing noise barely moves the slope


class StepCostModel:
    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._bins: dict[int, tuple[float, float]] = {}  # rows.bit_length() -> running avg (rows, seconds)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def record(self, rows: int, seconds: float) -> None:
        if rows < 1:
            return
        key = rows.bit_length()
        old = self._bins.get(key)
        self._bins[key] = (self._avg(None if old is None else old[0], rows),
                           self._avg(None if old is None else old[1], seconds))

    def _ends(self) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """(the decode step's bin, the largest steps' bin), or None until they are far enough apart."""
        if not self._bins:
            return None
        small, large = self._bins[min(self._bins)], self._bins[max(self._bins)]
        if large[0] - small[0] < LARGE_ROWS - SMALL_ROWS:
            return None
        return small, large

    @property
    def decode_rows(self) -> float | None:
        """Rows of the decode step (the smallest steps seen); None until both ends are measured."""
        ends = self._ends()
        return None if ends is None else ends[0][0]

    @property
    def decode_s(self) -> float | None:
        """Time of the decode step; None until both ends are measured."""
        ends = self._ends()
        return None if ends is None else ends[0][1]

    @property
    def row_s(self) -> float | None:
        """Time per row beyond a decode step; None until both ends are measured."""
        ends = self._ends()
        if ends is None:
            return None
        (r0, t0), (r1, t1) = ends
        return max(t1 - t0, 0.0) / (r1 - r0)

    def row_cap(self, factor: float) -> int | None:
        """Rows in a step that costs about `factor` decode steps; None until both parts are measured."""
        row_s = self.row_s
        if row_s is None or row_s <= 0:
            return None
        return int(round(self.decode_rows)) + int((factor - 1.0) * self.decode_s / row_s + 1e-9)

    def rows_within(self, seconds: float) -> int:
        """Rows a step may carry to take about `seconds`: from the measured line once both ends are known;
        before that from the largest steps seen, as if all their time were per row (so it errs short);
        FIRST_STEP_ROWS before any step was measured."""
        if not self._bins:
            return FIRST_STEP_ROWS
        row_s = self.row_s
        if row_s is not None and row_s > 0:
            return int(round(self.decode_rows)) + max(0, int((seconds - self.decode_s) / row_s + 1e-9))
        rows, t = self._bins[max(self._bins)]
        return max(1, int(seconds * rows / t + 1e-9)) if t > 0 else FIRST_STEP_ROWS

    @property
    def fixed_s(self) -> float | None:
        """About the fixed part of a step (the decode step's time, or the smallest steps' while the line is
        not yet known); None until a step of at most SMALL_ROWS rows was seen."""
        if self.decode_s is not None:
            return self.decode_s
        small = self._bins.get(min(self._bins)) if self._bins else None
        return small[1] if small is not None and small[0] <= SMALL_ROWS else None
