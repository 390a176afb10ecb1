"""trainmesh.testing.cluster: hosts as network namespaces, their links, counters and cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainmesh.testing.cluster import ShapingUnsupported, _ip, unavailable_reason

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("serial")]

# A TCP sink on the receiving host and a sender that reports how long `nbytes` took.
SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = srv.accept()
total = 0
while chunk := conn.recv(1 << 16):
    total += len(chunk)
print(total, flush=True)
"""
SEND = """
import socket, sys, time
nbytes = int(sys.argv[3])
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
start = time.perf_counter()
sock.sendall(bytes(nbytes))
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
print(time.perf_counter() - start, flush=True)
"""


def _transfer(cluster, nbytes: int, port: int = 7000) -> float:
    """Seconds to push ``nbytes`` from host 1 to host 0 over TCP; checks every byte arrived."""
    server, client = cluster.hosts[0], cluster.hosts[1]
    sink = server.popen([sys.executable, "-c", SINK, server.address, str(port)], stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    seconds = float(client.run([sys.executable, "-c", SEND, server.address, str(port), str(nbytes)]).stdout)
    assert int(sink.stdout.readline()) == nbytes
    sink.wait(timeout=30)
    return seconds


def _root_links() -> str:
    return "\n".join(sorted(line.split("@")[0] for line in _ip("-o", "link", "show").stdout.splitlines()))


def test_hosts_talk_only_to_each_other_and_counters_see_it(netns_cluster):
    before = _root_links()
    cluster = netns_cluster(2)
    assert [h.address for h in cluster.hosts] == ["198.18.0.1", "198.18.0.2"]
    assert _root_links() == before  # nothing was added to this machine's own namespace
    for host in cluster.hosts:
        routes = _ip("-n", host.netns, "route", "show").stdout
        assert "default" not in routes and routes.strip().startswith("198.18.0.0/24"), routes
        # loopback is up: a process in the namespace can serve itself on 127.0.0.1
        host.run(
            [
                sys.executable,
                "-c",
                "import socket; s = socket.create_server(('127.0.0.1', 0)); "
                "socket.create_connection(s.getsockname(), timeout=5)",
            ]
        )
    start = [h.counters() for h in cluster.hosts]
    nbytes = 8 << 20
    _transfer(cluster, nbytes)
    sent = cluster.hosts[1].counters() - start[1]
    received = cluster.hosts[0].counters() - start[0]
    # Payload plus TCP/IP headers (a few percent), counted on both ends of the link.
    assert nbytes <= sent.tx_bytes < 1.1 * nbytes and nbytes <= received.rx_bytes < 1.1 * nbytes
    assert received.rx_packets > 0 and sent.tx_packets > 0


def test_rate_shaping_slows_the_link(netns_cluster):
    cluster = netns_cluster(2)
    nbytes = 4 << 20
    unshaped = _transfer(cluster, nbytes, port=7001)
    cluster.hosts[1].shape(rate="100mbit")
    shaped = _transfer(cluster, nbytes, port=7002)
    rate = nbytes / shaped
    print(f"unshaped {nbytes / unshaped / 1e6:.0f} MB/s, shaped to 100 Mbit/s: {rate / 1e6:.1f} MB/s")
    # 100 Mbit/s is 12.5 MB/s of which TCP/IP headers take a few percent; a slow machine only lowers it.
    assert rate < 13.5e6, rate
    cluster.hosts[1].unshape()
    assert nbytes / _transfer(cluster, nbytes, port=7003) > 2 * rate


def test_delay_and_loss_or_a_clear_refusal(netns_cluster):
    cluster = netns_cluster(2)
    try:
        cluster.hosts[1].shape(delay="20ms", loss=0.0)
    except ShapingUnsupported as exc:
        pytest.skip(f"kernel cannot delay or drop packets: {exc}")
    seconds = _transfer(cluster, 1 << 10, port=7004)
    assert seconds >= 0.02  # the reply byte crosses the delayed link once at least


UDP_COUNT = """
import socket, sys, time
rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.bind((sys.argv[1], int(sys.argv[2])))
rx.settimeout(2.0)
print("ready", flush=True)
got = 0
try:
    while True:
        rx.recv(64)
        got += 1
except socket.timeout:
    print(got, flush=True)
"""
UDP_SEND = """
import socket, sys, time
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.connect((sys.argv[1], int(sys.argv[2])))
for i in range(int(sys.argv[3])):
    tx.send(b"x" * 32)
    time.sleep(0.0005)
"""


def test_packet_loss_drops_that_share_and_tcp_still_delivers_every_byte(netns_cluster):
    cluster = netns_cluster(2)
    receiver, sender = cluster.hosts
    sender.shape(loss=10.0)  # netem where the kernel has it, else htb + u32 on the IP ID
    assert 9 <= sender.loss_applied <= 11
    counter = receiver.popen(
        [sys.executable, "-c", UDP_COUNT, receiver.address, "7006"], stdout=subprocess.PIPE, text=True
    )
    assert counter.stdout.readline().strip() == "ready"
    dropped_before = sender.dropped_packets()
    sender.run([sys.executable, "-c", UDP_SEND, receiver.address, "7006", "1000"])
    arrived = int(counter.stdout.readline())
    dropped = sender.dropped_packets() - dropped_before
    print(f"{sender.loss_applied:.1f}% loss: {1000 - arrived} of 1000 datagrams lost; the link counted {dropped}")
    assert 800 <= arrived <= 970, arrived  # about 1 in 10 dropped, not none and not all
    assert dropped == 1000 - arrived  # the link's drop count is what went missing (one-way, no other IPv4)
    _transfer(cluster, 1 << 20, port=7005)  # TCP retransmits: every byte arrives (checked inside)
    sender.unshape()
    assert sender.loss_applied is None


def test_cut_link_blocks_and_restore_heals(netns_cluster):
    cluster = netns_cluster(2)
    server, client = cluster.hosts
    probe = [
        sys.executable,
        "-c",
        "import socket, sys; socket.create_connection((sys.argv[1], 9), timeout=1)",
        server.address,
    ]
    # Nothing listens on port 9: a live link answers "refused" at once, a cut one times out.
    assert "ConnectionRefused" in client.run(probe, check=False).stderr
    server.cut()
    assert "timed out" in client.run(probe, check=False).stderr
    server.restore()
    cluster.wait_reachable()
    assert "ConnectionRefused" in client.run(probe, check=False).stderr


def test_kill_host_and_close_leave_nothing_behind(netns_cluster):
    cluster = netns_cluster(2)
    sleepers = [h.popen(["sleep", "300"]) for h in cluster.hosts for _ in range(2)]
    time.sleep(0.2)
    killed = cluster.hosts[1].kill()
    assert sorted(killed) == sorted(p.pid for p in sleepers[2:])
    assert [p.poll() for p in sleepers[2:]] == [-signal.SIGKILL] * 2 and sleepers[0].poll() is None
    names = [cluster.bridge_netns, *(h.netns for h in cluster.hosts)]
    cluster.close()
    assert all(p.poll() is not None for p in sleepers)
    listed = _ip("netns", "list").stdout
    assert not any(name in listed for name in names), listed


def test_without_net_admin_it_refuses_before_touching_anything(monkeypatch):
    from trainmesh.testing import cluster as cluster_mod

    monkeypatch.setattr(cluster_mod, "_has_net_admin", lambda: False)
    assert "CAP_NET_ADMIN" in cluster_mod.unavailable_reason()
    with pytest.raises(cluster_mod.ClusterUnavailable, match="CAP_NET_ADMIN"):
        cluster_mod.Cluster(2)


def test_a_host_process_gets_its_own_session_unless_asked_to_stay_in_ours(netns_cluster):
    host = netns_cluster(1).hosts[0]
    show = [sys.executable, "-c", "import os; print(os.getsid(0))"]
    own = host.popen(show, stdout=subprocess.PIPE, text=True)
    ours = host.popen(show, stdout=subprocess.PIPE, text=True, new_session=False)
    assert int(own.communicate(timeout=30)[0]) == own.pid  # a session of its own (killpg reaches its children)
    assert int(ours.communicate(timeout=30)[0]) == os.getsid(0)  # the caller's (one autogroup with it)


@pytest.mark.timeout(180)
def test_run_on_hosts_returns_every_rank_of_a_job_spread_over_hosts():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network-namespace cluster: {reason}")
    from trainmesh.testing.host_jobs import run_on_hosts

    assert run_on_hosts("torch.distributed:get_rank", (), 4, processes_per_host=2, rate="1gbit") == [0, 1, 2, 3]
    assert run_on_hosts("torch.distributed:get_world_size", (), 2) == [2, 2]
    with pytest.raises(ValueError, match="does not split"):
        run_on_hosts("torch.distributed:get_rank", (), 3, processes_per_host=2)
