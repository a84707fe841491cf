"""The catalog entries the article's claims need: link counts, optical I/O, the 576-GPU system."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import DATA_DIR, GiB, default_catalog, load_catalog

CAT = default_catalog()


def test_nvlink5_links_and_pcie_ratio() -> None:
    nv = CAT.link("nvlink5")
    assert nv.links_per_gpu is not None and nv.links_per_gpu.value == 18
    assert nv.per_link_bandwidth == pytest.approx(50e9)  # 100 GB/s bidirectional per link
    assert 2 * nv.bandwidth == pytest.approx(1.8e12)
    assert nv.bandwidth / CAT.link("pcie5").bandwidth == pytest.approx(14.29, abs=0.01)
    assert CAT.link("nvlink4").per_link_bandwidth == pytest.approx(25e9)
    assert CAT.link("pcie5").per_link_bandwidth is None  # not published: no figure invented


def test_infinity_fabric_per_link_and_aggregate() -> None:
    f = CAT.link("infinity-fabric")
    assert f.links_per_gpu is not None and f.links_per_gpu.value == 7
    assert 2 * f.per_link_bandwidth == pytest.approx(128e9)  # type: ignore[operator]
    assert 2 * f.bandwidth == pytest.approx(896e9)


def test_optical_compute_interconnect_chiplet() -> None:
    oci = CAT.link("intel-oci")
    assert oci.kind == "optical-io"
    assert oci.links_per_gpu is not None and oci.links_per_gpu.value == 64
    assert oci.per_link_bandwidth is not None and oci.per_link_bandwidth * 8 == pytest.approx(32e9)
    assert oci.energy_pJ_per_bit is not None and oci.energy_pJ_per_bit.value == 5
    plug = CAT.optic("ib-ndr").energy_pJ_per_bit
    assert plug is not None and plug.value == 15
    assert "Intel" in oci.energy_pJ_per_bit.source and "15 pJ/bit" in plug.source
    assert oci.latency_us.source.startswith("assumption")


def test_cpo_density_is_sourced_on_the_cpo_switch_only() -> None:
    d = CAT.switch("cpo-800g-144").bandwidth_density_vs_pluggable
    assert d is not None and d.value == 6 and "IBM" in d.source
    assert CAT.switch("ib-ndr-64").bandwidth_density_vs_pluggable is None


def test_nvlink_switch_system_576() -> None:
    n = CAT.node("nvl576")
    assert n.gpus_per_node == 576 and n.scale_up == "nvlink5"
    total = n.gpus_per_node * 2 * CAT.link(n.scale_up).bandwidth
    assert total == pytest.approx(1.0368e15)  # "1 PB/s"
    fast = n.gpus_per_node * CAT.gpu(n.gpu).memory_bytes + n.host_memory_bytes
    assert fast / 2**40 == pytest.approx(240.6, abs=0.1)  # "240 TB", in binary units
    assert n.host_memory_bytes == 8 * CAT.node("nvl72").host_memory_bytes
    assert CAT.node_for_gpu("gb200").name == "nvl72"  # the planner's default shape is unchanged


def test_h200_and_mi325x_as_published() -> None:
    h200, mi = CAT.gpu("h200"), CAT.gpu("mi325x")
    assert (h200.memory_bytes, h200.hbm_bandwidth) == (141 * GiB, 4.8e12)
    assert (mi.memory_bytes, mi.hbm_bandwidth) == (256 * GiB, 6.0e12)


def test_a_new_link_field_still_needs_a_source(tmp_path: Path) -> None:
    for f in DATA_DIR.glob("*.toml"):
        shutil.copy(f, tmp_path / f.name)
    p = tmp_path / "links.toml"
    text = p.read_text()
    old = 'energy_pJ_per_bit = { value = 5, source = "intel-oci" }'
    assert old in text
    p.write_text(text.replace(old, "energy_pJ_per_bit = 5"))
    with pytest.raises(ConfigError) as e:
        load_catalog(tmp_path)
    assert e.value.field.endswith("link.intel-oci.energy_pJ_per_bit")
