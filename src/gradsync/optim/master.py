"""fp32 master weights for a low-precision model: the optimizer half of mixed precision.

Pairs with ``DistributedDataParallel(model, main_grad_dtype=torch.float32)`` (see [Note: main
gradients] in ``gradsync/ddp/main_grads.py``). The model's parameters stay bf16 (what the
forward and backward compute with); this keeps an fp32 copy of each, steps the given optimizer
on those copies with each parameter's fp32 ``main_grad``, and rounds the result into the model.
Without it an optimizer stepping bf16 parameters loses every update smaller than half a bf16
step of the weight (e.g. ``lr * update < 2**-9 * |w|``): late in training, most of them.

[Note: parameters written outside the optimizer]
The fp32 masters are the weights; the model holds their rounding. A parameter written by
anything else (the wrapper's broadcast of rank 0's weights when a model is wrapped after the
optimizer was built, ``model.load_state_dict``, a user's ``p.copy_``) would be silently undone
by the next step, which rounds the stale master into it, and on ranks that started from other
weights the replicas would drift apart. So the parameter wins: at each :meth:`MasterWeights.step`
a parameter written since the optimizer last wrote it has its master replaced by its value,
widened (the optimizer's state, e.g. Adam's moments, is kept, as a torch optimizer keeps it
when the model is loaded). A write is seen in torch's in-place version counter
(``p._version``, recorded whenever the optimizer writes the parameter): a check that costs
nothing per step. Writes through ``.data`` do not bump it, so the first step also compares
every parameter with the rounding of its master, which catches the wrapper's broadcast. Later
``.data`` writes go unseen: write parameters in place (``with torch.no_grad(): p.copy_(...)``)
or build the optimizer anew. Loading the optimizer (:meth:`MasterWeights.load_state_dict`,
:meth:`MasterWeights.load_named_state_dict`, what :class:`gradsync.checkpoint.Checkpointer`
calls after ``model.load_state_dict``) writes the saved masters and their rounding into the
model and records the versions again, so a resume starts from the saved fp32 weights exactly.

[Note: clipping main gradients]
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` scales ``.grad``. An optimizer that
steps on ``main_grad`` (:class:`gradsync.optim.MasterWeights`) never reads ``.grad``, so that
clipping, or any other change to ``.grad`` between the backward and the step (a loss scaler's
unscale, a custom gradient filter), would be silently ignored: a loss spike goes through
unclipped. So after each reduction the wrapper records the in-place version of every
``.grad`` (:func:`stamp_grads`; a Python attribute, no device work), and ``MasterWeights.step``
refuses a ``.grad`` whose version moved since, naming the fix: ``opt.clip_grad_norm_``, which
clips ``main_grad`` (and ``.grad`` alike). torch's ``clip_grad_norm_`` scales every gradient
even when the norm is below the limit, so the refusal comes at the first step, not at the
first spike. Clearing ``.grad`` keeps torch's meaning: ``opt.zero_grad()`` or
``model.zero_grad()`` after the backward leaves ``.grad`` ``None``, and a parameter without a
``.grad`` is not stepped, whatever its ``main_grad`` holds; ``opt.zero_grad(set_to_none=False)``
zeroes ``main_grad`` with ``.grad``, so the step sees the zero gradient torch's would (a
``model.zero_grad(set_to_none=False)``, which zeroes ``.grad`` alone, is refused like a clip).

[Note: MasterWeights compares settings across ranks]
Each rank steps its own replica of the masters, so a learning rate set differently on one rank
makes the replicas drift apart, seen only by ``check_replicas()``. When the parameters belong
to a gradsync ``DistributedDataParallel``, the first :meth:`MasterWeights.step` compares every
param group's settings, and which parameters have a ``.grad``, over the wrapper's ranks (one
small all-reduce under its deadline; see [Note: optimizer settings agree across ranks] in
``agree.py``) and raises ``UsageError`` on every rank, naming the setting and the ranks, before
anything is stepped. Only the first step: a later change on one rank (an LR scheduler stepped
on some ranks) shows in the replicas, as it does with torch's optimizers under torch's DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from gradsync.errors import CheckpointError, UsageError
from gradsync.optim import agree, clip

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]

GRAD_VERSION = "_gradsync_grad_version"  # .grad's in-place version when it was last stamped


def stamp_grads(params: Sequence[torch.Tensor]) -> None:
    """Record the in-place version of every ``.grad`` in ``params``: after the reduction wrote
    them, and after a clipping that scaled ``main_grad`` and ``.grad`` alike ([Note: clipping
    main gradients])."""
    for param in params:
        if param.grad is not None:
            setattr(param, GRAD_VERSION, param.grad._version)


def grad_changed(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` was changed in place since it was last stamped."""
    grad = param.grad
    return grad is not None and getattr(param, GRAD_VERSION, grad._version) != grad._version


