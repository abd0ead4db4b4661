"""Wire formats in ``gradsync bench --formats``: bf16 and PowerSGD, gradsync's and torch's.

Six variants join the grid, each at its library's default bucket cap unless said otherwise
(gradsync's "scaled", torch DDP's 25 MB):

- gradsync ``compression="bf16"``: bf16 on the wire, fp32 accumulation (``comm/compress.py``),
  at the default cap and at ``SMALL_CAP_MB``;
- gradsync ``compression=PowerSGD(rank=4, start_iter=2)`` (``comm/powersgd.py``);
- torch DDP + ``bf16_compress_hook`` (half-precision all-reduce, every partial sum rounded),
  at its default cap and at ``SMALL_CAP_MB``;
- torch DDP + ``powerSGD_hook`` with ``matrix_approximation_rank=4, start_powerSGD_iter=2``, in
  *one bucket*: with several buckets torch's hook can hang on gloo (it issues collectives from
  ``then`` callbacks that interleave with the next bucket's in a different order on each rank),
  so this row gets a bucket cap larger than the model.

Both PowerSGD variants start compressing after 2 exact steps, well before the timed rounds
(3 untimed steps and the warm-up rounds come first). Bytes per step are what one rank sends:
counted by the hooks for gradsync's formats, computed from the bucket layout for torch's (its
hooks count nothing) and for the fp32 variants (a ring all-reduce sends ``2(N-1)/N`` of its
bytes). These variants have no communication-only replay: their collectives depend on the data.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import gradsync
from gradsync.bench.variant import DEFAULT_CAP, Variant, torch_ddp_caps, wrapper_cap
from gradsync.comm.powersgd import PowerSGD

WIRE_KINDS = ("gradsync_wire", "torch_ddp_hook")
POWERSGD_RANK = 4
START_ITER = 2  # exact steps before PowerSGD compresses, the same on both sides
# Both bf16 wires also run at this cap, to compare the two at the same buckets (their defaults
# differ: on the bench's model gradsync's "scaled" cap is 6 MiB, torch's 25 MB).
SMALL_CAP_MB = 5.0


def wire_variants() -> tuple[Variant, ...]:
    return (
        Variant("gradsync bf16 wire", "gradsync_wire", DEFAULT_CAP, wire="bf16"),
        Variant("gradsync PowerSGD rank 4", "gradsync_wire", DEFAULT_CAP, wire="powersgd"),
        Variant("torch DDP + bf16_compress_hook", "torch_ddp_hook", DEFAULT_CAP, wire="bf16"),
        Variant(
            "torch DDP + PowerSGD hook rank 4 (1 bucket)",
            "torch_ddp_hook",
            math.inf,
            wire="powersgd",
        ),
        Variant(
            f"gradsync bf16 wire, cap {SMALL_CAP_MB:g} MB",
            "gradsync_wire",
            SMALL_CAP_MB,
            wire="bf16",
        ),
        Variant(
            f"torch DDP + bf16_compress_hook, cap {SMALL_CAP_MB:g} MB",
            "torch_ddp_hook",
            SMALL_CAP_MB,
            wire="bf16",
        ),
    )


def bf16_hook(state, bucket):
    """torch's ``bf16_compress_hook`` unchanged, under another name: torch DDP refuses that
    name without CUDA/NCCL, although gloo reduces bf16 on CPU. No annotations: torch DDP's
    signature check rejects the string annotations of ``from __future__ import annotations``."""
    return default_hooks.bf16_compress_hook(state, bucket)


def build(variant: Variant, gpt: nn.Module) -> nn.Module:
    """The wrapped model of a wire-format variant."""
    if variant.kind == "gradsync_wire":
        compression: str | PowerSGD | None = variant.wire
        if variant.wire == "powersgd":
            compression = PowerSGD(rank=POWERSGD_RANK, start_iter=START_ITER)
        return gradsync.DistributedDataParallel(
            gpt,
            bucket_cap_mb=wrapper_cap(variant.bucket_cap_mb),
            first_bucket_cap_mb=variant.first_bucket_cap_mb,
            compression=compression,
        )
    tddp = torch.nn.parallel.DistributedDataParallel(gpt, **torch_ddp_caps(variant.bucket_cap_mb))
    if variant.wire == "bf16":
        tddp.register_comm_hook(None, bf16_hook)
    else:
        state = psgd.PowerSGDState(
            None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=START_ITER
        )
        tddp.register_comm_hook(state, psgd.powerSGD_hook)
    return tddp


def counted_bytes(model: nn.Module) -> int | None:
    """Bytes a gradsync wire hook has sent so far (gradients plus exact flags); else ``None``."""
    if not isinstance(model, gradsync.DistributedDataParallel):
        return None
    hook = model.reducer.comm_hook
    total = None
    for attr in ("stats", "exact_stats"):
        stats = getattr(hook, attr, None)
        if stats is not None:
            total = (total or 0) + stats.bytes_sent
    return total


def torch_hook_bytes(variant: Variant, model: nn.Module, world: int) -> int:
    """Bytes one rank sends per step under torch's hook (computed as torch's hooks decide)."""
    grads = [p for p in model.parameters() if p.requires_grad]
    ring = 2 * (world - 1) / world
    if variant.wire == "bf16":
        return int(ring * sum(p.numel() for p in grads) * 2)
    numel = 0
    for p in grads:  # powerSGD_hook: each gradient as shape[0] x rest, compressed if it pays
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // n
        r = min(n, m, POWERSGD_RANK)
        compressed, _, _ = psgd._should_compress(n, m, r, 2.0)  # torch's default rate
        numel += (n + m) * r if compressed and p.dim() > 1 else p.numel()
    return int(ring * numel * grads[0].element_size())


def step_bytes(
    variants: tuple[Variant, ...],
    models: dict[str, nn.Module],
    plans: dict[str, list[int]],
    counted: dict[str, int],
    world: int,
) -> dict[str, int]:
    """Bytes one rank sends per step, for every variant that communicates."""
    ring = 2 * (world - 1) / world
    elem = next(models[variants[0].name].parameters()).element_size()
    out = {}
    for v in variants:
        if v.kind == "gradsync_wire" and v.name in counted:
            out[v.name] = counted[v.name]
        elif v.kind == "torch_ddp_hook":
            out[v.name] = torch_hook_bytes(v, models[v.name], world)
        elif plans.get(v.name):
            out[v.name] = int(ring * sum(plans[v.name]) * elem)
    return out


def _row(result: dict[str, Any], name: str) -> tuple[float, int | None]:
    return statistics.median(result["step_s"][name]), result.get("step_bytes", {}).get(name)


def wire_table(result: dict[str, Any]) -> str:
    """Markdown: step time and bytes per step of the fp32 baselines and every wire format."""
    names = [v["name"] for v in result["variants"] if v["kind"] in ("torch_ddp", *WIRE_KINDS)]
    default = next(
        v["name"]
        for v in result["variants"]
        if v["kind"] == "gradsync" and v["bucket_cap_mb"] == DEFAULT_CAP
    )
    torch_name = next(v["name"] for v in result["variants"] if v["kind"] == "torch_ddp")
    names.insert(1, default)
    base_step, base_bytes = _row(result, torch_name)
    lines = [
        f"| variant | step (ms) | vs {torch_name} | MB sent per step per rank | bytes vs fp32 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        step, nbytes = _row(result, name)
        mb = "-" if nbytes is None else f"{nbytes / 1e6:.3f}"
        fraction = "-" if nbytes is None or not base_bytes else f"1/{base_bytes / nbytes:.1f}"
        lines.append(f"| {name} | {step * 1e3:.0f} | {step / base_step:.3f} | {mb} | {fraction} |")
    return "\n".join(lines)


def wire_targets(result: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """The issue's speed and volume targets for the wire formats, on one setting; the bf16
    ones for each library at its default cap, then for both at ``SMALL_CAP_MB``."""
    torch_name = next(v["name"] for v in result["variants"] if v["kind"] == "torch_ddp")
    names = {
        (v["wire"], v["kind"], v["bucket_cap_mb"]): v["name"]
        for v in result["variants"]
        if v.get("wire")
    }
    base, base_bytes = _row(result, torch_name)
    targets = []
    for (wire, kind, cap), name in names.items():
        hook = names.get(("bf16", "torch_ddp_hook", cap))
        if wire != "bf16" or kind != "gradsync_wire" or hook is None:
            continue
        bf16, _ = _row(result, name)
        hook_bf16, _ = _row(result, hook)
        at = " (default caps)" if cap == DEFAULT_CAP else f" (cap {cap:g} MB)"
        ratio = f"{bf16 / base:.3f}x"
        times = f"{bf16 * 1e3:.0f} vs {hook_bf16 * 1e3:.0f} ms"
        targets.append(
            (f"gradsync bf16 step <= 0.6x torch DDP (fp32){at}", bf16 / base <= 0.6, ratio)
        )
        targets.append(
            (f"gradsync bf16 step < torch DDP + bf16_compress_hook{at}", bf16 < hook_bf16, times)
        )
    psgd_step, psgd_bytes = _row(result, names[("powersgd", "gradsync_wire", DEFAULT_CAP)])
    reduction = base_bytes / psgd_bytes if base_bytes and psgd_bytes else None
    return [
        *targets,
        (
            "gradsync PowerSGD rank 4 sends >= 20x fewer bytes than fp32",
            None if reduction is None else reduction >= 20,
            "-" if reduction is None else f"{reduction:.1f}x fewer",
        ),
        (
            "gradsync PowerSGD rank 4 step <= 0.5x torch DDP (fp32)",
            psgd_step / base <= 0.5,
            f"{psgd_step / base:.3f}x",
        ),
    ]


def report_section(result: dict[str, Any]) -> list[str]:
    """Lines of the report for one setting; none when it ran without ``--formats``."""
    if not any(v["kind"] in WIRE_KINDS for v in result["variants"]):
        return []
    lines = [f"### wire formats: {result['label']}", "", wire_table(result), ""]
    for what, met, numbers in wire_targets(result):
        verdict = "n/a" if met is None else "met" if met else "MISSED"
        lines.append(f"- {what}: **{verdict}** ({numbers})")
    return [*lines, ""]
