"""One device layer for Ascend NPUs (torch_npu), CUDA GPUs and CPUs.

`detect()` picks npu (torch_npu imports and torch.npu.is_available()), else cuda, else cpu,
and names the collective backend that goes with it (hccl, nccl, gloo). Everything device
specific the trainer needs (set the device, synchronize, memory counters, the process
group, peak FLOP/s for MFU, the environment record for run.json) goes through here, so the
train loop never branches on the device type.

torch_npu is imported lazily and defensively: without CANN, `import torch_npu` raises
ImportError (libhccl.so ...) or fails with undefined-symbol errors from mismatched
libraries, so any Exception means "no NPU" and its message is kept for run.json.
"""

from __future__ import annotations

import importlib

import os
import platform
import resource
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:   # python 3.8 - 3.10: the same parser as a package
    import tomli as tomllib

import torch
import torch.distributed as dist

DEVICE_TYPES = ("npu", "cuda", "cpu")
BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DEVICES_TOML = Path(__file__).resolve().parent.parent / "configs" / "devices.toml"


def local_shard(x: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor, the tensor itself otherwise."""
    return x.to_local() if hasattr(x, "to_local") else x


class DeviceError(RuntimeError):
    """The requested device or distributed setup is not available or is inconsistent."""


# ----------------------------------------------------------------------------- torch_npu

_NPU_UNSET = object()
_npu_module: Any = _NPU_UNSET
_npu_error: str | None = None


def import_torch_npu(refresh: bool = False):
    """`torch_npu` or None; the first result is cached (refresh=True retries).

    Catches every Exception: a missing CANN shows up as ImportError, a mismatched one as
    OSError / RuntimeError / undefined symbols. The reason is available from
    `torch_npu_error()`.
    """
    global _npu_module, _npu_error
    if _npu_module is _NPU_UNSET or refresh:
        try:
            # importing registers torch.npu and the hccl backend
            _npu_module, _npu_error = importlib.import_module("torch_npu"), None
        except Exception as e:  # noqa: BLE001 - any failure means "no NPU"
            _npu_module, _npu_error = None, f"{type(e).__name__}: {e}"
    return _npu_module


def torch_npu_error() -> str | None:
    """Why `import torch_npu` failed (None if it worked or was not tried)."""
    return _npu_error


def _npu_available() -> bool:
    if import_torch_npu() is None:
        return False
    try:
        return bool(torch.npu.is_available())
    except Exception:  # noqa: BLE001 - a broken driver is "not available"
        return False


# ----------------------------------------------------------------------------- peak FLOPs

def load_peak_table(path: str | Path = DEVICES_TOML) -> dict[str, float]:
    """{device-name substring: peak bf16 dense FLOP/s} from configs/devices.toml."""
    path = Path(path)
    if not path.is_file():
        raise DeviceError(f"peak-FLOPs table not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise DeviceError(f"{path}: invalid TOML: {e}") from None
    table = data.get("peak_bf16_flops")
    if not isinstance(table, dict):
        raise DeviceError(f"{path}: missing [peak_bf16_flops] table")
    out = {}
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise DeviceError(f"{path}: peak_bf16_flops.{key!r} must be a positive number, got {value!r}")
        out[str(key)] = float(value)
    return out


def peak_flops(device_name: str, table: dict[str, float] | None = None) -> float | None:
    """Peak bf16 dense FLOP/s of a device by name: the longest key contained in the name
    (case-insensitive) wins; None if no key matches (e.g. CPUs)."""
    table = load_peak_table() if table is None else table
    name = device_name.lower()
    matches = [k for k in table if k.lower() in name]
    return table[max(matches, key=len)] if matches else None


# ----------------------------------------------------------------------------- detection

@dataclass
class DeviceInfo:
    type: str                 # "npu" | "cuda" | "cpu"
    index: int                # device ordinal on this node (0 on cpu)
    backend: str              # "hccl" | "nccl" | "gloo"
    name: str                 # get_device_name(), or the CPU model
    supports_bf16: bool
    peak_flops: float | None  # bf16 dense FLOP/s per device, None if unknown

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _accelerator(kind: str):
    return torch.npu if kind == "npu" else torch.cuda


def detect(preference: str = "auto", local_rank: int = 0) -> DeviceInfo:
    """The device this process should use: npu > cuda > cpu under "auto"; an explicit
    preference that is not available raises DeviceError saying why."""
    if preference not in ("auto", *DEVICE_TYPES):
        raise DeviceError(f"dist.device: must be one of auto, npu, cuda, cpu; got {preference!r}")
    if preference == "npu" and not _npu_available():
        why = torch_npu_error() or "torch.npu.is_available() is False"
        raise DeviceError(f"dist.device=npu requested but no NPU is usable ({why}); on an Ascend "
                          "host run `source /usr/local/Ascend/ascend-toolkit/set_env.sh` first")
    if preference == "cuda" and not torch.cuda.is_available():
        raise DeviceError("dist.device=cuda requested but torch.cuda.is_available() is False "
                          f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    if preference == "auto":
        kind = "npu" if _npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    else:
        kind = preference
    if kind == "cpu":
        name = _cpu_name()
        return DeviceInfo("cpu", 0, "gloo", name, True, peak_flops(name))
    acc = _accelerator(kind)
    count = acc.device_count()
    if count < 1:
        raise DeviceError(f"{kind}: is_available() but device_count() is 0")
    index = int(local_rank) % count
    name = str(acc.get_device_name(index))
    if kind == "cuda":
        bf16 = bool(torch.cuda.is_bf16_supported())
    else:
        # 910A has no bf16; 910B and later do. Prefer the runtime's own answer when it has one.
        probe = getattr(acc, "is_bf16_supported", None)
        try:
            bf16 = bool(probe()) if callable(probe) else "910a" not in name.lower()
        except Exception:  # noqa: BLE001
            bf16 = "910a" not in name.lower()
    return DeviceInfo(kind, index, BACKENDS[kind], name, bf16, peak_flops(name))


def torch_device(info: DeviceInfo) -> torch.device:
    return torch.device("cpu") if info.type == "cpu" else torch.device(info.type, info.index)


def set_device(info: DeviceInfo) -> None:
    if info.type != "cpu":
        _accelerator(info.type).set_device(info.index)


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued kernels (for honest step timings); a no-op on cpu."""
    if info.type != "cpu":
        _accelerator(info.type).synchronize(info.index)


def memory_stats(info: DeviceInfo) -> dict[str, int] | None:
    """Allocated / peak-allocated / total bytes of this device, None on cpu."""
    if info.type == "cpu":
        return None
    acc = _accelerator(info.type)
    return {"allocated_bytes": int(acc.memory_allocated(info.index)),
            "peak_bytes": int(acc.max_memory_allocated(info.index)),
            "total_bytes": int(acc.get_device_properties(info.index).total_memory)}


def available_memory(info: DeviceInfo) -> tuple[int, str] | None:
    """(bytes, where) a process may still allocate for the model: the accelerator's free
    memory, or on cpu the host's MemAvailable, lowered by a cgroup memory.max and by an
    address-space rlimit (ulimit -v); None when unknown."""
    if info.type != "cpu":
        try:
            free, _ = _accelerator(info.type).mem_get_info(info.index)
            return int(free), f"{info.name} free memory"
        except Exception:  # noqa: BLE001 - a backend without mem_get_info
            return None
    limits = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append((int(line.split()[1]) * 1024, "host MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        raw = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if raw != "max":
            limits.append((int(raw) - used, "cgroup memory.max"))
    except (OSError, ValueError):
        pass
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as fh:
                vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limits.append((soft - vm, "address-space limit (ulimit -v)"))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def mfu(tokens_per_s: float, flops_per_token: float, info: DeviceInfo) -> float | None:
    """Model FLOPs utilisation of one device: tokens_per_s (this device's share) x
    flops_per_token / peak; None when the peak is unknown."""
    if not info.peak_flops:
        return None
    return float(tokens_per_s) * float(flops_per_token) / info.peak_flops


# ----------------------------------------------------------------------------- distributed

def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise DeviceError(f"environment variable {name} must be an integer, got {raw!r}") from None


def init_distributed(info: DeviceInfo, timeout_s: float = 300.0) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment.

    Without RANK / WORLD_SIZE in the environment this is a single process and no process
    group is created. Under torchrun (even with one process) a process group with
    `info.backend` is initialised, so FSDP can build its device mesh.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        set_device(info)
        return 0, 1, 0
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise DeviceError(f"environment variable {var} is not set (launch with torchrun)")
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise DeviceError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
    if not dist.is_available():
        raise DeviceError("torch.distributed is not available in this torch build")
    set_device(info)
    dist.init_process_group(backend=info.backend, timeout=timedelta(seconds=float(timeout_s)),
                            rank=rank, world_size=world_size, **group_device(info))
    return rank, world_size, local_rank


def group_device(info: DeviceInfo) -> dict[str, Any]:
    """init_process_group's device_id for this device: eager NCCL init binds the communicator
    (and its barriers) to this GPU; gloo (cpu) must not get a device, and torch 2.1 (the
    Ascend stack) has no device_id argument for hccl."""
    return {"device_id": torch_device(info)} if info.type == "cuda" else {}


def destroy_distributed(synchronize: bool = False) -> None:
    """Destroy every process group. synchronize (a run that finished on every rank): a
    barrier first, so that no rank tears down gloo while another still has work in flight
    (seen once in the 2-process CPU test: rank 1 aborted at exit with "terminate called
    without an active exception" after all 10 steps). Not after a failure: a dead rank
    would leave the others waiting for the timeout."""
    if dist.is_available() and dist.is_initialized():
        if synchronize and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- run.json

def environment_info(info: DeviceInfo, world_size: int = 1) -> dict[str, Any]:
    """What run.json records about the framework and device (merged into
    adamspike.rundir.environment())."""
    npu = import_torch_npu()
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_npu": getattr(npu, "__version__", None) if npu is not None else None,
        "torch_npu_import_error": torch_npu_error(),
        "cuda": torch.version.cuda,
        "device": info.to_dict(),
        "device_type": info.type,
        "device_name": info.name,
        "backend": info.backend,
        "world_size": int(world_size),
    }
    if info.type == "npu":
        env["ascend_toolkit_home"] = os.environ.get("ASCEND_TOOLKIT_HOME")
    return env
