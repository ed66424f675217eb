"""The budget's fit rule, in one place: what an estimate, a probe and a probe's ceiling must keep within.

A `Budget` is a value: its bytes, the meter that counts them (`plans.METERS`), the share kept free (`margin`) and,
under a measured meter once the first probe has measured the process, what the process holds besides the
estimated tensors (`overhead`) and what a whole run adds to a probe's peak (`growth`). The planner makes a new
`Budget` when it learns those (`with_process`), never changes one (docs/plan.md, 'How "fits" is decided').
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from looptrain.planning.plans import METERS

# Under a measured meter, what a whole run adds to one probe's peak, as a share of the memory that probe measured
# besides the tensors: later updates' other widths, the allocator's retained blocks, evaluation and checkpoint
# saving. A quarter covers the growth measured on the test suite's and the benchmark's BERTs (docs/plan.md,
# 'How "fits" is decided').
RUN_GROWTH = 0.25


def run_growth(measured_peak: int, estimated_peak: int) -> int:
    """What a whole run may add to one probe's measured peak: `RUN_GROWTH` of what it measured besides the tensors."""
    return int(RUN_GROWTH * max(0, measured_peak - estimated_peak))


@dataclass(frozen=True)
class Budget:
    """The memory a run may take, by its meter, and the rule that decides what fits it.

    Attributes:
        bytes: what the run's peak may take, by `meter`.
        margin: the share kept free: a peak fits when it, times ``1 + margin``, is within `bytes`.
        meter: `plans.METERS`' key: "tensors" (the estimate alone decides), "rss" or "cuda_reserved" (measured: each
            candidate's probe must fit too).
        overhead: a measured meter: what the process holds besides the estimated tensors (the first probe's
            measure), charged to every estimate; its `growth` included.
        growth: a measured meter: kept free above each probe's peak for what the run adds (`run_growth`).
    """

    bytes: int
    margin: float
    meter: str = "tensors"
    overhead: int = 0
    growth: int = 0

    @property
    def measured(self) -> bool:
        """Whether probes measure the meter (every candidate's memory is then confirmed by its probe)."""
        return self.meter != "tensors"

    @property
    def words(self) -> str:
        """How the plan names the meter: ``of process RSS above the start``."""
        return METERS[self.meter]

    def within(self, peak: int) -> bool:
        """Whether an estimated `peak` fits, with what the process holds besides tensors, and the margin."""
        return (peak + self.overhead) * (1 + self.margin) <= self.bytes

    def fits_measured(self, peak: int, growth: int) -> bool:
        """Whether a probe's measured `peak` fits: with the run's `growth` and the margin, within the bytes."""
        return (peak + growth) * (1 + self.margin) <= self.bytes

    def decides(self, estimated_peak: int) -> bool:
        """Whether the estimate alone decides that a candidate fits, with room to spare, so that its probe need not
        measure its memory: under the tensors meter always (the estimate is the verdict); under a measured meter,
        once the first probe measured the process, when it fits with what the process holds besides tensors counted
        twice (that share grows with the micro-batch: 0.27 GiB at 1 row, 0.69 GiB at 16, on worked example 2)."""
        if not self.measured:
            return True
        return self.overhead > 0 and self.within(estimated_peak + self.overhead)

    def probe_fits(self, probe: dict, growth: int | None = None) -> bool:
        """A probe's verdict: its measured peak fits (`fits_measured`, with `growth`, default the budget's own); one
        stopped at its ceiling never does (its recorded peak, one byte past the ceiling, could round within), one
        that measured nothing (the tensors meter) always does."""
        if probe.get("stopped"):
            return False
        peak = probe.get("measured_peak_bytes")
        return peak is None or self.fits_measured(peak, self.growth if growth is None else growth)

    def first_probe_fits(self, probe: dict, estimated_peak: int) -> bool:
        """`probe_fits` of the first probe, whose growth is its own: `run_growth` of what it measured above its
        estimate."""
        return self.probe_fits(probe, run_growth(probe.get("measured_peak_bytes", 0), estimated_peak))

    def probe_ceiling(self) -> int:
        """The most a probe may measure and fit (`fits_measured`), where the probe stops: a probe that goes past
        has already taken the process past what fits, and left unchecked goes on past the budget itself
        (docs/plan.md, 'How "fits" is decided')."""
        return int(self.bytes / (1 + self.margin)) - self.growth

    def first_probe_ceiling(self, estimated_peak: int) -> int:
        """`probe_ceiling` of the first probe, whose growth is not known before it is measured: it is `RUN_GROWTH`
        of what the probe measures above its estimate, so the most it may measure and fit solves
        ``(peak + RUN_GROWTH * (peak - estimated_peak)) * (1 + margin) <= bytes``; ``bytes / (1 + margin)`` where
        the estimate alone is past that."""
        within = self.bytes / (1 + self.margin)
        if estimated_peak > within:
            return int(within)
        return int((within + RUN_GROWTH * estimated_peak) / (1 + RUN_GROWTH))

    def with_process(self, measured_peak: int, estimated_peak: int) -> Budget:
        """This budget once a probe measured `measured_peak` where its estimate said `estimated_peak`: what the
        process holds besides the tensors and the run's growth, charged to every estimate from then on."""
        growth = run_growth(measured_peak, estimated_peak)
        return dataclasses.replace(self, overhead=max(0, measured_peak - estimated_peak) + growth, growth=growth)

    def with_overhead(self, overhead: int) -> Budget:
        """This budget with what the process holds besides tensors measured as `overhead` (no growth)."""
        return dataclasses.replace(self, overhead=overhead)

    @property
    def besides(self) -> int:
        """What the process holds besides the estimated tensors, as measured (`overhead` less the growth)."""
        return self.overhead - self.growth