class MasterWeights:
    """``optimizer_class(fp32 copies of params, **defaults)``, stepped on ``p.main_grad``.

    ``params`` are parameters or parameter groups (dicts with ``"params"`` and per-group
    options), as for a torch optimizer. A parameter without ``.grad`` after the backward
    (unused on every rank) is skipped, as a torch optimizer skips it. The gradient is
    ``p.main_grad`` when the wrapper gives one (in any dtype, cast to the master's), else
    ``p.grad``. A parameter written outside the optimizer is taken as the new weight: see
    [Note: parameters written outside the optimizer]. ``state_dict()`` holds the inner
    optimizer's state and the fp32 weights, so a checkpoint resumes exactly, not from the
    rounded bf16 ones; :class:`gradsync.checkpoint.Checkpointer` saves it keyed by parameter
    name (:meth:`named_state_dict`).
    """

    def __init__(
        self,
        params: ParamsT,
        optimizer_class: type[torch.optim.Optimizer],
        **defaults: Any,
    ) -> None:
        self.params: list[torch.Tensor] = []
        self.master: list[torch.nn.Parameter] = []
        groups = []
        for group in _param_groups(params):
            trainable = [p for p in group["params"] if p.requires_grad]
            if any(isinstance(p, DTensor) for p in trainable):  # no foreach copy into one
                raise UsageError(
                    "MasterWeights does not take DTensor parameters (fully_shard, tensor "
                    "parallelism); with fully_shard keep fp32 parameters and compute in bf16 "
                    "with its MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
                )
            master = [
                torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in trainable
            ]
            self.params += trainable
            self.master += master
            groups.append({**group, "params": master})
        if len({id(p) for p in self.params}) != len(self.params):
            # Two masters of one parameter would each be rounded into it, the last one winning.
            raise UsageError("MasterWeights: a parameter is listed more than once")
        self.optimizer = optimizer_class(groups, **defaults)
        self._index = {id(m): i for i, m in enumerate(self.master)}
        self._versions = self._current_versions()
        self._values_checked = False  # see [Note: parameters written outside the optimizer]
        self._settings_checked = False  # see [Note: MasterWeights compares settings across ranks]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the masters and round them into the model; returns what ``closure`` returned.
        The closure (forward and backward, as for a torch optimizer) is passed on to the inner
        optimizer, which may call it more than once (LBFGS): each call sees the model holding
        the current masters, and the masters get the gradients it computed."""
        if not self._settings_checked:
            self._settings_checked = True
            self._compare_settings()
        self._adopt_outside_writes()
        if closure is None:
            self._take_grads()
            loss = self.optimizer.step()
        else:
            loss = self.optimizer.step(self._wrap(closure))
        self._write_model()
        return loss

    def _wrap(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def evaluate() -> Any:
            self._write_model()  # a repeated call evaluates at the masters moved since
            with torch.enable_grad():
                loss = closure()
            self._take_grads()
            return loss

        return evaluate

    def _take_grads(self) -> None:
        for index, (p, m) in enumerate(zip(self.params, self.master, strict=True)):
            if p.grad is None:
                m.grad = None
                continue
            if grad_changed(p) and getattr(p, "main_grad", None) is not None:
                raise UsageError(
                    f"MasterWeights: the .grad of parameter #{index} (shape "
                    f"{tuple(p.shape)}) was changed after the backward, e.g. by "
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) or "
                    "model.zero_grad(set_to_none=False); this optimizer steps on p.main_grad, "
                    "so that change would be ignored. Clip with opt.clip_grad_norm_(max_norm), "
                    "which clips main_grad, clear with opt.zero_grad(), or change p.main_grad "
                    "itself"
                )  # [Note: clipping main gradients]
            m.grad = _gradient(p).to(m.dtype)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients the next :meth:`step` uses (``main_grad`` where the wrapper gives
        one, else ``.grad``) by their total norm, as ``torch.nn.utils.clip_grad_norm_`` clips
        ``.grad``; a ``.grad`` next to a ``main_grad`` is scaled alike. Returns the total norm
        (replicated gradients: every rank computes the same one)."""
        have = [p for p in self.params if p.grad is not None]
        stepped = [_gradient(p) for p in have]
        total = clip.total_norm(stepped, norm_type)
        alike = [
            p.grad for p in have if p.grad is not None and getattr(p, "main_grad", None) is not None
        ]
        clip.clip_grads_with_norm_(stepped + alike, max_norm, total)
        stamp_grads(have)
        return total

    @torch.no_grad()  # also when called from the closure, which runs with grad enabled
    def _write_model(self) -> None:
        """Round the masters that have a gradient into the model, and record the versions."""
        pairs = [
            (p, m) for p, m in zip(self.params, self.master, strict=True) if m.grad is not None
        ]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])  # rounds
        self._versions = self._current_versions()

    def _current_versions(self) -> list[int]:
        return [p._version for p in self.params]

    def _adopt_outside_writes(self) -> None:
        """[Note: parameters written outside the optimizer]: a master whose parameter was
        written by something else takes the parameter's value."""
        for p, m, version in zip(self.params, self.master, self._versions, strict=True):
            if p._version != version:
                m.copy_(p)
        if not self._values_checked:  # once: the wrapper's broadcast writes through .data
            self._values_checked = True
            for p, m in zip(self.params, self.master, strict=True):
                changed = (m.to(p.dtype) != p).any()  # no host sync: where() picks on device
                m.copy_(torch.where(changed, p.to(m.dtype), m))
        self._versions = self._current_versions()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's ``.grad`` set to ``None`` or zeroed, as a torch optimizer does; zeroed,
        ``main_grad`` too, which is what the step reads ([Note: clipping main gradients]). The
        masters' ``.grad`` is always dropped: :meth:`step` points it at ``main_grad`` anew."""
        for p, m in zip(self.params, self.master, strict=True):
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.detach_().zero_()
                main = getattr(p, "main_grad", None)
                if main is not None:
                    main.zero_()
            m.grad = None
        stamp_grads(self.params)

    def _compare_settings(self) -> None:
        """[Note: MasterWeights compares settings across ranks]: over the ranks of the wrapper
        that holds these parameters, if one does."""
        peers = agree.peers_of(self.params)
        if peers is None:
            return
        # The model's parameters stand in for the masters: a message names them.
        groups = [
            {**g, "params": [self.params[self._index[id(m)]] for m in g["params"]]}
            for g in self.optimizer.param_groups
        ]
        name = type(self.optimizer).__name__
        agree.check_step("MasterWeights.step()", name, groups, None, peers, hidden=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "master": [m.detach().clone() for m in self.master],
        }

    def named_state_dict(self, names: list[str]) -> dict[str, Any]:
        """The state keyed by parameter name (``names[i]`` is ``params[i]``'s), in the form of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` plus the fp32
        weights under ``"master"``: what DCP saves, and the live tensors DCP loads into.

        As torch's function does, an optimizer that has not stepped yet gets its state first
        (one step on zero gradients at lr 0, which moves no weight), so that a checkpoint
        holds the same keys whenever it is taken and a load has tensors to fill.
        """
        self._initialise_state()
        inner = self.optimizer.state_dict()  # state keyed by index, in param_groups' order
        order = self._names_in_order(names)
        return {
            "state": {order[i]: value for i, value in inner["state"].items()},
            "param_groups": [
                {**group, "params": [order[i] for i in group["params"]]}
                for group in inner["param_groups"]
            ],
            "master": {name: m.data for name, m in zip(names, self.master, strict=True)},
        }

    @torch.no_grad()
    def load_named_state_dict(self, state: dict[str, Any], names: list[str]) -> None:
        """Load what :meth:`named_state_dict` gave (after DCP filled it), and round the fp32
        weights into the model. The parameter groups must list the same names in the same
        order as this optimizer's (the same model and optimizer construction)."""
        saved = [name for group in state["param_groups"] for name in group["params"]]
        live = self._names_in_order(names)
        if saved != live:
            raise CheckpointError(
                "the checkpoint's MasterWeights hold other parameters, or in another order, "
                f"than this one: {saved[:4]}... against {live[:4]}..."
            )
        masters = state["master"]
        for m, name in zip(self.master, names, strict=True):
            _check_saved_master(masters.get(name), m, f"'{name}'")
        index = {name: i for i, name in enumerate(saved)}
        self.optimizer.load_state_dict(
            {
                "state": {index[name]: value for name, value in state["state"].items()},
                "param_groups": [
                    {**group, "params": [index[n] for n in group["params"]]}
                    for group in state["param_groups"]
                ],
            }
        )
        self._load_masters([masters[name] for name in names])

    def _names_in_order(self, names: list[str]) -> list[str]:
        by_id = {id(m): name for m, name in zip(self.master, names, strict=True)}
        return [by_id[id(m)] for group in self.optimizer.param_groups for m in group["params"]]

    @torch.no_grad()
    def _initialise_state(self) -> None:
        if self.optimizer.state:
            return
        groups = self.optimizer.param_groups
        lrs = [group.get("lr") for group in groups]
        for group in groups:
            if "lr" in group:  # an optimizer without one is left as it is, as torch does
                group["lr"] = 0.0
            for m in group["params"]:
                m.grad = torch.zeros_like(m)
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, lrs, strict=True):
                if "lr" in group:
                    group["lr"] = lr
                for m in group["params"]:
                    m.grad = None

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave, and round the fp32 weights into the model. The
        masters are matched by position: the same model and optimizer construction."""
        masters = list(state["master"])
        if len(masters) != len(self.master):
            raise UsageError(
                f"MasterWeights.load_state_dict: the state holds {len(masters)} master weights, "
                f"this optimizer {len(self.master)}: it was saved for another model"
            )
        for i, (saved, m) in enumerate(zip(masters, self.master, strict=True)):
            _check_saved_master(saved, m, f"#{i} (in parameter order)")
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_masters(masters)

    def _load_masters(self, masters: list[torch.Tensor]) -> None:
        """The saved masters and their rounding in the model; the model now holds what the
        optimizer wrote (see [Note: parameters written outside the optimizer])."""
        for m, saved, p in zip(self.master, masters, self.params, strict=True):
            m.copy_(saved)
            p.copy_(m)
        self._versions = self._current_versions()


def _param_groups(params: ParamsT) -> list[dict[str, Any]]:
    """``params`` as a list of parameter groups, as a torch optimizer reads it."""
    if isinstance(params, torch.Tensor):
        raise UsageError(
            "MasterWeights takes an iterable of parameters or of parameter groups (dicts), as "
            "a torch optimizer does, not a single tensor"
        )
    items: list[Any] = list(params)
    groups: list[dict[str, Any]]
    if not any(isinstance(item, dict) for item in items):
        groups = [{"params": items}]
    elif all(isinstance(item, dict) and "params" in item for item in items):
        groups = [dict(item) for item in items]
    else:
        raise UsageError(
            "MasterWeights takes either parameters or parameter groups (dicts, each with a "
            "'params' entry), not a mix"
        )
    for group in groups:
        ps = group["params"]
        group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise UsageError(f"MasterWeights takes parameters (tensors), got a {type(p)}")
    return groups


def _check_saved_master(saved: Any, master: torch.Tensor, what: str) -> None:
    """Refuse a saved master weight that is missing or of another shape than ``master``'s
    (copying it would broadcast, or fail halfway through the load)."""
    if not isinstance(saved, torch.Tensor):
        raise UsageError(f"MasterWeights: the state has no master weight for parameter {what}")
    if saved.shape != master.shape:
        raise UsageError(
            f"MasterWeights: the saved master weight of parameter {what} has shape "
            f"{tuple(saved.shape)}, the parameter {tuple(master.shape)}: the state was saved "
            "for another model"
        )


def _gradient(param: torch.Tensor) -> torch.Tensor:
    """What the optimizer steps on: ``main_grad`` when the wrapper gives one, else ``.grad``."""
    main = getattr(param, "main_grad", None)
    assert param.grad is not None
    return param.grad if main is None else main
