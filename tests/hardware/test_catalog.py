"""Hardware catalog: published numbers, sources on every number, lookups, device names."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import (
    DATA_DIR,
    default_catalog,
    get_gpu,
    get_link,
    gpu_for_device_name,
    load_catalog,
)
from llmscale.hardware.spec import Sourced

CAT = default_catalog()


@pytest.mark.parametrize(
    ("gpu", "mem_gib", "hbm_tbps", "bf16_tflops"),
    [
        ("a100-40g", 40, 1.555, 312),
        ("a100-80g", 80, 2.039, 312),
        ("h100", 80, 3.35, 989.5),
        ("h200", 141, 4.8, 989.5),
        ("b200", 180, 8.0, 2250),
        ("b300", 288, 8.0, 2250),  # HGX B300: 36 PF BF16 with sparsity / 8 / 2
        ("gb300", 288, 8.0, 2500),  # GB300 NVL72: 360 PF BF16 with sparsity / 72 / 2
        ("mi300x", 192, 5.3, 1307.4),
        ("mi325x", 256, 6.0, 1307.4),
    ],
)
def test_published_gpu_numbers(
    gpu: str, mem_gib: float, hbm_tbps: float, bf16_tflops: float
) -> None:
    g = get_gpu(gpu)
    assert g.memory_bytes == mem_gib * 2**30
    assert g.hbm_bandwidth == pytest.approx(hbm_tbps * 1e12)
    assert g.peak_flops("bf16") == pytest.approx(bf16_tflops * 1e12)
    assert g.peak_flops("fp16") == g.peak_flops("bf16")


def test_dense_is_half_of_sparse_and_tf32_is_listed() -> None:
    assert get_gpu("h100").peak_flops("fp8") == pytest.approx(1979e12)  # 3958 sparse / 2
    assert get_gpu("h100").peak_flops("tf32") == pytest.approx(494.5e12)
    assert get_gpu("a100-80g").peak_flops("tf32") == pytest.approx(156e12)
    assert get_gpu("mi300x").peak_flops("fp8") == pytest.approx(2614.9e12)


def test_fp4_peaks_are_dense_and_blackwell_only() -> None:
    """FP4 (NVFP4) peaks: B200 and GB200 twice their FP8 (HGX B200 144 PF and GB200 NVL72
    1,440 PF with sparsity, halved), Blackwell Ultra three times (GB300 NVL72 1,080 PF and HGX
    B300 108 PF dense); Hopper and the AMD parts have none, and no FP4 calibration."""
    for gpu, dense in (("b200", 9000), ("gb200", 10000), ("b300", 13500), ("gb300", 15000)):
        assert get_gpu(gpu).peak_flops("fp4") == pytest.approx(dense * 1e12), gpu
        assert get_gpu(gpu).calibration.fp4_gemm_efficiency is not None
    for gpu in ("h100", "h200", "mi300x"):
        assert "fp4" not in get_gpu(gpu).dense_TFLOPS
        assert get_gpu(gpu).calibration.fp4_gemm_efficiency is None
        with pytest.raises(ConfigError, match="fp4"):
            get_gpu(gpu).peak_flops("fp4")


def test_blackwell_ultra_nodes() -> None:
    """GB300 NVL72: 72 GPUs in one NVLink 5 domain, a ConnectX-8 (800 Gb/s) per GPU, FP8 at
    720 PF with sparsity / 72 / 2; DGX B300: 8 GPUs, 8 ConnectX-8 ports."""
    assert get_gpu("gb300").peak_flops("fp8") == pytest.approx(5000e12)
    rack = CAT.node_for_gpu("gb300")
    assert (rack.name, rack.gpus.value, rack.nics.value, rack.scale_up, rack.nic) == (
        "nvl72-gb300",
        72,
        72,
        "nvlink5",
        "ib-xdr",
    )
    hgx = CAT.node_for_gpu("b300")
    assert (hgx.gpus.value, hgx.nics.value, hgx.nic) == (8, 8, "ib-xdr")
    assert get_link("ib-xdr").bandwidth == 100e9  # 800 Gb/s


def test_links_per_direction() -> None:
    assert get_link("nvlink4").bandwidth == 450e9  # 900 GB/s bidirectional
    assert get_link("nvlink4").bus_bandwidth == pytest.approx(18 * 20.6e9)  # NCCL topo.h
    assert get_link("nvlink5").bandwidth == 900e9  # 18 x 100 GB/s = 1.8 TB/s bidirectional
    assert get_link("nvlink3").bandwidth == 300e9
    fabric = get_link("infinity-fabric")
    assert fabric.bandwidth == 448e9 and fabric.pair_bandwidth == 64e9  # 7 x 128 / 2, 128 / 2
    assert get_link("pcie4").bandwidth == 31.5e9 and get_link("pcie5").bandwidth == 63e9
    assert [get_link(n).bandwidth for n in ("ib-hdr", "ib-ndr", "ib-xdr")] == [25e9, 50e9, 100e9]
    assert get_link("cpo-800g").bandwidth == 100e9
    assert get_link("ib-ndr").latency == pytest.approx(9.6e-6)


def test_nodes_and_topologies() -> None:
    assert CAT.node("dgx-a100").gpu == "a100-80g" and CAT.node("dgx-a100").gpus_per_node == 8
    assert CAT.node("nvl72").gpus_per_node == 72
    assert CAT.node_for_gpu("h200").name == "hgx-h200"
    assert CAT.node_for_gpu("mi325x").scale_up == "infinity-fabric"
    assert set(CAT.topologies) == {"rail-optimized", "rail-only", "single-switch", "nvl72"}


def _all_sourced(obj: object) -> list[Sourced]:
    out: list[Sourced] = []
    if isinstance(obj, Sourced):
        return [obj]
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            out += _all_sourced(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            out += _all_sourced(v)
    return out


def test_every_number_has_a_source() -> None:
    numbers = [
        s
        for table in (CAT.gpus, CAT.links, CAT.nodes, CAT.topologies, CAT.switches, CAT.optics)
        for e in table.values()
        for s in _all_sourced(e)
    ]
    assert len(numbers) > 100
    assert all(len(s.source) > 10 for s in numbers)
    prices = [s for sw in CAT.switches.values() for s in _all_sourced(sw) if "price" in s.source]
    assert prices and all(s.source.startswith("assumption") for s in prices)


def _copy_with(tmp_path: Path, old: str, new: str) -> Path:
    for f in DATA_DIR.glob("*.toml"):
        shutil.copy(f, tmp_path / f.name)
    p = tmp_path / "gpus.toml"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))
    return tmp_path


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        (
            'memory_GiB = { value = 40, source = "a100" }',
            "memory_GiB = 40",
            "gpu.a100-40g.memory_GiB",
        ),
        (
            'memory_GiB = { value = 40, source = "a100" }',
            "memory_GiB = { value = 40 }",
            "gpu.a100-40g.memory_GiB.source",
        ),
        (
            'memory_GiB = { value = 40, source = "a100" }',
            'memory_GiB = { value = 40, source = "" }',
            "gpu.a100-40g.memory_GiB.source",
        ),
        (
            'memory_GiB = { value = 40, source = "a100" }',
            'memory_GiB = { value = 40, source = "nosuchkey" }',
            "gpu.a100-40g.memory_GiB.source",
        ),
        (
            'dense_TFLOPS.fp32 = { value = 19.5, source = "a100" }',
            "dense_TFLOPS.fp32 = 19.5",
            "gpu.a100-40g.dense_TFLOPS.fp32",
        ),
        ('scale_up = "nvlink3"', 'scale_up = "nvlink9"', "gpu.a100-40g.scale_up"),
        ('vendor = "NVIDIA"', 'vendor = "NVIDIA"\nclock_GHz = 1.4', "gpu.a100-40g.clock_GHz"),
    ],
)
def test_loader_rejects_numbers_without_sources(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_catalog(_copy_with(tmp_path, old, new))
    assert e.value.field.endswith(field), e.value


def test_an_inline_citation_is_a_source(tmp_path: Path) -> None:
    cat = load_catalog(
        _copy_with(
            tmp_path,
            'memory_GiB = { value = 40, source = "a100" }',
            'memory_GiB = { value = 40, source = "measured: torch.cuda.mem_get_info on a DGX A100" }',
        )
    )
    assert cat.gpu("a100-40g").memory_GiB.source.startswith("measured")


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        get_gpu("h300")
    assert e.value.field == "gpu" and "h200" in e.value.allowed and "mi325x" in e.value.allowed
    with pytest.raises(ConfigError) as e:
        get_gpu("a100-80g").peak_flops("fp8")
    assert e.value.field == "dtype" and "bf16" in e.value.allowed


@pytest.mark.parametrize(
    ("name", "gpu"),
    [
        ("NVIDIA H200", "h200"),
        ("nvidia  h200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", "a100-40g"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB300", "gb300"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA H200 NVL", None),  # a different (lower-power) part: no wrong peak
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_gpu_for_device_name(name: str, gpu: str | None) -> None:
    found = gpu_for_device_name(name)
    assert (found.name if found else None) == gpu


# ---- calibration: what each GPU achieves -------------------------------------------------


def test_h100_96gb_hbm2e() -> None:
    g = get_gpu("h100-96g")
    assert g.memory_bytes == 96 * 2**30
    assert g.hbm_bandwidth == pytest.approx(2.4e12)
    assert "torchtitan" in g.hbm_TBps.source and "500 W" in g.hbm_TBps.source
    node = CAT.node_for_gpu("h100-96g")
    assert get_link(node.nic).bandwidth == pytest.approx(50e9)  # 400 Gb/s per GPU
    assert node.nics_per_node == node.gpus_per_node == 8


@pytest.mark.parametrize("name", sorted(CAT.gpus))
def test_every_gpu_has_a_sourced_calibration(name: str) -> None:
    gpu = get_gpu(name)
    cal = gpu.calibration
    for f in dataclasses.fields(cal):
        num = getattr(cal, f.name)
        lowp = {"fp8_gemm_efficiency": "fp8", "fp4_gemm_efficiency": "fp4"}
        if f.name in lowp and lowp[f.name] not in gpu.dense_TFLOPS:
            assert num is None, name  # only GPUs with an FP8 (FP4) peak have one
            continue
        if num is None:  # measured on a device only (the runtime's ring attention)
            assert f.name == "ring_attention_efficiency", (name, f.name)
            continue
        assert isinstance(num, Sourced) and len(num.source) > 10, (name, f.name)
    assert 0.3 < cal.gemm_efficiency.value <= 0.9
    assert 0 < cal.attention_efficiency.value < 1 and 0 < cal.hbm_efficiency.value < 1
    # Rates of the bare GPU only: a value fitted on a published run is a stack's (stack.Fit).
    for f in dataclasses.fields(cal):
        num = getattr(cal, f.name)
        if isinstance(num, Sourced):
            assert "fitted" not in num.source and "calibrated on" not in num.source, (name, f.name)


def test_gemm_efficiency_saturates_with_shape() -> None:
    cal = get_gpu("a100-80g").calibration
    effs = [cal.gemm_efficiency_at(d, d, d) for d in (64, 256, 1024, 8192)]
    assert effs == sorted(effs) and effs[-1] < cal.gemm_efficiency.value
    assert effs[-1] > 0.98 * cal.gemm_efficiency.value and effs[0] < 0.5 * effs[-1]


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        (
            'calibration.hbm_efficiency = { value = 0.85, source = "stream" }',
            "",
            "calibration.hbm_efficiency",
        ),
        (
            'calibration.hbm_efficiency = { value = 0.85, source = "stream" }',
            "calibration.hbm_efficiency = 0.85",
            "calibration.hbm_efficiency",
        ),
        (
            'calibration.hbm_efficiency = { value = 0.85, source = "stream" }',
            'calibration.hbm_efficiency = { value = 1.5, source = "stream" }',
            "calibration.hbm_efficiency",
        ),
        (
            'calibration.hbm_efficiency = { value = 0.85, source = "stream" }',
            'calibration.hbm_efficiency = { value = 0.85, source = "stream" }\n'
            'calibration.fudge = { value = 1.1, source = "stream" }',
            "calibration.fudge",
        ),
        (  # a stack's cost on the device (stack.DeviceCosts), not a rate of the bare GPU
            'calibration.hbm_efficiency = { value = 0.85, source = "stream" }',
            'calibration.hbm_efficiency = { value = 0.85, source = "stream" }\n'
            'calibration.optimizer_efficiency = { value = 0.5, source = "stream" }',
            "calibration.optimizer_efficiency",
        ),
    ],
)
def test_loader_checks_the_calibration(tmp_path: Path, old: str, new: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_catalog(_copy_with(tmp_path, old, new))
    assert e.value.field.endswith(field), e.value
