"""torch DDP's constructor and members on gradsync's wrapper, in one process (world size 1).

A torch DDP program must run unchanged: every torch argument is taken with torch's meaning or
refused with a UsageError naming what to use instead, never a TypeError; every torch member is
overridden, inherited because it works, or refused (``torch_surface.py``).
"""

from __future__ import annotations

import inspect
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.ddp.compat import torch_args, torch_surface

GRADSYNC_OWN = [
    "first_bucket_cap_mb", "reduction", "algorithm", "compression", "timeout", "check_finite",
    "check_replicas_every", "main_grad_dtype", "straggler_every", "deterministic",
]  # fmt: skip


def test_the_signature_is_torchs_then_gradsyncs_own() -> None:
    """A parameter a later torch adds fails here until torch_args.py handles it."""
    ours = inspect.signature(gradsync.DistributedDataParallel.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == list(theirs), "torch's parameters, in torch's order"
    for name in theirs:  # the same defaults: a torch call means the same thing here
        assert ours[name].default == theirs[name].default, name
    keyword_only = [n for n, p in ours.items() if p.kind is p.KEYWORD_ONLY]
    assert keyword_only == GRADSYNC_OWN


def test_every_torch_member_is_overridden_inherited_or_refused() -> None:
    wrapper = gradsync.DistributedDataParallel
    own = {n for cls in wrapper.__mro__[: wrapper.__mro__.index(TorchDDP)] for n in vars(cls)}
    members = [n for n in vars(TorchDDP) if not (n.startswith("__") and n.endswith("__"))]
    unplaced = [n for n in members if n not in own and n not in torch_surface.INHERITED]
    assert not unplaced, f"torch DDP members gradsync has not placed: {unplaced}"
    stale = set(torch_surface.INHERITED) - set(members)
    assert not stale, f"listed as inherited but gone from torch: {stale}"
    # pickled as torch's is, the process group and hooks left out: [Note: a pickled wrapper]
    assert {"__getstate__", "__setstate__"} <= own


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_torch_arguments_are_accepted_with_torchs_meaning(one_rank) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    ddp = gradsync.DistributedDataParallel(
        model, None, None, 0, True, True, None, None, False, False, False, False,
        None, None, None, None, True, None, True, None,
    )  # fmt: skip
    assert isinstance(ddp, TorchDDP) and isinstance(ddp, torch.distributed.algorithms.Joinable)
    assert ddp.device_ids is None and ddp.output_device is None and ddp.dim == 0
    assert ddp.device == torch.device("cpu") and ddp.device_type == "cpu"
    assert ddp.require_backward_grad_sync and ddp.require_forward_param_sync
    assert ddp.bucket_bytes_cap == int(ddp.bucket_cap_mb * 2**20)
    assert ddp.will_sync_module_buffers()
    with pytest.warns(FutureWarning, match="check_reduction"):
        gradsync.DistributedDataParallel(_model(), check_reduction=True)
    # None is torch's default cap, not "one bucket": math.inf is one bucket.
    default = gradsync.DistributedDataParallel(_model())
    assert gradsync.DistributedDataParallel(_model(), bucket_cap_mb=None).bucket_cap_mb == (
        default.bucket_cap_mb
    )
    one = gradsync.DistributedDataParallel(_model(), bucket_cap_mb=math.inf)
    assert one.num_buckets == 1 and one.bucket_cap_mb == math.inf
    with pytest.warns(UserWarning, match="broadcast_buffers is ignored"):
        both = gradsync.DistributedDataParallel(
            _model(), broadcast_buffers=True, forward_sync_buffers=False
        )
    assert not both.broadcast_buffers and not both.forward_sync_buffers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's defaults warn about nothing
        gradsync.DistributedDataParallel(_model(), device_ids=None, output_device=None)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_ids": [0]}, "device_ids=None"),
        ({"output_device": 0}, "device_ids=None"),
        ({"device_ids": [0, 1]}, "single element.*one process per device"),
        ({"device_ids": 0}, "list of one device"),
        ({"mixed_precision": object()}, "compression='bf16'.*main_grad_dtype"),
        ({"bucket_cap_mb_list": [1, 25]}, "first_bucket_cap_mb"),
        ({"delay_all_reduce_named_params": []}, "at the same time"),
        (
            {"delay_all_reduce_named_params": [], "param_to_hook_all_reduce": object()},
            "requires_grad=False",
        ),
    ],
)
def test_what_gradsync_cannot_take_is_refused_saying_why(one_rank, kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(gradsync.UsageError, match=match):
        gradsync.DistributedDataParallel(_model(), **kwargs)


def test_device_ids_are_checked_against_the_modules_device(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def on(*devices: str) -> list:
        return [SimpleNamespace(device=torch.device(d)) for d in devices]

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # set_device(1) was called

    where = torch_args.placement(nn.Module(), on("cuda:1"), [1], None)
    assert (where.device_ids, where.output_device, where.device_type) == ([1], 1, "cuda")
    assert torch_args.placement(nn.Module(), on("cuda:1"), ["cuda:1"], "cuda:1").device_ids == [1]
    assert torch_args.placement(nn.Module(), on("cuda:1"), None, None).device_ids is None
    with pytest.raises(gradsync.UsageError, match=r"names cuda:0.*parameters are on cuda:1"):
        torch_args.placement(nn.Module(), on("cuda:1"), [0], None)
    with pytest.raises(gradsync.UsageError, match="device_ids=None"):  # a multi-device module
        torch_args.placement(nn.Module(), on("cuda:0", "cuda:1"), [0], None)
    with pytest.raises(gradsync.UsageError, match="one type of device"):
        torch_args.placement(nn.Module(), on("cpu", "cuda:0"), None, None)


def test_a_replica_off_the_current_cuda_device_is_refused_naming_set_device(
    one_rank, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A script that moves its model to cuda:LOCAL_RANK without torch.cuda.set_device would run
    NCCL and every unplaced CUDA tensor on cuda:0 from every rank; and the wrapper's own checks
    run on the replica's GPU, never on whatever device is current."""
    from gradsync.failfast.arrivals import ArrivalRecords
    from gradsync.failfast.deadline import Deadline, as_timedelta

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # set_device never called
    replica = [SimpleNamespace(device=torch.device("cuda:1"))]
    with pytest.raises(gradsync.UsageError, match=r"on cuda:1.*current CUDA device is cuda:0.*"
                       r"torch.cuda.set_device\(1\)"):  # fmt: skip
        torch_args.placement(nn.Module(), replica, None, None)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    arrivals = ArrivalRecords(None, "device choice")
    on_replica = Deadline(None, as_timedelta(5), arrivals, torch.device("cuda:1"))
    assert on_replica.device == torch.device("cuda:1")
    assert Deadline(None, as_timedelta(5), arrivals).device == torch.device("cuda:0")
    assert torch_args.module_device(nn.Linear(1, 1)) == torch.device("cpu")


def test_settings_and_torch_internals_refuse_changes(one_rank) -> None:  # type: ignore[no-untyped-def]
    ddp = gradsync.DistributedDataParallel(_model())
    with pytest.raises(AttributeError, match="read-only"):
        ddp.find_unused_parameters = True
    with pytest.raises(gradsync.UsageError, match="static_graph=True to the constructor"):
        ddp._set_static_graph()
    with pytest.raises(gradsync.UsageError, match="register_comm_hook"):
        ddp._register_builtin_comm_hook(None)
    assert ddp._get_ddp_logging_data()["can_set_static_graph"] is False
    ddp.train(False)
    assert not ddp.module.training


def test_static_graph_allows_a_parameter_unused_in_a_step(one_rank) -> None:  # type: ignore[no-untyped-def]
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)  # b is never used

    x = torch.ones(2, 3)
    ddp = gradsync.DistributedDataParallel(TwoHeads())
    with pytest.raises(gradsync.UnusedParametersError):
        ddp(x).sum().backward()
    model = TwoHeads()
    ddp = gradsync.DistributedDataParallel(model, static_graph=True)
    ddp(x).sum().backward()
    assert model.a.weight.grad is not None and model.b.weight.grad is None


def test_torchs_ignore_list_is_honoured(one_rank) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    TorchDDP._set_params_and_buffers_to_ignore_for_model(model, ["0.weight", "0.bias"])
    ddp = gradsync.DistributedDataParallel(model)
    assert "0.weight" not in ddp.reducer.names and "2.weight" in ddp.reducer.names


def test_inputs_go_to_the_replicas_device() -> None:
    from gradsync.ddp.compat.torch_args import to_device

    x = torch.ones(2)
    args, kwargs = to_device(((x, [x], 3), {"y": x, "z": "text"}), torch.device("meta"))
    assert args[0].is_meta and args[1][0].is_meta and args[2] == 3
    assert kwargs["y"].is_meta and kwargs["z"] == "text"


def test_a_refusal_names_the_rank_and_the_setting_on_its_first_line() -> None:
    # Logs, exception summaries and test reports show an error's first line only.
    from gradsync.ddp.checks.model import Refusal, _raise_refusals

    bad = "compression='zstd' is none of the wire formats"
    with pytest.raises(gradsync.UsageError) as one:
        _raise_refusals([None, Refusal(bad), None])
    first = str(one.value).splitlines()[0]
    assert "rank 1: compression='zstd'" in first
    with pytest.raises(gradsync.UsageError) as two:
        _raise_refusals([Refusal(bad), Refusal("reduction must be one of ...")])
    lines = str(two.value).splitlines()
    assert "rank 0: compression='zstd'" in lines[0] and "rank(s) 1" in lines[0]
    assert lines[1:] == [f"  rank 0: {bad}", "  rank 1: reduction must be one of ..."]
