"""Where gradsync's step time goes past torch DDP's on loopback: a bare Python reducer as yardstick.

    torchrun --nproc-per-node 2 benchmarks/reducer_overhead.py --steps 200

Five replicas of the same GPT train side by side on each of 2 gloo ranks, on the same batches,
one step each per round in an order shuffled every round (the same on every rank):

- ``torch DDP``: torch's reducer, hooks and copies in C++, on the default group;
- ``bare``: :class:`BareReducer` below, the least a Python reducer must do with gradsync's bucket
  plan (a post-accumulate-grad hook per parameter, each bucket multiplied into a flat buffer
  and all-reduced as soon as it is complete, one wait and one copy back at the end), on the
  default group;
- ``bare, own group``: the same on a group of its own, as gradsync's collectives run on its
  private group (``failfast/group.py``);
- ``gradsync``: the wrapper with its defaults;
- ``bare, hand over``: ``bare`` giving each ``.grad`` the summed buffer's view and taking new
  memory for the next step, instead of copying back: what torch DDP's copy out of the bucket
  costs (gradsync hands its buffers over and takes them back: [Note: handing the buffer over]
  in ``gradsync/ddp/buckets.py``).

So ``bare`` minus ``torch DDP`` is what Python hooks cost, ``bare, own group`` minus ``bare``
what a second gloo group costs, ``bare`` minus ``bare, hand over`` what the copy back costs, and
``gradsync`` minus ``bare, hand over`` what gradsync's own bookkeeping costs (deadlines, step
tags and timings in bucket 0's tail, step checks, the step window). The five replicas must end
with the same parameters, bit for bit (each sum on two ranks is ``a + b``), which is checked
before anything is printed. Rank 0 prints the median of each step and of its forward, backward
and optimizer step, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.ddp.plan import BucketSpec
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss


class BareReducer(nn.Module):
    """Data-parallel gradients in the fewest lines: torch DDP's algorithm, none of its checks."""

    def __init__(
        self,
        module: nn.Module,
        specs: list[BucketSpec],
        group: dist.ProcessGroup | None,
        hand_over: bool = False,
    ) -> None:
        super().__init__()
        self.module, self.group, self.hand_over, self.specs = module, group, hand_over, specs
        params = list(module.parameters())
        self.buckets = [[params[i] for i in spec.param_indices] for spec in specs]
        self.buffers = [torch.empty(spec.numel) for spec in specs]
        self.views = [
            [buf[o : o + p.numel()].view_as(p) for p, o in zip(ps, spec.offsets, strict=True)]
            for buf, ps, spec in zip(self.buffers, self.buckets, specs, strict=True)
        ]
        self.pending = [0] * len(specs)
        self.works: list[dist.Work] = []
        self.finish_queued = False
        for b, ps in enumerate(self.buckets):
            for p in ps:
                p.register_post_accumulate_grad_hook(self._hook(b))
        self.scale = 1.0 / dist.get_world_size(group)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        self.pending = [len(ps) for ps in self.buckets]
        self.works = []
        self.finish_queued = False
        return self.module(*args)

    def _hook(self, b: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.finish_queued:  # the first gradient of this backward
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self.finish_queued = True
            self.pending[b] -= 1
            # launched strictly in bucket order: every rank must issue them in the same order
            while len(self.works) < len(self.buckets) and self.pending[len(self.works)] == 0:
                n = len(self.works)
                for view, p in zip(self.views[n], self.buckets[n], strict=True):
                    torch.mul(p.grad, self.scale, out=view)  # type: ignore[arg-type]
                self.works.append(dist.all_reduce(self.buffers[n], group=self.group, async_op=True))

        return hook

    def _finish(self) -> None:
        for work in self.works:
            work.wait()
        if self.hand_over:
            for n, (spec, params) in enumerate(zip(self.specs, self.buckets, strict=True)):
                for view, p in zip(self.views[n], params, strict=True):
                    p.grad = view
                buf = self.buffers[n] = torch.empty(spec.numel)
                self.views[n] = [buf[o : o + p.numel()].view_as(p)
                                 for p, o in zip(params, spec.offsets, strict=True)]  # fmt: skip
            return
        grads = [p.grad for ps in self.buckets for p in ps]
        torch._foreach_copy_(grads, [v for vs in self.views for v in vs])  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=args.n_layer, n_head=8,
                    n_embd=args.n_embd)  # fmt: skip

    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg)

    ours = gradsync.DistributedDataParallel(gpt())
    own_group = dist.new_group(timeout=timedelta(seconds=300))
    models: dict[str, nn.Module] = {
        "torch DDP": TorchDDP(gpt()),
        "bare": BareReducer(gpt(), ours.bucket_specs, None),
        "bare, own group": BareReducer(gpt(), ours.bucket_specs, own_group),
        "gradsync": ours,
        "bare, hand over": BareReducer(gpt(), ours.bucket_specs, None, hand_over=True),
    }
    optimizers = {k: torch.optim.SGD(m.module.parameters(), lr=1e-4) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g) for _ in "xy")
    times: dict[str, dict[str, list[float]]] = {k: {} for k in models}
    for step in range(args.steps + 3):  # 3 untimed
        order = list(models)
        random.Random(step).shuffle(order)
        for name in order:
            model, opt = models[name], optimizers[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = lm_loss(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if step >= 3:
                for part, t in (("step", t3 - t0), ("forward", t1 - t0), ("backward", t2 - t1),
                                ("optimizer", t3 - t2)):  # fmt: skip
                    times[name].setdefault(part, []).append(t * 1000)
    flat = {k: torch.cat([p.detach().flatten() for p in m.module.parameters()])
            for k, m in models.items()}  # fmt: skip
    differ = [k for k, v in flat.items() if not torch.equal(v, flat["torch DDP"])]
    if differ:
        raise SystemExit(f"rank {rank}: parameters differ from torch DDP's: {differ}")
    if rank == 0:
        base = statistics.median(times["torch DDP"]["step"])
        print(f"{args.steps} steps, GPT {args.n_layer} x {args.n_embd}, 2 ranks; medians (ms):")
        for name, parts in times.items():
            cells = "  ".join(f"{p} {statistics.median(v):6.1f}" for p, v in parts.items())
            ratio = statistics.median(parts["step"]) / base
            print(f"{name:16s} {cells}  vs torch DDP {ratio:.3f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
