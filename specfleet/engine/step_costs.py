"""What a step costs, measured as the engine runs: the basis for keeping mixed steps short.

A step's time is close to a + b * rows on both devices: a fixed part (the weight stream and the
per-layer work of a decode step) and a per-row part (compute, which dominates a prompt chunk). Two
running averages track them: `decode_s` over steps of a few rows, `row_s` (time beyond a decode
step, per extra row) over steps of many rows. `row_cap(factor)` is then the number of rows a step
may carry to cost about `factor` decode steps; the scheduler caps prompt chunks with it while other
requests decode or wait (engine/scheduler.py), so a long prompt slows them by about that factor
instead of stalling them for a whole token budget's worth of prefill.
"""
from __future__ import annotations

SMALL_ROWS = 8  # steps of at most this many rows measure the decode step
LARGE_ROWS = 64  # steps of at least this many rows measure the per-row cost


class StepCostModel:
    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.decode_s: float | None = None  # running average of small steps' time
        self._large: tuple[float, float] | None = None  # running averages of large steps' (rows, seconds)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def record(self, rows: int, seconds: float) -> None:
        if rows <= SMALL_ROWS:
            self.decode_s = self._avg(self.decode_s, seconds)
        elif rows >= LARGE_ROWS:  # kept apart, so a prefill measured before any decode step still counts
            old = self._large
            self._large = (self._avg(None if old is None else old[0], rows),
                           self._avg(None if old is None else old[1], seconds))

    @property
    def row_s(self) -> float | None:
        """Time per row beyond a decode step, from the large steps; None until both kinds were seen."""
        if self.decode_s is None or self._large is None:
            return None
        rows, seconds = self._large
        return max(seconds - self.decode_s, 0.0) / (rows - 1)

    def row_cap(self, factor: float) -> int | None:
        """Rows in a step that costs about `factor` decode steps; None until both parts are measured."""
        row_s = self.row_s
        if row_s is None or row_s <= 0:
            return None
        return 1 + int((factor - 1.0) * self.decode_s / row_s)
