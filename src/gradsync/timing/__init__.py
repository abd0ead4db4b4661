"""Step timelines: each rank's phases per step, straggler reports, and profiler ranges."""

from gradsync.timing.attribution import Thresholds
from gradsync.timing.phases import PHASES, RankStep
from gradsync.timing.timeline import StepTimeline

__all__ = ["PHASES", "RankStep", "StepTimeline", "Thresholds"]
