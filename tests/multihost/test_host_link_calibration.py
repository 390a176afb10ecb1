"""``trainmesh plan --calibrate --host-link RATE``: the link between two namespace hosts, measured.

The calibration makes its own two-host cluster, shapes both links to the rate (tbf) and times
gloo collectives between one process in each host. Checked against the shaping itself: at 200
Mbit/s (25 MB/s each way) the fitted beta of every bulk kind lies near the rate and far below
what loopback moves, and the plan prices an axis that crosses hosts with it.
"""

from __future__ import annotations

import pytest

from trainmesh.testing.cluster import unavailable_reason

pytestmark = [pytest.mark.xdist_group("serial")]

RATE_BYTES = 200e6 / 8  # 200 Mbit/s


@pytest.mark.timeout(240)
def test_a_shaped_host_link_is_measured_near_its_rate_and_prices_the_axes_across_hosts():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network-namespace cluster: {reason}")
    from trainmesh.planner.calibrate_hosts import measure_host_link, with_host_link
    from trainmesh.planner.collectives import CollectiveLog
    from trainmesh.planner.hardware import Hardware, Link, axis_seconds

    kinds = ("all_reduce", "all_gather", "send_recv")
    link, costs, measured = measure_host_link("200mbit", repeats=3, sizes=[2**14, 2**18, 2**20, 2**22], kinds=kinds)
    print(link, costs, measured)
    assert link.name == "hosts at 200mbit" and [k for k, _, _ in costs] == list(kinds)
    for kind, alpha, beta in costs:
        assert alpha >= 0
        # tbf lets its first 256 KB through at line speed, so a fit over these sizes reads a little above
        # the rate; loopback moves 0.3-2 GB/s on this machine, 12-80x more
        assert 0.5 * RATE_BYTES < beta < 2.0 * RATE_BYTES, (kind, beta)
    for kind, points in measured:  # the curves the plan prices calls with: 4 sizes, time rising with bytes
        assert len(points) == 4 and points[-1][1] > points[0][1] and points[-1][1] > 0.5 * points[-1][0] / RATE_BYTES

    loop = Link("loopback", 1e-4, 1e9)
    hardware = with_host_link(
        Hardware(
            name="calibrated",
            source="calibrated: test",
            flops=1e10,
            devices_per_node=1 << 30,
            intra=loop,
            inter=loop,
            backend="gloo",
        ),
        link,
        costs,
        measured,
        processes_per_host=2,
    )
    log = CollectiveLog(group_sizes={"data": 2})
    log.add("data", "all_reduce", 2**24, 1)
    inside, across = axis_seconds(log, hardware, {"data": 1})["data"], axis_seconds(log, hardware, {"data": 2})["data"]
    assert across > 5 * inside  # the data axis across the 2 hosts pays the shaped link
