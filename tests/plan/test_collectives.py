"""Alpha-beta collective formulas, algorithm choice, and bad input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmscale.errors import ConfigError
from llmscale.hardware.catalog import default_catalog
from llmscale.plan import collectives as C

CAT = default_catalog()
H100 = C.Fabric.of(CAT.node("hgx-h100"), CAT.link("nvlink4"), CAT.link("ib-ndr"))
MB = 1e6

# What NCCL's collectives reach on an H100's NVLink 4 each way (its topology model: 18 links x
# 20.6 GB/s), not the datasheet's 450 GB/s (links.toml achieved_GBps).
NV = 18 * 20.6e9


def test_ring_all_reduce_formula() -> None:
    # 2(n-1)/n * bytes/bw + 2(n-1) alpha, with n = 8, 1 GB, 100 GB/s, 5 us.
    assert C.ring_all_reduce(1e9, 8, 100e9, 5e-6) == pytest.approx(2 * 7 / 8 * 1e-2 + 2 * 7 * 5e-6)
    assert C.ring_all_reduce(1e9, 1, 100e9, 5e-6) == 0.0


def test_gather_scatter_tree_alltoall_p2p_formulas() -> None:
    assert C.ring_all_gather(1e9, 4, 50e9, 1e-6) == pytest.approx(3 / 4 * 0.02 + 3e-6)
    assert C.ring_reduce_scatter(1e9, 4, 50e9, 1e-6) == C.ring_all_gather(1e9, 4, 50e9, 1e-6)
    assert C.tree_all_reduce(1e9, 6, 50e9, 1e-6) == pytest.approx(2 * 3 * 1e-6 + 2 * 0.02)
    assert C.all_to_all(1e9, 4, 50e9, 1e-6) == pytest.approx(3 * 1e-6 + 3 / 4 * 0.02)
    assert C.p2p(1e9, 50e9, 1e-6) == pytest.approx(1e-6 + 0.02)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 512), nbytes=st.floats(1e3, 1e10))
def test_all_reduce_is_reduce_scatter_plus_all_gather(n: int, nbytes: float) -> None:
    bw, a = 50e9, 4e-6
    rs_ag = C.ring_reduce_scatter(nbytes, n, bw, a) + C.ring_all_gather(nbytes, n, bw, a)
    assert C.ring_all_reduce(nbytes, n, bw, a) == pytest.approx(rs_ag)
    # The bus-bandwidth view: every rank sends 2(n-1)/n of the buffer.
    assert C.ring_all_reduce(nbytes, n, bw, 0.0) == pytest.approx(2 * (n - 1) / n * nbytes / bw)


def test_inside_a_node_big_messages_ring_small_messages_tree() -> None:
    big = C.collective("all_reduce", 1e9, 8, 8, H100)
    assert big.algorithm == "ring"
    assert big.seconds == pytest.approx(C.ring_all_reduce(1e9, 8, NV, 3.4e-6))
    assert C.collective("all_reduce", 1e3, 8, 8, H100).algorithm == "tree"


def test_dp_group_one_rank_per_node_runs_on_one_nic() -> None:
    # 64 ranks, one per node (tp = 8 inside): the ring's bottleneck is one 50 GB/s NIC.
    c = C.collective("all_reduce", 1e9, 64, 1, H100)
    assert c.algorithm == "ring"
    assert c.seconds == pytest.approx(2 * 63 / 64 * 1e9 / 50e9 + 2 * 63 * 9.6e-6)


def test_full_nodes_ring_uses_every_nic() -> None:
    # 8 nodes x 8 GPUs: 8 rings, one per NIC: bottleneck min(370.8, 8 x 50) = NVLink's.
    c = C.collective("all_reduce", 1e9, 64, 8, H100)
    lat = 2 * (56 * 3.4e-6 + 7 * 9.6e-6)
    assert c.algorithm == "ring"
    assert c.seconds == pytest.approx(2 * 63 / 64 * 1e9 / NV + lat)


def test_hierarchical_wins_when_the_network_is_slow() -> None:
    slow = H100.with_inter_bandwidth_scale(0.1)  # 5 GB/s NICs
    c = C.collective("all_reduce", 1e9, 16, 8, slow)
    expect = 2 * C.ring_all_gather(1e9, 8, NV, 3.4e-6) + C.ring_all_reduce(1e9 / 8, 2, 5e9, 9.6e-6)
    assert c.algorithm == "hierarchical" and c.seconds == pytest.approx(expect)


def test_many_nodes_small_message_tree() -> None:
    c = C.collective("all_reduce", 1 * MB, 1024, 1, H100)
    assert c.algorithm == "tree"
    assert c.seconds == pytest.approx(2 * math.log2(1024) * 9.6e-6 + 2 * MB / (0.9 * 50e9))


def test_p2p_inside_and_across_nodes() -> None:
    assert C.collective("p2p", 1e9, 2, 2, H100).seconds == pytest.approx(3.4e-6 + 1e9 / NV)
    assert C.collective("p2p", 1e9, 2, 1, H100).seconds == pytest.approx(9.6e-6 + 1e9 / 50e9)
    mi = C.Fabric.of(CAT.node("mi300x-platform"), CAT.link("infinity-fabric"), CAT.link("ib-ndr"))
    # One Infinity Fabric link (64 GB/s each way) between two GPUs of the mesh.
    assert C.collective("p2p", 1e9, 2, 2, mi).seconds == pytest.approx(3.4e-6 + 1e9 / 64e9)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: C.collective("allreduce", 1e6, 8, 8, H100), "op"),
        (lambda: C.collective("all_reduce", 1e6, 8, 3, H100), "per_node"),
        (lambda: C.collective("all_reduce", 1e6, 16, 16, H100), "per_node"),
        (lambda: C.ring_all_reduce(-1, 8, 1e9, 0), "nbytes"),
        (lambda: C.ring_all_reduce(1, 8, 0, 0), "bw"),
    ],
)
def test_bad_input(call, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        call()
    assert e.value.field == field
