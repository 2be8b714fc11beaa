"""The coordinator's trust boundary (coordinator/security.py): scoped credentials (admin, tenant, bootstrap,
agent, host), authentication before routing, bounded bodies, failed-attempt limits, the audit log, and TLS with
certificates made here."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cryosleep.coordinator import security, service
from cryosleep.coordinator.client import CoordinatorClient, Http
from cryosleep.coordinator.security import Credentials, Limiter, Lookup, Principal, authorize, check_body
from cryosleep.errors import Forbidden, ProtocolError, TlsError, Unauthorized, UsageError
from tests.coordinator.helpers import FAST
from tests.coordinator.sim import SimCluster

ADMIN, TA, TB, BA, BB, HOST = (f"{n}-{'x' * 20}" for n in ("admin", "tenant-a", "tenant-b", "boot-a", "boot-b",
                                                          "host-1"))
DOC = {"admin": [ADMIN],
       "tenants": {"a": {"tokens": [TA], "jobs": ["a-*"]}, "b": {"tokens": [TB], "jobs": ["b-*"]}},
       "bootstrap": [{"token": BA, "tenant": "a"}, {"token": BB, "tenant": "b"}],
       "hosts": {"host1": HOST}}


# ---- the pure decisions ----------------------------------------------------------------------------------------


def test_credentials_authenticate_and_agent_credentials_are_bound_to_their_node() -> None:
    c = Credentials.parse(DOC)
    assert c.authenticate(f"Bearer {ADMIN}") == Principal("admin", "admin")
    assert c.authenticate(f"Bearer {TA}") == Principal("tenant", "tenant:a", tenant="a")
    assert c.authenticate(f"Bearer {BB}") == Principal("bootstrap", "bootstrap:b", tenant="b")
    assert c.authenticate(f"Bearer {HOST}") == Principal("host", "host:host1", host="host1")
    for bad in ("", "Bearer", f"Basic {ADMIN}", "Bearer not-a-known-token-at-all", f"Bearer {ADMIN}x"):
        assert c.authenticate(bad) is None
    agent = c.issue("a-job", 1, "a")
    assert c.authenticate(f"Bearer {agent}") == Principal("agent", "agent:a-job@1", tenant="a", job="a-job", node=1)
    _claims, mac = agent[len(security.AGENT_PREFIX):].split(".")
    forged = security._b64(json.dumps({"j": "b-job", "n": 1, "t": "b"}).encode())
    assert c.authenticate(f"Bearer {security.AGENT_PREFIX}{forged}.{mac}") is None
    other = Credentials.parse({**DOC, "secret": "s" * 32})
    assert other.authenticate(f"Bearer {agent}") is None  # another coordinator's secret
    assert Credentials.parse({"admin": ["sha256:" + security._digest(ADMIN)]}).authenticate(f"Bearer {ADMIN}")
    for doc, why in [({"admin": ["short"]}, "at least 16"), ({"admin": [ADMIN], "tenants": {"a": {"tokens": [ADMIN],
                      "jobs": ["a-*"]}}}, "both"), ({"bootstrap": [{"token": BA, "tenant": "zz"}]}, "not under"),
                     ({}, "no credential"), ({"admins": []}, "unknown"), ([], "object")]:
        with pytest.raises(UsageError) as e:
            Credentials.parse(doc)
        assert why in e.value.why


def test_authorize_scopes_each_role() -> None:
    c = Credentials.parse(DOC)
    look = Lookup(c.tenant_of, lambda sid: sid.split("~")[0] if "~" in sid else None, lambda pid: None)
    agent = c.authenticate(f"Bearer {c.issue('a-job', 0, 'a')}")
    tenant = c.authenticate(f"Bearer {TA}")
    boot = c.authenticate(f"Bearer {BA}")
    assert agent and tenant and boot
    ok = [(agent, "poll", {"agent": "a-job@0"}), (agent, "trigger", {"job": "a-job"}),
          (agent, "snapshot", {"sid": "a-job~1"}), (tenant, "trigger", {"job": "a-x"}), (tenant, "jobs", {}),
          (tenant, "snapshot", {"sid": "a-j~2"}), (boot, "rendezvous", {"sid": "x"})]
    for p, route, params in ok:
        assert authorize(p, route, params, None, look) is None, (p, route, params)
    assert authorize(boot, "register", {}, "a-new", look) is None
    refused = [(agent, "poll", {"agent": "a-job@1"}, "agent a-job@0"), (agent, "trigger", {"job": "a-other"}, "a-job"),
               (agent, "jobs", {}, "may not"), (agent, "snapshot", {"sid": "b-job~1"}, "not 'b-job'"),
               (tenant, "trigger", {"job": "b-x"}, "not one of tenant a"),
               (tenant, "poll", {"agent": "a-x@0"}, "may not"),
               (tenant, "snapshot", {"sid": "gone"}, "not in the catalog"), (boot, "jobs", {}, "may not")]
    for p, route, params, why in refused:
        reason = authorize(p, route, params, None, look)
        assert reason is not None and why in reason, (p, route, params, reason)
    assert "tenant a" in str(authorize(boot, "register", {}, "b-job", look))
    host = c.authenticate(f"Bearer {HOST}")
    assert host is not None
    hl = Lookup(c.tenant_of, look.snapshot_job, look.placement_job, lambda oid: {"o1": "host1", "o2": "host2"}.get(oid))
    assert authorize(host, "host_poll", {"host": "host1"}, None, hl) is None
    assert authorize(host, "order", {"oid": "o1"}, None, hl) is None
    assert "host2" in str(authorize(host, "host_poll", {"host": "host2"}, None, hl))
    assert "host host2's" in str(authorize(host, "order", {"oid": "o2"}, None, hl))
    assert "may not" in str(authorize(host, "jobs", {}, None, hl))


def test_the_limiter_blocks_a_peer_after_its_burst_until_the_window_passes() -> None:
    lim = Limiter(burst=3, window_s=10.0)
    for t in (0.0, 1.0, 2.0):
        assert lim.blocked("p", t) == 0
        lim.failed("p", t)
    assert lim.blocked("p", 3.0) == pytest.approx(9.0) and lim.blocked("q", 3.0) == 0
    assert lim.blocked("p", 12.5) == 0  # the first failures left the window


@pytest.mark.parametrize("route,body,why", [
    ("register", {"job": "a"}, "lacks"), ("register", {"job": 1, "nnodes": 1, "node_rank": 0, "incarnation": "i"},
                                          "expected a string"),
    ("poll", {"wait_s": "10"}, "number"), ("poll", {"wait_s": float("nan")}, "number"),
    ("trigger", {"wait": 1}, "boolean"), ("rendezvous", {"get": {"min": "3"}}, "integer"),
    ("place", {"hosts": [1]}, "host"),
    ("poll", [], "object")])
def test_malformed_bodies_are_refused(route: str, body: Any, why: str) -> None:
    with pytest.raises((UsageError, ProtocolError)) as e:
        check_body(route, body)
    assert why in e.value.why + e.value.what


# ---- the service -----------------------------------------------------------------------------------------------


@pytest.fixture
def scoped(tmp_path: Path) -> Iterator[service.Server]:
    srv, _ = service.start("127.0.0.1:0", tmp_path / "catalog.db", Credentials.parse(DOC), FAST, log=lambda _m: None,
                           audit=security.Audit(tmp_path / "audit.jsonl"), limiter=Limiter(burst=8))
    yield srv
    service.shutdown(srv)
    srv.coordinator.catalog.close()


def call(srv: service.Server, token: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    h = Http(srv.url, token)
    try:
        return h.call(method, path, body)
    finally:
        h.close()


def register(srv: service.Server, token: str, job: str, node: int = 0, nnodes: int = 1) -> str:
    res = call(srv, token, "POST", "/v1/agents/register",
               {"job": job, "nnodes": nnodes, "node_rank": node, "incarnation": "i1"})
    assert res["agent_id"] == f"{job}@{node}"
    return str(res["credential"])


def raw_request(srv: service.Server, head: str) -> tuple[int, dict[str, Any], float]:
    """Sends only ``head`` (request line and headers, ``Connection: close`` added): the answer, and how long it
    took."""
    host, port = srv.server_address[:2]
    start = time.monotonic()
    with socket.create_connection((str(host), port), timeout=10) as s:
        s.sendall(head.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n", 1).encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1]), time.monotonic() - start


def test_an_agent_credential_acts_only_for_its_own_job_and_node(scoped: service.Server) -> None:
    a = register(scoped, BA, "a-job", 0, 2)
    register(scoped, BB, "b-job")
    assert call(scoped, a, "POST", "/v1/agents/a-job@0/poll", {"incarnation": "i1", "wait_s": 0}) == {"commands": []}
    for method, path, body in [("POST", "/v1/agents/b-job@0/poll", {"incarnation": "i1", "wait_s": 0}),
                               ("POST", "/v1/agents/a-job@1/results", {"incarnation": "i1", "results": []}),
                               ("POST", "/v1/jobs/b-job/snapshots", {"mode": "stop"}),
                               ("GET", "/v1/jobs/b-job", None), ("GET", "/v1/jobs", None),
                               ("POST", "/v1/agents/register", {"job": "b-job", "nnodes": 1, "node_rank": 0,
                                                                "incarnation": "evil"})]:
        with pytest.raises(Forbidden):
            call(scoped, a, method, path, body)
    with pytest.raises(Forbidden):  # a tenant's bootstrap registers only its tenant's jobs
        register(scoped, BA, "b-job")
    assert scoped.coordinator.catalog.snapshots("b-job", False) == []
    assert scoped.coordinator.catalog.agents("b-job")[0]["incarnation"] == "i1"  # not taken over


def test_a_tenant_sees_and_stops_only_its_own_jobs(scoped: service.Server, tmp_path: Path) -> None:
    register(scoped, BA, "a-job")
    register(scoped, BB, "b-job")
    a = CoordinatorClient(scoped.url, TA)
    assert [j["job"] for j in a.jobs()] == ["a-job"]
    assert {j["job"] for j in CoordinatorClient(scoped.url, ADMIN).jobs()} == {"a-job", "b-job"}
    for fn in (lambda: a.job("b-job"), lambda: a.snapshot("b-job", stop=True, wait=False),
               lambda: a.snapshots("b-job")):
        with pytest.raises(Forbidden) as e:
            fn()
        assert "not one of tenant a's jobs" in e.value.why
    assert scoped.coordinator.catalog.snapshots("b-job", False) == []
    # its own job, end to end: simulated agents bootstrapped with the tenant's bootstrap credential
    c = SimCluster(scoped.url, BA, tmp_path / "store", job="a-sim", nnodes=2, wait_s=FAST.poll_wait_s).start()
    try:
        assert all(r.issued and r.credential() != BA for r in c.runners)
        s = a.snapshot("a-sim", stop=False, timeout_s=20)
        assert s["state"] == "verified"
        assert [x["id"] for x in a.snapshots()] == [s["id"]]
        assert CoordinatorClient(scoped.url, TB).snapshots() == []
        with pytest.raises(Forbidden):
            CoordinatorClient(scoped.url, TB).snapshot_detail(s["id"])
    finally:
        c.close()
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert {"who": "tenant:a", "action": "snapshot", "job": "a-sim", "status": 200} \
        .items() <= next(x for x in audit if x["action"] == "snapshot" and x["status"] == 200).items()
    stop = next(x for x in audit if x["action"] == "stop")
    assert stop["who"] == "tenant:a" and stop["job"] == "b-job" and stop["status"] == 403
    assert any(x["action"] == "register" and x["who"] == "bootstrap:a" and x["job"] == "a-sim" for x in audit)


def test_unknown_paths_need_a_credential_and_big_bodies_are_refused_unread(scoped: service.Server) -> None:
    status, doc, _ = raw_request(scoped, "GET /v1/no/such/thing HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 401 and doc["error"] == "unauthorized"
    status, doc, _ = raw_request(scoped, f"GET /v1/no/such/thing HTTP/1.1\r\nAuthorization: Bearer {ADMIN}\r\n\r\n")
    assert status == 404
    assert raw_request(scoped, "GET /v1/health HTTP/1.1\r\n\r\n")[0] == 200
    # 50 MB announced, none sent: refused at once (a read would wait for the bytes)
    status, doc, took = raw_request(scoped, f"POST /v1/agents/register HTTP/1.1\r\nAuthorization: Bearer {BA}\r\n"
                                    f"Content-Length: {50 << 20}\r\n\r\n")
    assert status == 413 and "too large" in doc["what"] and took < 5
    status, _, _ = raw_request(scoped, f"POST /v1/agents/register HTTP/1.1\r\nContent-Length: {50 << 20}\r\n\r\n")
    assert status == 401  # and before anything, the credential


def test_a_body_nested_past_the_parser_is_a_400(scoped: service.Server) -> None:
    body = "[" * 200_000
    status, doc, _ = raw_request(scoped, f"POST /v1/jobs/a-x/snapshots HTTP/1.1\r\nAuthorization: Bearer {ADMIN}\r\n"
                                 f"Content-Length: {len(body)}\r\n\r\n{body}")
    assert status == 400 and "not JSON" in doc["what"], doc


def test_failed_attempts_are_rate_limited(scoped: service.Server) -> None:
    for _ in range(8):
        with pytest.raises(Unauthorized):
            call(scoped, "guess-" + os.urandom(8).hex(), "GET", "/v1/jobs")
    with pytest.raises(Unauthorized) as e:
        call(scoped, ADMIN, "GET", "/v1/jobs")  # even the right one, from this address, for now
    assert "too many failed" in e.value.why


# ---- TLS -------------------------------------------------------------------------------------------------------


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
          ca: bool) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer[0] if issuer else name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    return b.sign(issuer[1] if issuer else key, hashes.SHA256())


def make_pki(d: Path, name: str) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed, as PEM files."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"{name} CA", ca_key, None, True)
    out: dict[str, Path] = {}
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"{name} {who}", key, (ca.subject, ca_key), False)
        out[f"{who}.crt"] = d / f"{name}-{who}.crt"
        out[f"{who}.key"] = d / f"{name}-{who}.key"
        out[f"{who}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{who}.key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    out["ca"] = d / f"{name}-ca.crt"
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return out


def test_tls_serves_its_clients_and_a_wrong_ca_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good, other = make_pki(tmp_path, "good"), make_pki(tmp_path, "other")
    ctx = security.server_context(good["server.crt"], good["server.key"], good["ca"])  # client certificates required
    srv, _ = service.start("127.0.0.1:0", tmp_path / "catalog.db", ADMIN, FAST, log=lambda _m: None, tls=ctx)
    try:
        assert srv.url.startswith("https://")
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_CA", str(good["ca"]))
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_CERT", str(good["client.crt"]))
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_KEY", str(good["client.key"]))
        c = SimCluster(srv.url, ADMIN, tmp_path / "store", job="tls", nnodes=1, wait_s=FAST.poll_wait_s).start()
        try:
            assert CoordinatorClient(srv.url, ADMIN).snapshot("tls", timeout_s=20)["state"] == "verified"
        finally:
            c.close()
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_CA", str(other["ca"]))
        with pytest.raises(TlsError) as e:
            CoordinatorClient(srv.url, ADMIN).jobs()
        assert "does not trust" in e.value.what and str(other["ca"]) in e.value.why
        assert "CRYOSLEEP_COORDINATOR_CA" in e.value.hint
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_CA", str(good["ca"]))
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_CERT", str(other["client.crt"]))  # a client the CA did not sign
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_KEY", str(other["client.key"]))
        with pytest.raises(TlsError):
            CoordinatorClient(srv.url, ADMIN).jobs()
        plain = socket.create_connection(srv.server_address[:2], timeout=10)  # plain HTTP to a TLS port: no answer
        plain.sendall(b"GET /v1/health HTTP/1.1\r\n\r\n")
        assert not plain.recv(4096).startswith(b"HTTP")
        plain.close()
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_CERT", str(good["client.crt"]))
        monkeypatch.setenv("CRYOSLEEP_COORDINATOR_KEY", str(good["client.key"]))
        assert CoordinatorClient(srv.url, ADMIN).health()["ok"]  # still serving
    finally:
        service.shutdown(srv)
        srv.coordinator.catalog.close()
    with pytest.raises(UsageError):
        security.server_context(good["server.crt"], other["server.key"])


def test_serve_refuses_a_readable_credentials_file_and_mixed_options(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from cryosleep.cli.main import main

    f = tmp_path / "creds.json"
    f.write_text(json.dumps(DOC))
    f.chmod(0o644)
    serve = ["coordinator", "serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"), "--json"]
    assert main([*serve, "--credentials", str(f)]) == 2
    assert "chmod 600" in capsys.readouterr().out
    (tmp_path / "token").write_text(ADMIN)
    assert main([*serve, "--credentials", str(f), "--token-file", str(tmp_path / "token")]) == 2
    assert "not both" in capsys.readouterr().out
    f.chmod(0o600)
    assert main([*serve, "--credentials", str(f), "--tls-cert", str(f)]) == 2
    assert "--tls-key" in capsys.readouterr().out
