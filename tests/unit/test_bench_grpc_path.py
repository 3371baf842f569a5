"""bench.grpc_path: the ingress replica's own ports, read from its Serve log (no service)."""

from __future__ import annotations

from bench.grpc_path import direct_ingress, ingress_replica_log

LOG = """INFO 2026-11-28 17:30:48,476 hybridflow_ingress wv4r351g -- Started initializing replica.
INFO 2026-11-28 17:30:50,622 hybridflow_ingress wv4r351g -- Allocated port 22200 for RequestProtocol.HTTP
INFO 2026-11-28 17:30:50,699 hybridflow_ingress wv4r351g -- Allocated port 22250 for RequestProtocol.GRPC
"""


def test_the_replicas_http_and_grpc_ports_come_from_its_log():
    assert direct_ingress(LOG) == ("http://127.0.0.1:22200", "127.0.0.1:22250")


def test_a_replica_without_both_servers_has_no_direct_path():
    assert direct_ingress(LOG.splitlines()[1]) is None
    assert direct_ingress("") is None


def test_the_ingress_replicas_log_is_found_by_application(tmp_path):
    (tmp_path / "replica_hybridflow_jobs_ab12.log").write_text("jobs")
    assert ingress_replica_log(tmp_path, "hybridflow") == ""
    (tmp_path / "replica_hybridflow_ingress_cd34.log").write_text(LOG)
    assert ingress_replica_log(tmp_path, "hybridflow") == LOG
