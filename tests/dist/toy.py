"""Small models and data for equivalence tests, and the single-process reference trainer."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ = 11, 8, 5
GLOBAL_BATCH = 24  # divisible by every world size tested (1, 2, 3, 4)


class Net(nn.Module):
    """Tied embedding/head, a frozen layer, and optional BatchNorm, routed and unused branches."""

    def __init__(self, *, bn: bool = False, routed: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM) if bn else None
        self.branch_a = nn.Linear(DIM, DIM) if routed else None
        self.branch_b = nn.Linear(DIM, DIM) if routed else None
        self.unused = nn.Linear(DIM, DIM) if unused else None
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two uses

    def forward(self, tokens: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.body(self.frozen(self.embed(tokens).mean(1))))
        if self.bn is not None:
            h = self.bn(h)
        if self.branch_a is not None and self.branch_b is not None:
            assert route is not None
            # Each branch runs only if some sample takes it: on a rank whose samples all take
            # branch A, branch B gets no gradient there (used on some ranks only).
            out = h.clone()
            if route.any():
                out[route] = self.branch_a(h[route])
            if (~route).any():
                out[~route] = self.branch_b(h[~route])
            h = out
        return self.head(h)


def make_model(kind: str, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(
        bn=kind == "bn", routed=kind in ("routed", "routed_unused"), unused=kind.endswith("unused")
    )


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, targets and routes of the whole global batch at ``step`` (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g)
    # The first half of the batch takes branch A: with 2+ ranks, rank 0 never uses branch B.
    routes = torch.arange(GLOBAL_BATCH) < GLOBAL_BATCH // 2
    return tokens, targets, routes


def shard(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(name)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...], reduction: str) -> torch.Tensor:
    tokens, targets, routes = batch
    return F.cross_entropy(model(tokens, routes), targets, reduction=reduction)


def train_reference(kind: str, opt_name: str, steps: int, world: int, reduction: str = "mean"):
    """One process, the concatenated global batch; returns the final state dict.

    A BatchNorm layer normalises each rank's batch with that batch's statistics (gradsync, like
    torch DDP, does not turn BatchNorm into SyncBatchNorm), and its running statistics follow
    rank 0 (broadcast before each forward). So for ``bn`` the reference runs the same per-rank
    batches one after another in this single process, with running statistics from rank 0's.
    """
    model = make_model(kind, seed=0)
    opt = make_optimizer(opt_name, model.parameters())
    for step in range(steps):
        batch = global_batch(step)
        opt.zero_grad()
        if kind == "bn":
            start = {n: b.clone() for n, b in model.named_buffers()}
            after_rank0 = None
            for r in range(world):
                model.load_state_dict(start, strict=False)
                scale = 1.0 / world if reduction == "mean" else 1.0
                (loss_fn(model, shard(batch, r, world), reduction) * scale).backward()
                if r == 0:
                    after_rank0 = {n: b.clone() for n, b in model.named_buffers()}
            assert after_rank0 is not None
            model.load_state_dict(after_rank0, strict=False)
        else:
            loss_fn(model, batch, reduction).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel()]
    return max(diffs, default=0.0)


class TokenNet(nn.Module):
    """A per-token language-model head: every valid token contributes its own loss term."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def make_token_model(seed: int = 0) -> TokenNet:
    torch.manual_seed(seed)
    return TokenNet()


def padded_batch(lengths: list[int], seed: int, max_len: int | None = None):  # type: ignore[no-untyped-def]
    """Sequences of the given lengths, padded; targets of padding are -1 (ignored)."""
    g = torch.Generator().manual_seed(seed)
    t = max_len or max(lengths)
    tokens = torch.randint(0, VOCAB, (len(lengths), t), generator=g)
    targets = torch.randint(0, VOCAB, (len(lengths), t), generator=g)
    for i, n in enumerate(lengths):
        targets[i, n:] = -1
    return tokens, targets


def token_loss_sum(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-1, reduction="sum"
    )


def outcome(fn: Callable[[], object]) -> str:
    """What calling ``fn`` did, as text a test can compare across ranks: ``"ok"``, or the
    type and message of what it raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (the type and message are the result)
        return f"{type(exc).__name__}: {exc}"
    return "ok"
