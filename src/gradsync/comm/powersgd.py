"""PowerSGD: rank-r approximations of the gradient matrices, with error feedback and warm start.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (Algorithm 1). For each gradient reshaped to an n x m
matrix ``M`` (this rank's share plus its error from the last step), with ``Q`` (m x r) kept from
the previous step (warm start):

    P = M Q;  all-reduce P;  P <- orthonormal columns of P
    Q = M^T P;  all-reduce Q;  approximation A = P Q^T      (of the sum over ranks of M)
    error <- M - A / N                                      (error feedback)

so each step sends (n + m) r numbers per matrix instead of n m, and what one step leaves out is
added to the next one's gradient: the sum of the applied updates follows the sum of the true
gradients. Vectors (biases, norms) and matrices too small to gain ``min_compression_rate``
travel uncompressed, together with the bucket's used flags and step tags, in the first of the
two all-reduces of each bucket: those come back exact.

The state (each matrix's ``Q`` and this rank's ``error``) is kept *per parameter*, keyed by
name, in the :class:`PowerSGD` object the user passes as ``compression=``: it does not depend on
buckets (torch's PowerSGD hook keys it by bucket index, so a bucket re-plan silently resets or
mismatches it: pytorch issues #49418, #75666), so it survives ``no_sync()``, a re-wrap with
another ``bucket_cap_mb`` (pass the same object) and a checkpoint (the wrapper's
``sync_state_dict()`` carries it; ``error`` differs per rank and is saved per rank).
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import CommStats, Handle
from gradsync.comm.compress import all_reduce_wire_bytes
from gradsync.comm.hook import BucketLike, CommHook, tail
from gradsync.comm.worker import SerialWorker
from gradsync.errors import UsageError


class PowerSGD:
    """PowerSGD settings and state; pass it as ``DistributedDataParallel(compression=...)``.

    Args:
        rank: the rank r of each matrix approximation (Vogels et al. use 1-4).
        min_compression_rate: compress a matrix only if ``n m >= rate (n + m) r``.
        start_iter: synchronised steps reduced exactly (plain all-reduce) before compression
            starts; early training is the most sensitive to approximate gradients.
        seed: seeds each parameter's initial ``Q`` (the same on every rank).

    One object per model: its state is keyed by parameter name.
    """

    def __init__(
        self,
        rank: int = 4,
        *,
        min_compression_rate: float = 2.0,
        start_iter: int = 0,
        seed: int = 0,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise UsageError(f"PowerSGD rank must be an integer >= 1, got {rank!r}")
        rate_ok = isinstance(min_compression_rate, (int, float)) and min_compression_rate >= 0
        if isinstance(min_compression_rate, bool) or not rate_ok:
            raise UsageError(
                f"min_compression_rate must be a number >= 0, got {min_compression_rate!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise UsageError(f"PowerSGD seed must be an integer in [0, 2**32), got {seed!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise UsageError(f"start_iter must be an integer >= 0, got {start_iter!r}")
        self.rank = rank
        self.min_compression_rate = float(min_compression_rate)
        self.start_iter = start_iter
        self.seed = seed
        self.step = 0  # synchronised reductions so far
        self.q: dict[str, torch.Tensor] = {}  # m x r per compressed matrix, equal on every rank
        self.error: dict[str, torch.Tensor] = {}  # n x m, this rank's
        self._owner: weakref.ref[object] | None = None  # the module this state belongs to

    def __getstate__(self) -> dict[str, Any]:
        """A copy (with a pickled or deep-copied wrapper) serves the model copied with it."""
        return {**self.__dict__, "_owner": None}

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.rank}, min_compression_rate={self.min_compression_rate}, "
            f"start_iter={self.start_iter}, seed={self.seed})"
        )

    def fingerprint(self) -> str:
        """The state every rank must hold alike (``step`` and each ``Q``), compared across ranks
        when a model is wrapped: a state loaded on one rank only would run different
        collectives (``start_iter``) or sum ``P = M Q`` over different ``Q`` (garbage)."""
        crc = 0
        for name in sorted(self.q):
            crc = zlib.crc32(name.encode(), crc)
            raw = self.q[name].detach().cpu().contiguous().view(-1).view(torch.uint8)
            crc = zlib.crc32(raw.numpy().tobytes(), crc)
        return f"step {self.step}, Q of {len(self.q)} matrices (crc32 {crc:08x})"

    def matrix_shape(self, shape: torch.Size) -> tuple[int, int] | None:
        """``(n, m)`` of a gradient of ``shape`` if it is compressed, else ``None``."""
        if len(shape) < 2 or shape.numel() == 0:
            return None
        n = shape[0]
        m = shape.numel() // n
        r = min(n, m, self.rank)
        return (n, m) if n * m >= self.min_compression_rate * (n + m) * r else None

    def bind(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        grad_dtype: torch.dtype | None = None,
        owner: object = None,
    ) -> None:
        """Create the state of every compressed parameter not seen before (kept across
        re-wraps of ``owner``, the wrapped module); a parameter whose shape changed since is
        refused, and so is a second live model: the state is keyed by parameter name, so two
        models would share (and corrupt) each other's. A model wrapped after the one served
        is gone (a sweep in one process) starts from a fresh state, as with a new object: the
        old error feedback would be added to its gradients. The state is kept in
        ``grad_dtype`` (the buckets' dtype: ``main_grad_dtype``) or else each parameter's own."""
        previous = self._owner() if self._owner is not None else None
        if previous is not None and owner is not None and previous is not owner:
            raise UsageError(
                "this PowerSGD object already serves another model that is still alive (its "
                "state is kept per parameter name); give each wrapped model its own PowerSGD"
            )
        if previous is None and self._owner is not None and owner is not None:
            self.step, self.q, self.error = 0, {}, {}  # the model served is gone
        if owner is not None:
            self._owner = weakref.ref(owner)
        for name, param in named_params:
            shape = self.matrix_shape(param.shape)
            if shape is None:
                continue
            n, m = shape
            r = min(n, m, self.rank)
            dtype = grad_dtype or param.dtype
            if name in self.q:
                if self.q[name].shape != (m, r) or self.error[name].shape != (n, m):
                    raise UsageError(
                        f"PowerSGD holds state for parameter '{name}' of another shape; use a "
                        "new PowerSGD object for a different model"
                    )
                if self.error[name].dtype != dtype:
                    raise UsageError(
                        f"PowerSGD holds state for parameter '{name}' in "
                        f"{self.error[name].dtype}, its gradients are now {dtype}; use a new "
                        "PowerSGD object"
                    )
                continue
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            q = torch.randn(m, r, generator=g, dtype=torch.float64)
            self.q[name] = q.to(device=param.device, dtype=dtype)
            self.error[name] = torch.zeros(n, m, device=param.device, dtype=dtype)

    def state_dict(self, rank: int) -> dict[str, Any]:
        """``step`` and ``q`` (the same on every rank) and ``error.rank<r>`` (this rank's):
        live tensors, keys that a DCP checkpoint of all ranks keeps apart."""
        return {"step": self.step, "q": dict(self.q), f"error.rank{rank}": dict(self.error)}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        """Restore what :meth:`state_dict` returned on this rank; checked whole before
        anything is overwritten, so a refused load leaves the state as it was."""
        problem = self.load_problem(state, rank)
        if problem is not None:
            raise UsageError(problem)
        self.step = int(state["step"])
        for target, source in ((self.q, state["q"]), (self.error, state[f"error.rank{rank}"])):
            for name, value in source.items():
                if target[name] is not value:
                    target[name].copy_(value)

    def load_problem(self, state: dict[str, Any], rank: int) -> str | None:
        """Why ``state`` cannot be loaded on ``rank``, or ``None``."""
        key = f"error.rank{rank}"
        if key not in state:
            saved = sorted(k for k in state if k.startswith("error.rank"))
            return (
                f"the PowerSGD state holds the error buffers of {saved}, not of rank {rank}: "
                "they differ per rank, so every rank must load what it saved itself "
                "(sync_state_dict() on every rank; gradsync.checkpoint.Checkpointer does this)"
            )
        for what, target, source in (("Q", self.q, state["q"]), ("error", self.error, state[key])):
            if set(source) != set(target):
                extra, missing = (
                    sorted(set(source) - set(target)),
                    sorted(set(target) - set(source)),
                )
                parts = [f"{what} of {extra} saved, not compressed here"] if extra else []
                parts += [f"{what} of {missing} compressed here, not saved"] if missing else []
                return "the PowerSGD state does not fit this model: " + "; ".join(parts)
            for name, value in source.items():
                if target[name].shape != value.shape:
                    return f"PowerSGD state for '{name}' does not fit this model"
        return None


def orthonormalize(p: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of ``p`` (n x r, r small) in place; a zero column stays
    zero (a zero gradient then gives a zero approximation instead of NaN)."""
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(col.norm().clamp_min(tiny))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))


