"""fullscale.device on a CPU box: torch_npu absent or broken -> cpu/gloo, with the reason kept."""

from __future__ import annotations

import importlib.abc
import socket
import sys
import types

import pytest
import torch

from fullscale import device as dv


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `torch_npu` from `exec_fn(module)` (which may raise, like a CANN-less import)."""

    def __init__(self, exec_fn):
        self.exec_fn = exec_fn

    def find_spec(self, name, path=None, target=None):
        if name == "torch_npu":
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.exec_fn(module)


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """Install a finder for torch_npu; restore sys.modules, torch.npu and the cache after."""
    installed = []

    def install(exec_fn):
        monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
        finder = _Finder(exec_fn)
        sys.meta_path.insert(0, finder)
        installed.append(finder)
        return dv.import_torch_npu(refresh=True)

    yield install
    for f in installed:
        sys.meta_path.remove(f)
    sys.modules.pop("torch_npu", None)
    dv.import_torch_npu(refresh=True)


def test_real_environment_falls_back_to_cpu_gloo():
    info = dv.detect("auto")
    if torch.cuda.is_available() or dv.import_torch_npu() is not None:
        pytest.skip("an accelerator is present; the CPU fallback is tested with a fake below")
    assert (info.type, info.backend, info.index, info.peak_flops) == ("cpu", "gloo", 0, None)
    assert info.name and dv.torch_device(info) == torch.device("cpu")
    assert dv.memory_stats(info) is None
    env = dv.environment_info(info, world_size=1)
    assert env["torch"] == torch.__version__ and env["torch_npu"] is None
    assert env["torch_npu_import_error"]          # why torch_npu is missing is recorded
    assert env["device_type"] == "cpu" and env["world_size"] == 1


def test_failing_torch_npu_import_is_caught_and_recorded(fake_torch_npu, monkeypatch):
    def cann_missing(module):
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fake_torch_npu(cann_missing) is None
    assert "libhccl.so" in dv.torch_npu_error() and dv.torch_npu_error().startswith("ImportError")
    info = dv.detect("auto")
    assert (info.type, info.backend) == ("cpu", "gloo")
    assert "libhccl.so" in dv.environment_info(info)["torch_npu_import_error"]
    with pytest.raises(dv.DeviceError, match="npu requested.*libhccl.so.*set_env.sh"):
        dv.detect("npu")


def test_non_import_errors_are_caught_too(fake_torch_npu):
    def undefined_symbol(module):
        raise OSError("torch_npu/lib/libtorch_npu.so: undefined symbol: _ZN3c10")

    assert fake_torch_npu(undefined_symbol) is None
    assert "undefined symbol" in dv.torch_npu_error()
    # cached: a second call does not re-import
    assert dv.import_torch_npu() is None and "undefined symbol" in dv.torch_npu_error()


def test_npu_detected_when_torch_npu_works(fake_torch_npu, monkeypatch):
    calls = []
    fake_npu = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 8,
        get_device_name=lambda i: "Ascend910B2", set_device=lambda i: calls.append(("set", i)),
        synchronize=lambda i: calls.append(("sync", i)),
        memory_allocated=lambda i: 10, max_memory_allocated=lambda i: 20,
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=62432 << 20))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)

    def works(module):
        module.__version__ = "2.1.0.post6"

    assert fake_torch_npu(works) is not None and dv.torch_npu_error() is None
    info = dv.detect("auto", local_rank=11)
    assert (info.type, info.index, info.backend, info.name) == ("npu", 3, "hccl", "Ascend910B2")
    assert info.supports_bf16 and info.peak_flops == 313e12   # the table's 910B value
    dv.set_device(info)
    dv.synchronize(info)
    assert calls == [("set", 3), ("sync", 3)]
    assert dv.memory_stats(info) == {"allocated_bytes": 10, "peak_bytes": 20,
                                     "total_bytes": 62432 << 20}
    assert dv.environment_info(info, 1024)["torch_npu"] == "2.1.0.post6"


def test_explicit_unavailable_preference_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(dv.DeviceError, match="cuda requested"):
        dv.detect("cuda")
    with pytest.raises(dv.DeviceError, match="must be one of"):
        dv.detect("tpu")
    assert dv.detect("cpu").type == "cpu"


def test_peak_table_longest_match_and_mfu(tmp_path):
    table = dv.load_peak_table()
    assert dv.peak_flops("NVIDIA A100-SXM4-80GB", table) == 312e12
    assert dv.peak_flops("NVIDIA H100 80GB HBM3", table) == 989e12
    assert dv.peak_flops("NVIDIA H100 PCIe", table) == 756e12     # longer key wins
    assert dv.peak_flops("NVIDIA H200", table) == 989e12
    assert dv.peak_flops("Ascend910B4", table) == 313e12
    assert dv.peak_flops("Intel(R) Xeon(R) CPU", table) is None
    info = dv.DeviceInfo("npu", 0, "hccl", "Ascend910B2", True, 313e12)
    # 350 tokens/s/card x 444.5 GF/token = 155.6 TF -> 49.7% of 313 TF (notes, section 5)
    assert dv.mfu(350, 444.5e9, info) == pytest.approx(0.497, abs=5e-4)
    assert dv.mfu(350, 444.5e9, dv.DeviceInfo("cpu", 0, "gloo", "x", True, None)) is None
    bad = tmp_path / "devices.toml"
    bad.write_text('[peak_bf16_flops]\n"X" = -1\n')
    with pytest.raises(dv.DeviceError, match="must be a positive number"):
        dv.load_peak_table(bad)
    with pytest.raises(dv.DeviceError, match="not found"):
        dv.load_peak_table(tmp_path / "missing.toml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_distributed_single_process_and_torchrun_env(monkeypatch):
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    info = dv.detect("cpu")
    assert dv.init_distributed(info, 30) == (0, 1, 0) and not dist.is_initialized()

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(dv.DeviceError, match="MASTER_ADDR is not set"):
        dv.init_distributed(info, 30)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(dv.DeviceError, match=r"RANK=3 is not in \[0, WORLD_SIZE=1\)"):
        dv.init_distributed(info, 30)
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(dv.DeviceError, match="RANK must be an integer"):
        dv.init_distributed(info, 30)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        assert dv.init_distributed(info, 30) == (0, 1, 0)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dv.destroy_distributed()
    assert not dist.is_initialized()
