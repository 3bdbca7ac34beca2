"""What a DCP checkpoint's `.metadata` may build when it is unpickled (the trust boundary
of docs/faults.md): DCP's own metadata classes, as the installed torch defines them, and the
few other globals DCP writes into that file. Everything else is refused, so a crafted
`.metadata` cannot run code (pickle would call whatever global it names).

The classes are read from the installed torch at import, not listed by hand, so a torch
that adds one (StorageMeta came with 2.4) or moves one (TensorProperties, 2.1 -> 2.2) is
admitted without a change here; tests/compat/dcp_metadata_check.py writes a real checkpoint with the
installed torch and fails, naming the global, if its `.metadata` refers to anything this
module would refuse (run on torch 2.13 by tests/fullscale/test_checkpoint_trust.py and on
torch 2.1 by .ci/compat.sh py38). This module imports only torch's DCP metadata, so it
loads on the oldest supported torch, where fullscale.checkpoint does not.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import sys
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _dcp_metadata



def _metadata_classes() -> frozenset[tuple[str, str]]:
    """(module, name) of DCP's metadata dataclasses and enums in the installed torch: those
    defined in torch.distributed.checkpoint.metadata and in the module its TensorProperties
    comes from (torch 2.1 took it, and the memory-format enum its pickle names, from
    torch.distributed._shard.sharded_tensor.metadata). Never a function, and never a class
    such a module merely imports (2.1's metadata module imports ShardedTensor)."""
    modules = {_dcp_metadata, sys.modules[_dcp_metadata.TensorProperties.__module__]}
    return frozenset(
        (mod.__name__, name) for mod in modules for name, obj in vars(mod).items()
        if isinstance(obj, type) and obj.__module__ == mod.__name__
        and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)))


METADATA_CLASSES = _metadata_classes()
# globals outside that module that DCP's metadata refers to (torch 2.1 .. 2.13, found by
# tests/compat/dcp_metadata_check.py): the file reader's storage info, tensor sizes and
# layouts, and the paths some versions keep
OTHER_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")})


def admitted(module: str, name: str) -> bool:
    """Whether `.metadata` may build the global module.name."""
    if (module, name) in OTHER_GLOBALS:
        return True
    if (module, name) in METADATA_CLASSES:
        return True
    if module == "torch":                # dtypes, layouts, memory formats
        return isinstance(getattr(torch, name, None),
                          (torch.dtype, torch.layout, torch.memory_format))
    return False


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only what `admitted` allows."""

    def find_class(self, module: str, name: str) -> Any:
        if admitted(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not a DCP "
                                     "metadata class")
