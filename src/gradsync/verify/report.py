"""The text ``gradsync verify`` prints: per-step table, verdict and likely causes."""

from __future__ import annotations

from gradsync.verify.runner import DEFAULT_LR, VerifyReport


def _name(spec: object) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))


def format_report(report: VerifyReport) -> str:
    """The per-step table, the verdict and the likely causes, as printed by the CLI."""
    cfg, ev = report.config, report.evidence
    n = cfg.world_size
    lr = DEFAULT_LR[cfg.optimizer] if cfg.lr is None else cfg.lr
    lines = [
        f"gradsync verify: {n} ranks vs 1 process, {cfg.steps} steps, {cfg.optimizer} lr {lr:g}, "
        f"reduction {cfg.reduction}, bucket_cap_mb {cfg.bucket_cap_mb}, "
        f"inject {cfg.inject or 'none'}"
        + (f", deterministic ({cfg.deterministic} leaves)" if cfg.deterministic else ""),
        f"model {_name(cfg.model)}: {report.model_description}; batches {_name(cfg.batches)}",
        f"parameter checksums before step 0: reference {ev.ref_init_checksum}, ranks "
        + " ".join(ev.rank_init_checksums),
        "",
        f"{'step':>4}  {'ref loss':>10}  {f'{n}-rank loss':>11}  {'max|dparam|':>11}  "
        f"{'max|dgrad|':>10}  {'|g|/|g_ref|':>11}",
    ]
    for r in ev.records:
        mark = "  <- past tolerance" if r.step == report.divergence_step else ""
        lines.append(
            f"{r.step:>4}  {r.ref_loss:>10.6f}  {r.loss:>11.6f}  {r.max_param_diff:>11.2e}  "
            f"{r.max_grad_diff:>10.2e}  {r.grad_ratio:>11.4f}{mark}"
        )
    lines.append("")
    exact = all(r.max_param_diff == 0 and r.max_grad_diff == 0 for r in ev.records)
    if report.passed and exact:
        what = "its definition" if cfg.deterministic else "1-process training"
        lines.append(
            f"PASS: {n}-rank training is bitwise identical to {what}: every parameter and "
            f"gradient, at every step ({report.elapsed_s:.1f} s)"
        )
    elif report.passed:
        lines.append(
            f"PASS: {n}-rank training equals 1-process training within {cfg.tolerance:g} at "
            f"every step ({report.elapsed_s:.1f} s)"
        )
    else:
        if report.divergence_step is None:
            verdict = f"within tolerance {cfg.tolerance:g}, but the evidence shows a bug"
        else:
            verdict = f"diverged at step {report.divergence_step} (tolerance {cfg.tolerance:g})"
        lines.append(f"FAIL: {verdict} ({report.elapsed_s:.1f} s)")
        for i, d in enumerate(report.diagnoses):
            lines.append(f"{'likely cause' if i == 0 else 'also'} [{d.cause}]: {d.summary}")
            lines.extend(f"  evidence: {e}" for e in d.evidence)
            if d.fix:
                lines.append(f"  fix: {d.fix}")
    return "\n".join(lines)
