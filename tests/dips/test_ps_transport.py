"""Di-PS over real transports: leader, follower and cluster on three emulated hosts (wildcard
binds, advertised addresses), and the control flow over TLS."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dips.auth import JobToken
from dips.harness import python_env
from dips.rpc import RpcClient, RpcError, RpcServer, Tls

from emulated_hosts import can_make_hosts, emulated_hosts
from pscluster import ROOT, in_process_ps

HERE = Path(__file__).resolve().parent
MODEL_YAML = str(ROOT / "examples/configs/llama-tiny.yaml")


def self_signed(tmp_path: Path, name: str, san: str) -> Tls:
    """A certificate for ``san`` that is its own CA (openssl, as a deployment would make one)."""
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return Tls(str(cert), str(cert), str(key))


def test_a_new_client_reaches_a_server_on_an_address_where_another_stopped(tmp_path):
    """A follower restarted on its old port, or a test's server on a port another test's server
    had: a new client connects to it at once, whatever backoff an older client of the address is
    in (gRPC shares subchannels per address across a process's channels unless told not to)."""
    token = JobToken.create(tmp_path / "k")

    def serve(bind: str) -> RpcServer:
        return RpcServer("t.Ping", {"Ping": lambda msg: {"pong": 1}}, {"Ping": (token,)}, bind=bind)

    first = serve("127.0.0.1:0")
    address = first.address
    old = RpcClient("t.Ping", address, token)
    assert old.call("Ping") == {"pong": 1}
    first.stop()
    with pytest.raises(RpcError) as down:
        old.call("Ping", timeout=1)
    assert down.value.unavailable  # the old client's connection is now in backoff
    second = serve(address)
    new = RpcClient("t.Ping", address, token)
    try:
        assert new.call("Ping", timeout=2) == {"pong": 1}
    finally:
        for c in (old, new):
            c.close()
        second.stop()


def test_control_flow_over_tls(tmp_path):
    tls = self_signed(tmp_path, "ps", "IP:127.0.0.1")
    with in_process_ps(tmp_path, tls=tls) as (leader, _, token):
        out = subprocess.run([sys.executable, str(HERE / "ps_cluster_proc.py"), leader.address,
                              str(tmp_path / "job.key"), MODEL_YAML, "2", tls.ca],
                             env=python_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.splitlines()[-1])["base"] == 2
        plain = RpcClient("dips.Leader", leader.address, token)
        with pytest.raises(RpcError, match="UNAVAILABLE"):
            plain.call("Status", timeout=2.0)   # no TLS: the handshake fails, nothing is served
        stranger = self_signed(tmp_path, "other", "IP:127.0.0.1")
        with pytest.raises(RpcError, match="UNAVAILABLE"):
            RpcClient("dips.Leader", leader.address, token, Tls(stranger.ca)).call("Status", timeout=2.0)


@pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))
def test_leader_follower_and_cluster_on_three_hosts(tmp_path):
    """Wildcard binds everywhere and no --advertise: the follower advertises the address that
    routes to the leader, and the cluster on a third host reaches both."""
    JobToken.create(tmp_path / "job.key")
    JobToken.create(tmp_path / "servers.key")
    cli = [sys.executable, "-m", "dips.cli"]
    with emulated_hosts(3) as (lead_host, follow_host, cluster_host):
        leader_addr = f"{lead_host.name}:7000"
        procs = [subprocess.Popen(lead_host.run(cli + [
            "leader", "--bind", "0.0.0.0:7000", "--followers", "1", "--model", MODEL_YAML,
            "--token-file", str(tmp_path / "job.key"), "--server-token-file", str(tmp_path / "servers.key"),
            "--metadata", str(tmp_path / "leader.json"), "--no-restart-followers", "--log-level", "WARNING"]),
            env=python_env(), stdout=subprocess.DEVNULL, stderr=open(tmp_path / "leader.log", "w"))]
        procs.append(subprocess.Popen(follow_host.run(cli + [
            "follower", "--leader", leader_addr, "--bind", "0.0.0.0:7100", "--server-token-file",
            str(tmp_path / "servers.key"), "--checkpoint-dir", str(tmp_path / "f0"), "--log-level", "WARNING"]),
            env=python_env(), stdout=subprocess.DEVNULL, stderr=open(tmp_path / "follower.log", "w")))
        try:
            out = subprocess.run(cluster_host.run([sys.executable, str(HERE / "ps_cluster_proc.py"), leader_addr,
                                                   str(tmp_path / "job.key"), MODEL_YAML, "2"]),
                                 env=python_env(), capture_output=True, text=True, timeout=150)
            logs = "".join((tmp_path / f).read_text()[-2000:] for f in ("leader.log", "follower.log"))
            assert out.returncode == 0, out.stderr[-3000:] + logs
            seen = json.loads(out.stdout.splitlines()[-1])
            assert seen["followers"] == [f"{follow_host.address}:7100"]   # routable, not 0.0.0.0
            assert seen["base"] == 2 and seen["stats"]["applied"] == 2
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
