"""Reading a ``torch.distributed.checkpoint`` folder without running arbitrary pickles.

DCP loads tensors with ``weights_only=True``, but in torch 2.13 it unpickles ``.metadata``
with plain ``pickle`` and every non-tensor value (an optimizer's ``lr``, a scheduler's state)
with ``torch.load(..., weights_only=False)``: a checkpoint from an untrusted source could run
code. These two subclasses close both doors: the metadata unpickler builds only DCP's own
metadata classes and torch's dtypes, sizes and layouts; values load with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_TORCH_NAMES = {"Size", "strided", "sparse_coo", "contiguous_format", "preserve_format"}
_TORCH_NAMES |= {"channels_last", "channels_last_3d"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (
                module == "torch"
                and (name in _TORCH_NAMES or isinstance(_dtype(name), torch.dtype))
            )
            or (module == "collections" and name == "OrderedDict")
            or (module == "torch.serialization" and name == "_get_layout")  # a name lookup
            or (module == "pathlib" and name in ("PosixPath", "PurePosixPath"))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
                "metadata: refusing to build it"
            )
        return super().find_class(module, name)


def _dtype(name: str) -> Any:
    return getattr(torch, name, None)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata unpickler builds only DCP's metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor values with ``weights_only=True``
    (the body of torch 2.13's ``load_bytes``, with that one flag changed)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
