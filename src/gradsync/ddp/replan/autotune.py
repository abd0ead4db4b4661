"""``bucket_cap_mb="auto"``: profile the first steps, agree on a plan, switch at a step boundary.

[Note: switching the bucket plan]
Horovod's autotune once resized its fusion buffer while gradients were in flight and corrupted
them (horovod#1282). Here the plan changes once, at a point where no gradient of the coming step
exists yet, on every rank at the same point:

1. Profile. The wrapper starts with the default plan (torch's 25 MiB where the ranks share
   one host, "scaled" across hosts: [Note: the default bucket cap] in ``plan.py``; and the
   wrapper's first bucket cap). After ``WARMUP_STEPS``
   synchronised steps (first-call costs, allocations), an extra post-accumulate-grad hook per
   parameter notes ``perf_counter`` when the gradient is ready inside each of
   ``PROFILE_STEPS`` synchronised backwards (not under ``no_sync``). The hooks are removed
   after them; then ``TRIAL_STEPS`` more steps under the initial plan are timed whole (see 4).
2. Decide, at the first training forward after those steps' reduction that starts a new
   accumulation window (no window open: never inside a ``no_sync`` window, never inside
   a backward) outside ``join()``. ``num_reductions`` and the window are the same on every rank
   (the step tags check both), and eval forwards never get here (they may run on one rank), so
   every rank reaches this forward together. Then, under the wrapper's deadline: a few timed
   all-reduces of ``PROBE_BYTES`` on the wrapper's private group; ready times and probe times
   all-reduced with MAX (the slowest rank's step is the step); a plan from ``autoplan.py``;
   and rank 0's plan exchanged through ``Deadline.gather_objects`` and taken by every rank.
   The plan must be identical everywhere (a rank with other buckets would sum unrelated
   gradients or wait forever), so it is agreed on, never left to timings or floating point.
   Before any of that the ranks agree (MAX) on whether the module's parameter set differs
   from wrapping time on some rank (``ParameterWatch.changes``). The buckets describe the
   wrapping-time set, and a new reducer would hook the parameters trainable *now*: its buckets
   would index past its parameter list, or hold a parameter no gradient reaches. So no rank
   switches then; the step goes on under the current plan, whose step tags raise
   ``ParametersChangedError`` on every rank, naming the parameter, as without ``"auto"``. The
   switch is tried again at the next step boundary.
3. Switch. The wrapper installs a new :class:`Reducer` with the chosen buckets on the same
   parameter watch, comm hook and reduction (``Reducer.succeed``): ``num_reductions`` carries
   on, so step tags and checkpoints continue, and so does a window that an eval forward with
   grad opened before this training forward (its gradients are part of this step). Building it
   retires the old reducer. Every ``p.main_grad`` moves to its slot in the new buckets, and the
   wrapper's ``bucket_cap_mb`` becomes the cap the new buckets were planned with.
4. Keep it only if it is faster. The cost model times collectives on an idle machine; during a
   backward on a CPU the same collectives compete with it for the cores (gloo adds and copies
   on the CPU, and so does the kernel's network stack), which no fit of idle timings sees: on
   two loopback ranks sharing two cores, the model picked 2 MiB buckets that ran 5-10 % slower
   than 25 MiB ones. So the choice is a trial: the median of ``TRIAL_STEPS`` step times
   (training forward to training forward, ``_step_clock``) under the new plan against the
   median of as many steps just before the switch under the initial one (not the profiled
   steps: a job's first steps run slower, which would favour any new plan; measured 558 against
   394 ms on loopback), both all-reduced with MAX so that every
   rank compares the same two numbers; if the new plan was slower, every rank goes back to the
   initial plan at the next step boundary, by the same switch (not at one where the parameter
   set changed, as in 2). Either way the plan is final.

The gradients are the ones the fixed plan gives: each rank's contribution is copied (and
pre-divided, elementwise) into whichever bucket holds the parameter, and the all-reduce sums
each element over ranks. With two ranks that sum is ``a + b`` whatever the bucket, bit for bit.
With three or more, gloo's algorithms cut a buffer into pieces by its size, and the order in
which the ranks' values are added for one element can change with the bucket, which moves a
result by at most an ulp or so; the equivalence tests bound it.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from gradsync.ddp.plan import BucketSpec, grad_bytes
from gradsync.ddp.replan.autoplan import (
    CANDIDATE_CAPS_MB,
    BucketPlan,
    choose_plan,
    describe,
    fit_cost,
    predict_end,
)
from gradsync.failfast.deadline import Deadline

if TYPE_CHECKING:
    from gradsync.ddp.reducer import Reducer

# The wrapper's switch to buckets ``specs`` planned with a cap of ``cap_mb``: its reducer lays
# them out in place (see ``DDPState.adopt_plan`` in ``ddp/state.py``).
Adopt = Callable[[list[BucketSpec], "float | None"], None]

logger = logging.getLogger("gradsync")

WARMUP_STEPS = 1
PROFILE_STEPS = 3
TRIAL_STEPS = 3  # steps timed under the chosen plan before it is kept or given up
PROBE_BYTES = (1 << 12, 1 << 18, 1 << 22)  # all-reduce sizes timed to fit the cost model
PROBE_REPEATS = 3
_clock: Callable[[], float] = time.perf_counter  # the gradient hooks' clock
_step_clock: Callable[[], float] = time.perf_counter  # step boundaries' clock (the trial)


def measure_cost(deadline: Deadline, total_bytes: int, what: str) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of all-reduces on the wrapper's group: the median of
    ``PROBE_REPEATS`` timed calls per size, after one untimed call that lines the ranks up."""
    samples = []
    for nbytes in sorted({max(4, min(n, total_bytes)) for n in PROBE_BYTES}):
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=deadline.device)
        deadline.all_reduce(buf, what)
        times = []
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            deadline.all_reduce(buf, what)
            times.append(time.perf_counter() - start)
        samples.append((buf.numel() * 4, statistics.median(times)))
    return samples


