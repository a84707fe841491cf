"""Roofline and network sizing: numbers by hand."""

from __future__ import annotations

import pytest

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import default_catalog, get_gpu
from llmscale.model.config import get_preset
from llmscale.plan import network as net
from llmscale.plan import roofline
from llmscale.plan.cluster import Cluster

L70 = get_preset("llama2-70b")
H200 = get_gpu("h200")
CAT = default_catalog()


def test_llama2_70b_training_on_h200_is_compute_bound() -> None:
    r = roofline.training(L70, H200, 1, 4096)
    assert r.ridge == pytest.approx(989.5e12 / 4.8e12)  # 206 FLOP/byte
    assert r.flops == L70.train_flops_per_token(4096) * 4096
    assert r.intensity > 2.5 * r.ridge and r.bound == "compute-bound"


def test_low_precision_training_ridges_at_the_linears_peak() -> None:
    """fp8 and nvfp4 train their linears on the FP8 and FP4 tensor cores: the training step's
    ridge is that peak's (GB300: 5,000 and 15,000 TFLOP/s over 8 TB/s); decoding stays bf16.
    A GPU without the peak refuses (one ConfigError naming the dtype)."""
    gb300 = get_gpu("gb300")
    assert roofline.training(L70, gb300, 1, 4096, "fp8").ridge == pytest.approx(5000e12 / 8e12)
    assert roofline.training(L70, gb300, 1, 4096, "nvfp4").ridge == pytest.approx(15000e12 / 8e12)
    assert roofline.decode(L70, gb300, 1, 128, "nvfp4").ridge == pytest.approx(2500e12 / 8e12)
    with pytest.raises(ConfigError, match="fp4"):
        roofline.training(L70, H200, 1, 4096, "nvfp4")


def test_decode_is_memory_bound_and_its_intensity_is_about_the_batch() -> None:
    r = roofline.decode(L70, H200, 1, 128)
    assert r.bound == "memory-bound"
    assert r.intensity == pytest.approx(1.0, rel=0.03)  # 2 FLOPs per 2-byte weight
    b = roofline.decode_batch_at_ridge(L70, H200, 512)
    at = roofline.decode(L70, H200, round(b), 512)
    assert at.intensity == pytest.approx(at.ridge, rel=0.01)
    assert roofline.decode_batch_at_ridge(L70, H200, 4096) == float("inf")


def test_clos_counts() -> None:
    assert net.clos(64, 64) == net.Clos(1, 1, 64, 0)
    assert net.clos(1024, 64) == net.Clos(2, 32 + 16, 2048, 1024)  # k^2/2 = 2048 ports max
    assert net.clos(4096, 64) == net.Clos(3, 128 + 128 + 64, 3 * 4096, 2 * 4096)  # 5E/k
    with pytest.raises(ConfigError):
        net.clos(70000, 64)


def test_rail_only_removes_the_spine_tier_at_4096_h100() -> None:
    c, sw = Cluster.of("h100"), CAT.switch("ib-ndr-64")
    fat = net.design("fat-tree", 4096, c, sw)
    rail = net.design("rail-only", 4096, c, sw)
    assert (fat.tiers, fat.switches) == (3, 320)
    assert (rail.tiers, rail.switches) == (2, 8 * (16 + 8))  # 8 rails of 512 ports, 2 tiers
    # Cost: switches x $36k + per link a cable ($100) and a transceiver per end ($900).
    assert fat.cost_usd == 320 * 36000 + 12288 * 100 + 24576 * 900
    assert 0.3 < 1 - rail.cost_usd / fat.cost_usd < 0.4


def test_co_packaged_optics_need_transceivers_only_at_the_nic() -> None:
    c = Cluster.of("h100", nic="cpo-800g")
    d = net.design("fat-tree", 1024, c, CAT.switch("cpo-800g-144"))
    assert d.transceivers == 1024 and d.tiers == 2


def test_rail_only_all_to_all_pays_the_nvlink_forwarding() -> None:
    c = Cluster.of("h100")
    fat = net.all_to_all_seconds(1e9, 256, c, "fat-tree")
    rail = net.all_to_all_seconds(1e9, 256, c, "rail-only")
    forward = 7 / 8 * (1e9 * 248 / 256) / (18 * 20.6e9) + 7 * 3.4e-6  # NCCL's NVLink 4 rate
    assert rail - fat == pytest.approx(forward)
    assert 0.05 < rail / fat - 1 < 0.12  # Wang et al.: +8.2% to +11.2%


def test_design_rejects_partial_nodes() -> None:
    with pytest.raises(ConfigError) as e:
        net.design("fat-tree", 100, Cluster.of("h100"), CAT.switch("ib-ndr-64"))
    assert e.value.field == "gpus"
