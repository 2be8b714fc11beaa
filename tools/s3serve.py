"""A real S3 server on loopback for the store's tests and benchmarks: Ceph's RADOS Gateway, standalone.

Why this server: the S3 backend must be tested against a real server (a client-patching mock proves nothing
about multipart, checksums, or a server dying mid-upload). The obvious candidate, ``rclone serve s3``, is
not built into Debian's rclone (Debian unstable's 1.75 lacks the ``serve s3`` command; Debian 12's 1.60
predates it), and no maintained S3 server ships on PyPI. Debian does ship Ceph's ``radosgw``, the S3
implementation that production Ceph clusters serve, and since Ceph Squid it runs without a cluster: the
*dbstore* backend keeps users and bucket metadata in SQLite and the *posix* filter stores every object as a
plain file (``rgw backend store = dbstore``, ``rgw filter = posix``). Measured here: PUT, GET, ranged GET,
multipart, Content-MD5 and x-amz-checksum validation all behave as on AWS; the bare dbstore backend without
the posix filter returns wrong bytes for ranged GETs and multipart objects, so the filter is not optional.

How it is installed: like CRIU (with the shared prefix installer, ``cryosleep.core.debs``), from
Debian unstable into a *private prefix* (``$CRYOSLEEP_HOME/radosgw/<version>/``, or
``$CRYOSLEEP_RADOSGW_ROOT/<version>/``) started through the prefix's own dynamic loader, never touching
the system's apt state or libraries. ``radosgw.lock.json`` pins every .deb (name, version, pool file,
size, SHA-256) of the gateway's runtime library closure; packages that the gateway never loads (Python,
systemd, the RBD and CephFS libraries...) are excluded. Debian unstable moves on and drops superseded
versions from its mirrors, so when the pinned versions are no longer served the install takes the
current versions of the same packages, authenticated by the archive's signed index as apt does, says so,
and records them in the prefix's marker; ``update-lock`` re-pins.

Module CLI (``make s3server`` runs ``install``)::

    python tools/s3serve.py [--json] install [--force]
    python tools/s3serve.py [--json] status
    python tools/s3serve.py [--json] update-lock [--out FILE]
    python tools/s3serve.py serve DIR [--port P]      (until interrupted; prints the credentials)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from cryosleep import paths
from cryosleep.core import debs
from cryosleep.errors import CryosleepError

__all__ = ["LOCK_PATH", "RadosgwUnavailable", "S3Server", "install", "locate", "status", "update_lock"]

LOCK_PATH = Path(__file__).with_name("radosgw.lock.json")
MARKER_NAME = debs.MARKER_NAME
ROOT_PACKAGES = ("radosgw",)
# In the apt closure of radosgw but never loaded by the radosgw and radosgw-admin binaries or the plugins
# they dlopen (checked with the prefix loader's --list): left out to keep the prefix and the lock small.
EXCLUDED_PACKAGES = frozenset({
    "adduser", "base-passwd", "ca-certificates", "debconf", "dmsetup", "gcc-16-base", "libatomic1",
    "libbabeltrace1", "libboost-locale1.92.0", "libboost-program-options1.92.0", "libboost-url1.92.0",
    "libc-gconv-modules-extra", "libcap-ng0", "libcephfs2", "libcryptsetup12", "libdb5.3t64",
    "libdevmapper1.02.1", "libdw1t64", "libelf1t64", "libglib2.0-0t64", "libjson-c5", "libmount1", "libnbd0",
    "libncurses6", "libpam-modules", "libpam-modules-bin", "libpcre2-8-0", "libpopt0", "libradosstriper1",
    "librbd1", "libsasl2-modules-db", "libselinux1", "libsystemd0", "libtcmalloc-minimal4t64", "libtinfo6",
    "libuuid1", "libxml2-16", "login.defs", "media-types", "netbase", "openssl", "openssl-provider-legacy",
    "opensysusers",
    "passwd", "python3", "python3-ceph-argparse", "python3-ceph-common", "python3-cephfs", "python3-minimal",
    "python3-prettytable", "python3-rados", "python3-rbd", "python3-requests", "python3-yaml",
    "readline-common", "systemd", "systemd-standalone-sysusers", "tzdata",
})  # fmt: skip
INSTALL_HINT = (
    "run `make s3server` (or `python tools/s3serve.py install`) on a machine that reaches a Debian "
    "mirror, or point $CRYOSLEEP_RADOSGW_ROOT at a directory holding an installed prefix"
)
UPDATE_HINT = "run `python tools/s3serve.py update-lock` to pin the versions the archive serves now"
_START_TIMEOUT_S = 60.0


class RadosgwUnavailable(CryosleepError):
    kind = "radosgw_unavailable"


def _root() -> Path:
    env = os.environ.get("CRYOSLEEP_RADOSGW_ROOT")
    return Path(env) if env else paths.home() / "radosgw"


# ---------------------------------------------------------------------------------------------- the lock


@dataclass(frozen=True)
class GatewayLock:
    suite: str
    architecture: str
    version: str  # radosgw's Debian version: names the prefix
    packages: tuple[debs.LockedPackage, ...]
    raw: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def prefix_dir(self) -> Path:
        return _root() / self.version.replace(":", "_").replace("/", "_")


def load_lock(path: Path | None = None) -> GatewayLock:
    path = path or LOCK_PATH
    try:
        data = json.loads(path.read_text())
        pkgs = tuple(
            debs.LockedPackage(str(p["name"]), str(p["version"]), str(p["filename"]), str(p["sha256"]).lower(),
                             int(p["size"]))
            for p in data["packages"]
        )
        version = next(p.version for p in pkgs if p.name == "radosgw")
        lock = GatewayLock(str(data["suite"]), str(data["architecture"]), version, pkgs, dict(data))
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise RadosgwUnavailable(f"the radosgw lock {path} is not valid", repr(e),
                                 "restore it from the Cryosleep source tree, or regenerate it with "
                                 "`python tools/s3serve.py update-lock`") from e
    for p in pkgs:
        if not re.fullmatch(r"[0-9a-f]{64}", p.sha256) or not p.basename.endswith(".deb"):
            raise RadosgwUnavailable(f"the radosgw lock {path} is not valid", f"bad entry {p}", "")
    return lock


def _lock_raw(suite: str, arch: str, records: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "suite": suite,
        "architecture": arch,
        "roots": list(ROOT_PACKAGES),
        "packages": [{"name": r["Package"], "version": r["Version"], "filename": r["Filename"],
                      "sha256": r["SHA256"], "size": int(r["Size"])} for r in records],
    }


def update_lock(*, out: Path | None = None, suite: str = "unstable") -> Path:
    """Pin the radosgw closure (less EXCLUDED_PACKAGES) that Debian ``suite`` serves now."""
    arch = debs.host_arch()
    with tempfile.TemporaryDirectory(prefix="cryosleep-apt-") as td:
        apt = debs.PrivateApt(debs.debian_mirror(), suite, arch.debian, Path(td), install_hint=INSTALL_HINT,
                              update_hint=UPDATE_HINT)
        apt.update()
        names = apt.closure(ROOT_PACKAGES, EXCLUDED_PACKAGES)
        records = sorted((r for r in apt.records(names) if "Package" in r), key=lambda r: r["Package"])
    target = out or LOCK_PATH
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(_lock_raw(suite, arch.debian, records), indent=2) + "\n")
    load_lock(tmp)
    os.replace(tmp, target)
    return target


# ------------------------------------------------------------------------------------------------ install


def _argv(prefix: Path, binary: str) -> list[str]:
    arch = debs.host_arch()
    return [*debs.prefix_argv(prefix, arch, f"usr/bin/{binary}")]


def _libdirs(prefix: Path) -> str:
    arch = debs.host_arch()
    dirs = [prefix / "usr/lib" / arch.multiarch, prefix / "lib" / arch.multiarch,
            prefix / "usr/lib" / arch.multiarch / "ceph"]
    return ":".join(str(d) for d in dirs if d.is_dir())


def _command(prefix: Path, binary: str, *args: str) -> list[str]:
    argv = _argv(prefix, binary)
    argv[2] = _libdirs(prefix)  # the loader's --library-path, plus ceph's private library directory
    return [*argv, *args]


def _download(lock: GatewayLock, dest: Path, say: debs.Say) -> tuple[dict[str, Path], list[str], str]:
    """The .debs to unpack: the pinned ones when still served (checked against the lock), else the current
    versions of the same packages (checked by apt against the signed index). Returns (debs, versions, how)."""
    cache = _root() / ".debs"
    cache.mkdir(parents=True, exist_ok=True)
    have = {p.name: cache / p.basename for p in lock.packages}
    need = [p for p in lock.packages if debs.mismatch(p, have[p.name]) is not None]
    pinned = [f"{p.name}={p.version}" for p in lock.packages]
    if not need:
        return have, pinned, "pinned (cached)"
    mirror = debs.debian_mirror()
    say(f"downloading {len(need)} packages of radosgw {lock.version} from Debian {lock.suite} ({mirror.origin})")
    with tempfile.TemporaryDirectory(prefix=".apt-", dir=_root()) as td:
        apt = debs.PrivateApt(mirror, lock.suite, lock.architecture, Path(td), install_hint=INSTALL_HINT,
                              update_hint=UPDATE_HINT)
        apt.update()
        landing = Path(td) / "debs"
        landing.mkdir()
        try:
            got = apt.download(need, landing)
        except CryosleepError as e:
            if "no longer served" not in e.what:
                raise RadosgwUnavailable("downloading the radosgw packages failed", e.why, INSTALL_HINT) from e
            say("the pinned versions are no longer served; taking the current ones (run update-lock to re-pin)")
            recs = {r["Package"]: r for r in apt.records([p.name for p in lock.packages]) if "Package" in r}
            missing = [p.name for p in lock.packages if p.name not in recs]
            if missing:
                raise RadosgwUnavailable(f"Debian {lock.suite} no longer has {', '.join(missing)}", "",
                                         "run `python tools/s3serve.py update-lock`, then install") from e
            current = [debs.LockedPackage(n, r["Version"], r["Filename"], r["SHA256"].lower(), int(r["Size"]))
                       for n, r in recs.items()]
            out = apt.download(current, dest)
            bad = [m for p in current if (m := debs.mismatch(p, out[p.name]))]
            if bad:
                raise RadosgwUnavailable("downloaded radosgw packages do not match the archive's index",
                                         "; ".join(bad), "try again; check the mirror") from e
            return out, [f"{p.name}={p.version}" for p in current], "current (pinned versions gone)"
        bad = [m for p in need if (m := debs.mismatch(p, got[p.name]))]
        if bad:
            raise RadosgwUnavailable("downloaded radosgw packages do not match the lock", "; ".join(bad),
                                     "do not use them; try again, or check the mirror")
        for p in need:
            os.replace(got[p.name], have[p.name])
    return have, pinned, "pinned"


def install(*, force: bool = False, progress: debs.Say | None = None) -> Path:
    """Install the gateway into its private prefix (a no-op when the marker matches the lock); the prefix."""
    say = progress or (lambda _m: None)
    lock = load_lock()
    host = debs.host_arch()
    if lock.architecture != host.debian:
        raise RadosgwUnavailable(f"the radosgw lock is for {lock.architecture}, this machine is {host.debian}",
                                 f"{LOCK_PATH} pins {lock.architecture}",
                                 "run `python tools/s3serve.py update-lock` on this machine")
    root = _root()
    final = lock.prefix_dir()
    with debs.install_lock(root):
        marker = debs.read_marker(final)
        if not force and marker is not None and marker.get("lock_sha256") == lock.digest:
            say(f"radosgw {lock.version} is already installed at {final}")
            return final
        for d in root.iterdir():
            if d.name.startswith((".install-", ".old-", ".apt-")) and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=".install-", dir=root))
        try:
            (staging / "debs").mkdir()
            got, versions, how = _download(lock, staging / "debs", say)
            tree = staging / "prefix"
            tree.mkdir()
            for deb in got.values():
                debs.extract_deb(deb, tree)
            r = subprocess.run(_command(tree, "radosgw", "--version"), capture_output=True, text=True,
                               timeout=60, check=False)
            m = re.search(r"ceph version (\S+)", r.stdout + r.stderr)
            if r.returncode != 0 or m is None:
                raise RadosgwUnavailable("the unpacked radosgw does not run", (r.stdout + r.stderr)[-2000:],
                                         INSTALL_HINT)
            marker = {"lock_sha256": lock.digest, "version": m.group(1), "packages": versions, "source": how,
                      "installed_at": datetime.now(UTC).isoformat(timespec="seconds")}
            (tree / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            tree.chmod(0o755)
            debs.swap_into_place(tree, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    say(f"installed radosgw {marker['version']} ({how}) at {final}")
    return final


def locate() -> Path:
    """The installed gateway prefix, or RadosgwUnavailable saying how to install it."""
    try:
        lock = load_lock()
    except RadosgwUnavailable:
        raise
    prefix = lock.prefix_dir()
    if debs.read_marker(prefix) is not None and (prefix / "usr/bin/radosgw").exists():
        return prefix
    raise RadosgwUnavailable("no S3 test server (radosgw) is installed",
                             f"no installed prefix at {prefix}", INSTALL_HINT)


def status() -> dict[str, object]:
    out: dict[str, object] = {"root": str(_root())}
    try:
        prefix = locate()
    except CryosleepError as e:
        out.update(available=False, error=e.to_json())
        return out
    out.update(available=True, prefix=str(prefix), **(debs.read_marker(prefix) or {}))
    return out


# ------------------------------------------------------------------------------------------- the server


def _die_with_parent() -> None:
    """In the child before exec: be killed when the process that started the server dies (a test run that
    is killed leaves no server behind)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class S3Server:
    """A standalone radosgw on 127.0.0.1 keeping everything under ``root`` (objects as files under
    ``root/objects/<bucket>/``), with one user whose keys are ``access_key``/``secret_key``.

    ``start()`` returns once the port answers; ``stop()`` kills the process (SIGKILL by default: the tests
    use it to simulate a server dying mid-upload); ``start()`` again brings it back on the same port, data
    and keys.
    """

    root: Path
    port: int = 0
    access_key: str = field(default_factory=lambda: "CRYO" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(30))
    prefix: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables a client reads to reach this server (what an operator would set)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def log(self) -> Path:
        return self.root / "radosgw.log"

    def _conf(self, prefix: Path) -> Path:
        arch = debs.host_arch()
        plugins = prefix / "usr/lib" / arch.multiarch / "ceph"
        r = self.root
        for d in ("objects", "lmdb", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        conf = r / "ceph.conf"
        conf.write_text(
            "[global]\n"
            f"plugin dir = {plugins}\n"
            f"run dir = {r / 'run'}\n"
            f"admin socket = {r / 'run'}/$name.asok\n"
            f"log file = {self.log}\n"
            "[client.rgw.cryo]\n"
            "rgw backend store = dbstore\n"
            "rgw config store = dbstore\n"
            "rgw filter = posix\n"
            f"rgw posix base path = {r / 'objects'}\n"
            f"rgw posix database root = {r / 'lmdb'}\n"
            f"dbstore db dir = {r}\n"
            f"dbstore config uri = file:{r / 'config.db'}\n"
            f"rgw data = {r}\n"
            f"rgw frontends = beast endpoint=127.0.0.1:{self.port}\n"
            "rgw thread pool size = 64\n"
            "rgw posix cache max buckets = 65536\n"
        )
        return conf

    def _admin(self, prefix: Path, conf: Path, *args: str) -> str:
        cmd = _command(prefix, "radosgw-admin", "--no-mon-config", "-c", str(conf), "-n", "client.rgw.cryo", *args)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if r.returncode != 0:
            raise RadosgwUnavailable(f"radosgw-admin {args[0]} failed", (r.stderr or r.stdout)[-2000:], "")
        return r.stdout

    def start(self) -> S3Server:
        prefix = self.prefix or locate()
        self.root.mkdir(parents=True, exist_ok=True)
        keys = self.root / "keys.json"
        if keys.exists():  # a restart: same keys, same port
            saved = json.loads(keys.read_text())
            self.access_key, self.secret_key = saved["access_key"], saved["secret_key"]
            self.port = self.port or int(saved["port"])
        if not self.port:
            self.port = free_port()
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                raise RadosgwUnavailable(f"port {self.port} is already in use", "another server listens there",
                                         "stop it, or start this one on another port")
        conf = self._conf(prefix)
        if not keys.exists():
            self._admin(prefix, conf, "user", "create", "--uid", "cryosleep", "--display-name", "cryosleep",
                        "--access-key", self.access_key, "--secret", self.secret_key)
            keys.write_text(json.dumps({"access_key": self.access_key, "secret_key": self.secret_key,
                                        "port": self.port}))
        cmd = _command(prefix, "radosgw", "-f", "--no-mon-config", "-c", str(conf), "-n", "client.rgw.cryo")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        end = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                text = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
                self.proc = None
                raise RadosgwUnavailable("radosgw exited at start", text, f"see {self.log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RadosgwUnavailable(f"radosgw did not listen on port {self.port} in {_START_TIMEOUT_S:.0f} s", "",
                                 f"see {self.log}")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, sig)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def create_bucket(self, bucket: str) -> None:
        """PUT /bucket, signed with AWS Signature V4 (the store itself never creates buckets)."""
        _signed_request(self.endpoint, "PUT", f"/{bucket}", self.access_key, self.secret_key)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _signed_request(endpoint: str, method: str, path: str, access: str, secret: str,
                    region: str = "us-east-1") -> bytes:
    """One S3 request with an empty body, signed with SigV4 (enough for bucket creation in tests)."""
    import hmac
    import http.client

    host = endpoint.split("://", 1)[1]
    now = datetime.now(UTC)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(b"").hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    auth = f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={signed}, Signature={sig}"
    conn = http.client.HTTPConnection(host, timeout=30)
    try:
        conn.request(method, path, body=b"", headers={**headers, "Authorization": auth})
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    if r.status >= 300:
        raise RadosgwUnavailable(f"{method} {path} failed: HTTP {r.status}", body.decode(errors="replace")[:500], "")
    return body


# ---------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/s3serve.py",
                                description="Install and run the loopback S3 server the store's tests use.")
    p.add_argument("--json", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install").add_argument("--force", action="store_true")
    sub.add_parser("status")
    sub.add_parser("update-lock").add_argument("--out", type=Path)
    s = sub.add_parser("serve")
    s.add_argument("dir", type=Path)
    s.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        result: dict[str, object]
        if a.cmd == "install":
            result = {"prefix": str(install(force=a.force, progress=say))}
        elif a.cmd == "status":
            result = status()
        elif a.cmd == "update-lock":
            result = {"lock": str(update_lock(out=a.out))}
        else:
            srv = S3Server(a.dir.resolve(), port=a.port).start()
            print(json.dumps(srv.env()), flush=True)
            try:
                assert srv.proc is not None
                srv.proc.wait()
            except KeyboardInterrupt:
                srv.stop(signal.SIGTERM)
            return 0
    except CryosleepError as e:
        if a.json:
            print(json.dumps(e.to_json(), indent=2))
        else:
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(result, indent=2) if a.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