def changed_anywhere(reducer: Reducer, what: str) -> bool:
    """Whether the parameter set differs from wrapping time on some rank (a collective: the
    same answer on every rank, so that all switch or none does)."""
    local_change = 1.0 if reducer.watch.changes() else 0.0
    flag = torch.tensor([local_change], dtype=torch.float64, device=reducer.deadline.device)
    reducer.deadline.all_reduce(flag, what, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0.0)


class AutoBuckets:
    """The runtime of ``bucket_cap_mb="auto"`` for one wrapper; see [Note: switching the bucket
    plan]. ``plan`` is ``None`` until the switch, then the :class:`BucketPlan` in use (on trial
    until ``settled``; ``trial`` then holds the two median step times compared)."""

    def __init__(self, first_bucket_cap_mb: float | None) -> None:
        self.first_cap_mb = first_bucket_cap_mb
        self.plan: BucketPlan | None = None
        self.chosen: BucketPlan | None = None  # what the cost model chose (tried if new)
        self.switched_at: int | None = None  # num_reductions when the plan took effect
        self.settled = False  # the plan is final: profiled, switched, tried
        self.trial: tuple[float, float] | None = None  # (initial plan, chosen plan) seconds
        self._start: int | None = None  # num_reductions at the first training forward
        self._times: dict[int, dict[int, float]] = {}  # profiled step -> param index -> clock
        self._marks: dict[int, float] = {}  # num_reductions -> _step_clock at that boundary
        self._initial: tuple[list[BucketSpec], BucketPlan] | None = None  # to go back to
        self._initial_s = -1.0  # median step under the initial plan, before the switch
        self._hooks: list[RemovableHandle] = []

    def before_forward(
        self,
        reducer: Reducer,
        joining: bool,
        sizes: list[tuple[int, torch.dtype]],
        cap_mb: float | None,
        adopt: Adopt,
    ) -> None:
        """Called by every training forward before its collectives: switch (through ``adopt``)
        if this is the step boundary (the same forward on every rank), else nothing.
        ``reducer``: the wrapper's; ``sizes``: ``(numel, dtype)`` of its parameters' gradients
        as the buckets hold them; ``cap_mb``: the cap its buckets were planned with."""
        if self.settled:
            return
        if self._start is None:
            self._start = reducer.num_reductions
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._recorder(reducer, i))
                for i, p in enumerate(reducer.params)
            ]
        if reducer.window_open or joining:
            return  # inside an accumulation window, or ranks may be missing: not here
        step = reducer.num_reductions
        self._marks[step] = _step_clock()
        profiled = self._start + WARMUP_STEPS + PROFILE_STEPS
        if self.switched_at is None:
            if step >= profiled:
                self._remove_hooks()
            if step >= profiled + TRIAL_STEPS:
                self._switch(reducer, sizes, cap_mb, adopt)
        elif step >= self.switched_at + TRIAL_STEPS:
            self._settle(reducer, adopt)

    def _median_step(self, first: int, count: int) -> float:
        """Median seconds of steps ``first .. first + count - 1`` (from each one's boundary to
        the next; ``-1`` if none was timed, e.g. while ranks had joined)."""
        times = [
            self._marks[k + 1] - self._marks[k]
            for k in range(first, first + count)
            if k in self._marks and k + 1 in self._marks
        ]
        return statistics.median(times) if times else -1.0

    def _recorder(self, reducer: Reducer, index: int) -> Callable[[torch.Tensor], None]:
        # Weak references, as the reducer's own hooks: see Reducer._take_over_parameters.
        me, watched = weakref.ref(self), weakref.ref(reducer)

        def record(param: torch.Tensor) -> None:
            auto, red = me(), watched()
            if auto is None or red is None or auto._start is None:
                return
            step = red.num_reductions - auto._start
            if red.reducing and WARMUP_STEPS <= step:  # till removed
                auto._times.setdefault(step, {})[index] = _clock()

        return record

    def ready_times(self, num_params: int) -> list[float]:
        """Per parameter, the median over profiled steps of when its gradient was ready,
        in seconds after the step's first; ``-1`` where it never had one on this rank."""
        per_param: list[list[float]] = [[] for _ in range(num_params)]
        for times in self._times.values():
            first = min(times.values())
            for i, t in times.items():
                per_param[i].append(t - first)
        return [statistics.median(ts) if ts else -1.0 for ts in per_param]

    def decide(
        self,
        reducer: Reducer,
        params: list[tuple[int, torch.dtype]],
        initial_cap_mb: float | None,
        what: str,
    ) -> tuple[BucketPlan, BucketPlan]:
        """Profile the collectives, agree on the timings and on rank 0's plan (collectives):
        the plan chosen for ``params`` (``(numel, dtype)`` as the wrapper's buckets hold them),
        and the initial plan (``initial_cap_mb``) as the same cost model sees it."""
        deadline = reducer.deadline
        samples = measure_cost(deadline, grad_bytes(params), what)
        values = self.ready_times(len(params)) + [t for _, t in samples]
        agreed = torch.tensor(values, dtype=torch.float64, device=deadline.device)
        deadline.all_reduce(agreed, what, op=dist.ReduceOp.MAX)
        merged = agreed.tolist()
        ready = merged[: len(params)]
        latest = max(ready, default=0.0)
        ready = [t if t >= 0.0 else max(latest, 0.0) for t in ready]  # never ready: at the end
        cost = fit_cost([(n, t) for (n, _), t in zip(samples, merged[len(params) :], strict=True)])
        firsts = [None] if self.first_cap_mb is None else [None, self.first_cap_mb]
        plan = choose_plan(params, ready, cost, caps_mb=CANDIDATE_CAPS_MB, first_caps_mb=firsts)
        specs = [b.spec for b in reducer.buckets]
        initial = BucketPlan(
            initial_cap_mb, self.first_cap_mb, len(specs), predict_end(specs, ready, cost), cost
        )
        agreed_plans: tuple[BucketPlan, BucketPlan] = deadline.gather_objects(
            (plan, initial), what
        )[0]  # rank 0's, on every rank
        return agreed_plans

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _switch(
        self,
        reducer: Reducer,
        sizes: list[tuple[int, torch.dtype]],
        cap_mb: float | None,
        adopt: Adopt,
    ) -> None:
        # The profiling hooks are gone already (removed at the end of the profiled steps).
        step = reducer.num_reductions
        if not reducer.params:
            self.switched_at, self.settled = step, True
            return
        what = f"the choice of the bucket plan (bucket_cap_mb='auto', step {step})"
        reducer.deadline.begin(what)
        if changed_anywhere(reducer, what):
            return  # none switches; this step raises ParametersChangedError (the Note, 2.)
        self.switched_at = step
        # The buckets' dtypes, not the parameters': fp32 for a bf16 model's main gradients.
        plan, initial_plan = self.decide(reducer, sizes, cap_mb, what)
        self.plan = self.chosen = plan
        self._initial = reducer.specs, initial_plan
        specs = plan.specs(sizes)
        if reducer.deadline.rank == 0:
            logger.info("bucket_cap_mb='auto' chose %s, from step %d", describe(plan), step)
        if specs == reducer.specs:
            self.settled = True  # the plan it has already: nothing to try
            return
        adopt(specs, plan.cap_mb)
        # The initial plan's last steps end where the choice began; the trial's first step
        # starts after it (the probes are in neither).
        self._initial_s = self._median_step(step - TRIAL_STEPS, TRIAL_STEPS)
        self._marks[step] = _step_clock()

    def _settle(self, reducer: Reducer, adopt: Adopt) -> None:
        """Keep the chosen plan if its steps were no slower than the initial plan's, else go
        back to the initial plan (every rank decides on the same MAX-reduced times)."""
        assert self.switched_at is not None and self._initial is not None
        step = reducer.num_reductions
        what = f"the trial of the bucket plan (bucket_cap_mb='auto', step {step})"
        reducer.deadline.begin(what)
        times = [self._initial_s, self._median_step(self.switched_at, TRIAL_STEPS)]
        times.append(1.0 if reducer.watch.changes() else 0.0)  # as changed_anywhere
        agreed = torch.tensor(times, dtype=torch.float64, device=reducer.deadline.device)
        reducer.deadline.all_reduce(agreed, what, op=dist.ReduceOp.MAX)
        initial_s, chosen_s, changed = agreed.tolist()
        if changed:
            return  # none switches; this step raises ParametersChangedError (the Note, 2.)
        self.settled = True
        self.trial = initial_s, chosen_s
        slower = 0.0 < initial_s < chosen_s
        if slower:
            specs, self.plan = self._initial
            adopt(specs, self.plan.cap_mb)
            self.switched_at = step
        if reducer.deadline.rank == 0:
            verdict = "went back to the initial plan" if slower else "kept the chosen plan"
            logger.info(
                "bucket_cap_mb='auto' %s from step %d (median step %.2f ms with it, %.2f ms "
                "with the initial %s)",
                verdict,
                step,
                chosen_s * 1e3,
                initial_s * 1e3,
                describe(self._initial[1]),
            )