class PowerSGDHook(CommHook):
    """Reduces one bucket with PowerSGD: two all-reduces, on a worker thread (see
    [Note: the bucket communication seam], rule 5). ``stats`` counts bytes sent."""

    def __init__(
        self,
        config: PowerSGD,
        names: Sequence[str],
        group: dist.ProcessGroup | None,
        *,
        keep_undo: bool = False,
    ) -> None:
        self.config = config
        self.names = list(names)  # of the wrapper's trainable parameters, by index
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = CommStats()
        self._worker = SerialWorker("gradsync-powersgd")
        # With keep_undo (check_finite=True) each step first copies the state it is about to
        # change, for discard_step: one pass over the error buffers and as much memory again.
        self._undo: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = {} if keep_undo else None
        self._undo_step: int | None = None  # config.step before this step
        self._changed: list[str] = []  # parameters whose state this step changed

    def start(self, bucket: BucketLike) -> Handle:
        return self._worker.submit(lambda: self._reduce(bucket))

    def state_dict(self) -> dict[str, Any]:
        return self.config.state_dict(self.rank)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.config.load_state_dict(state, self.rank)

    def load_problem(self, state: dict[str, Any]) -> str | None:
        return self.config.load_problem(state, self.rank)

    def _all_reduce(self, flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=self.group)
        self.stats.calls += 1
        nbytes = all_reduce_wire_bytes(flat.numel(), flat.element_size(), self.world_size)
        self.stats.bytes_sent += nbytes
        self.stats.bytes_received += nbytes

    def discard_step(self) -> None:
        """The step's reduction was refused (NaN/Inf): put back the state it changed, so
        that skipping the step also skips it for PowerSGD (a NaN kept in an error buffer
        would otherwise poison every later step)."""
        if self._undo is None or self._undo_step is None:
            return
        self.config.step = self._undo_step
        for name in self._changed:
            error, q = self._undo[name]
            self.config.error[name].copy_(error)
            self.config.q[name].copy_(q)
        self._changed.clear()

    def _save_undo(self, names: Sequence[str]) -> None:
        assert self._undo is not None
        for name in names:
            error, q = self.config.error[name], self.config.q[name]
            if name not in self._undo:
                self._undo[name] = (torch.empty_like(error), torch.empty_like(q))
            self._undo[name][0].copy_(error)
            self._undo[name][1].copy_(q)
        self._changed += names

    def _reduce(self, bucket: BucketLike) -> None:
        config = self.config
        if bucket.spec.index == 0:  # bucket 0 is the first of every step
            self._undo_step, self._changed = config.step, []
            config.step += 1  # this reduction's number
        compress = config.step > config.start_iter
        matrices, plain = [], []
        for slot, i in enumerate(bucket.spec.param_indices):
            name, view = self.names[i], bucket.views[slot]
            if compress and name in config.q:
                matrices.append((name, slot, view.view(config.error[name].shape)))
            else:
                plain.append(view)
        if self._undo is not None:
            self._save_undo([name for name, _, _ in matrices])
        # Error feedback: each gradient's bucket slot now holds M = gradient + error. The
        # error buffer itself changes only at the end, so a parameter that turns out to be
        # unused on every rank keeps it as it was.
        ms = [grad.add_(config.error[name]) for name, _, grad in matrices]
        # P^T = Q^T M^T rather than P = M Q (and Q^T = P^T M below rather than M^T P): the
        # same products, but BLAS runs these layouts 2-5x faster when r is this small
        # (benchmarks/2026-11-23-wire.md); P's columns are P^T's rows.
        pts = [
            torch.mm(config.q[name].T, m.T) for (name, _, _), m in zip(matrices, ms, strict=True)
        ]
        exact = tail(bucket)
        first = torch.cat([v.reshape(-1) for v in plain] + [exact] + [p.reshape(-1) for p in pts])
        self._all_reduce(first)  # uncompressed gradients, flags and tags (exact), and the Ps
        _unpack(first, [*plain, exact, *pts])
        if not matrices:
            return
        used = exact[: len(bucket.spec.param_indices)].tolist()  # ranks that used each slot
        for pt in pts:
            orthonormalize(pt.T)
        qts = [torch.mm(pt, m) for pt, m in zip(pts, ms, strict=True)]
        second = torch.cat([q.reshape(-1) for q in qts])
        self._all_reduce(second)
        _unpack(second, qts)
        for (name, slot, m), pt, qt in zip(matrices, pts, qts, strict=True):
            if used[slot] == 0:
                # Unused on every rank (find_unused_parameters): .grad stays untouched, so
                # nothing is applied, and its error and Q stay what they were.
                m.zero_()
                continue
            error = config.error[name].copy_(m)
            torch.mm(pt.T, qt, out=m)  # the approximation A = P Q^T of the sum, in place
            config.q[name].copy_(qt.T)  # warm start
            # Share the residual of the sum equally: the ranks' errors add up to sum(M) - A.
            error.sub_(m, alpha=1.0 / self.world_size)


def _unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` back into ``tensors``."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
