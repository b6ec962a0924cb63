"""The fleet's link model (diutil/datasheets/links.py) and a plan's places on it
(heteropp/placement.py): which link two places take, its time at a time scale, and the
settings it refuses, naming the value."""
from __future__ import annotations

import pytest

from diutil.datasheets.links import GB, FleetLinks, LinkSpec, Place, link_class


def test_two_places_take_the_link_their_dcs_and_nodes_say_bounded_by_both_nics():
    links = FleetLinks({"intra_node": LinkSpec(400 * GB, 1e-6), "inter_node": LinkSpec(50 * GB, 5e-6),
                        "inter_cluster": LinkSpec(1 * GB, 2e-2)})
    a, b = Place("east", "n0", 25 * GB), Place("east", "n0", 25 * GB)
    c, d = Place("east", "n1", 100 * GB), Place("west", "n0", 12.5 * GB)
    assert [link_class(a, x) for x in (b, c, d)] == ["intra_node", "inter_node", "inter_cluster"]
    assert links.between(a, b) == LinkSpec(400 * GB, 1e-6)  # the scale-up fabric: no NIC on the way
    assert links.between(a, c) == LinkSpec(25 * GB, 5e-6)  # a's NIC is the narrower end
    assert links.between(c, d) == LinkSpec(1 * GB, 2e-2)  # the cross-DC link is narrower than both NICs
    assert FleetLinks({"inter_cluster": LinkSpec(1 * GB, 0)}).between(a, c) is None  # not named: host speed


def test_a_transfer_takes_latency_plus_bytes_over_bandwidth_times_the_time_scale():
    link = LinkSpec(2 * GB, 50e-6)
    assert link.transfer_time(1e6) == pytest.approx(50e-6 + 1e6 / 2e9)
    assert link.transfer_time(1e6, 300) == pytest.approx(300 * (50e-6 + 1e6 / 2e9))
    assert link.scaled(300).transfer_time(1e6) == pytest.approx(link.transfer_time(1e6, 300))


def test_the_environment_states_the_links_and_the_place_for_dicomm():
    links = FleetLinks({"inter_node": LinkSpec(1 * GB, 50e-6), "inter_cluster": LinkSpec(0.125 * GB, 0.02)},
                       dcs=frozenset({"A", "B"}))
    env = links.env(Place("A", "s0r1", 25 * GB), 300, "/dev/shm/x")
    assert env == {"DICOMM_LINKS": "inter_cluster=0.125:20000.0,inter_node=1.0:50.0",
                   "DICOMM_LINK_PLACE": "A/s0r1/25.0", "DITORCH_TIME_SCALE": "300.0", "DICOMM_LINK_STATE": "/dev/shm/x"}


@pytest.mark.parametrize("make, message", [
    (lambda: LinkSpec(0, 1e-6), r"bandwidth 0 bytes/s is out of range"),
    (lambda: LinkSpec(1e15, 1e-6), r"bandwidth 1000000000000000.0 bytes/s is out of range"),
    (lambda: LinkSpec(None, 1e-6), r"the link has no bandwidth"),
    (lambda: LinkSpec(1e9, -1e-6), r"latency -1e-06 s is out of range"),
    (lambda: LinkSpec(1e9, 11.0), r"latency 11.0 s is out of range"),
    (lambda: LinkSpec.from_dict({"latency_us": 5}, "links.inter_node"), r"links.inter_node: the link has no bandwidth"),
    (lambda: LinkSpec.from_dict({"bandwidth_gbps": 1, "latency_us": 2e7}, "x"), r"latency_us=20000000.0 is out of range"),
    (lambda: Place("a/b", "n0"), r"dc 'a/b' is invalid"),
    (lambda: FleetLinks({"inter_node": LinkSpec(1e9, 0)}, dcs=frozenset({"A"})).env(Place("C", "n0"), 1),
     r"placed in DC 'C', which the cluster does not have; its DCs: \['A'\]"),
    (lambda: FleetLinks({"inter_node": LinkSpec(1e9, 0)}).env(Place("A", "n0"), 0.5), r"time_scale=0.5 is invalid"),
])
def test_bad_links_and_places_are_refused_naming_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()
