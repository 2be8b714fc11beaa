"""Tests of CRIU provisioning: the lock, bundles, the private prefix (with its iproute2), locate() and the
apt source parsing.

One real bundle is downloaded per session (about 16 MB from the Debian mirror this machine's apt uses) and
every install test installs from it into its own temporary $CRYOSLEEP_HOME. Installing runs `criu check`,
which needs root.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cryosleep import paths
from cryosleep.capture import criu_install as ci
from cryosleep.core import debs, toolprefix
from cryosleep.errors import CriuUnavailable, CryosleepError, IprouteUnavailable, NetError
from cryosleep.net import tools as net_tools
from cryosleep.net.host import Host

needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get to download packages")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="criu check needs root")

ENV_VARS = ("CRYOSLEEP_HOME", "CRYOSLEEP_CRIU", "CRYOSLEEP_CRIU_ROOT", "CRYOSLEEP_DEBIAN_MIRROR", "CR_IP_TOOL")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets an empty home and no overrides; locate()'s cache never leaks between tests."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("CRYOSLEEP_HOME", str(home))
    ci.reset_cache()
    yield home
    ci.reset_cache()


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONE real offline bundle for the whole session (downloaded into a throwaway home's cache)."""
    if shutil.which("apt-get") is None:
        pytest.skip("needs apt-get to download packages")
    base = tmp_path_factory.mktemp("bundle")
    with pytest.MonkeyPatch.context() as mp:
        for var in ENV_VARS:
            mp.delenv(var, raising=False)
        mp.setenv("CRYOSLEEP_HOME", str(base / "home"))
        (base / "out").mkdir()
        return ci.make_bundle(base / "out")


def _fake_criu(directory: Path, version: str, check_ok: bool = True) -> Path:
    """A shell script that answers --version and check like criu does."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "criu"
    check = 'echo "Looks good."; exit 0' if check_ok else 'echo "Error: something missing" >&2; exit 1'
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in\n  --version) echo "Version: {version}";;\n  check) {check};;\n  *) exit 3;;\nesac\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def _empty_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))
    return empty


def _rewrite_bundle(src: Path, dst: Path, edit: dict[str, bytes]) -> None:
    """Copy a bundle, replacing the members named in ``edit`` with new contents."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin:
            f = tin.extractfile(member)
            assert f is not None
            data = edit.get(member.name, f.read())
            member.size = len(data)
            tout.addfile(member, io.BytesIO(data))


# ------------------------------------------------------------------------------------------------- lock


def test_lock_pins_criu_nft_and_iproute2_closure() -> None:
    lock = toolprefix.load_lock()
    names = {p.name for p in lock.packages}
    assert lock.suite == "unstable"
    assert lock.criu_version == "4.2.1-1"
    assert lock.upstream_version == "4.2.1"
    assert {"criu", "nftables", "iproute2", "libc6", "libnftables1", "libcompel1", "libbpf1"} <= names
    assert lock.raw["roots"] == list(ci.ROOT_PACKAGES)
    assert len(names) == len(lock.packages)
    for p in lock.packages:
        assert len(p.sha256) == 64 and p.size > 0
        assert p.filename.startswith("pool/") and p.basename.endswith(".deb")
    raw = json.loads(toolprefix.LOCK_PATH.read_text())
    assert set(raw) >= {"suite", "criu_version", "packages"}
    assert set(raw["packages"][0]) == {"name", "version", "filename", "sha256", "size"}


def test_bundle_holds_lock_and_every_deb(bundle: Path) -> None:
    lock = toolprefix.load_lock()
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
        f = tar.extractfile(ci.LOCK_MEMBER)
        assert f is not None
        assert toolprefix.parse_lock(json.load(f), "bundle").digest == lock.digest
    assert names == {ci.LOCK_MEMBER} | {p.basename for p in lock.packages}


# ---------------------------------------------------------------------------------------------- install


@needs_root
def test_install_from_bundle_then_locate(
    bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _empty_path(tmp_path, monkeypatch)  # no system criu or nft may win over the prefix
    said: list[str] = []
    criu = ci.install(bundle=bundle, progress=said.append)
    prefix = paths.criu_root() / "4.2.1-1"
    assert criu.source == "prefix" and criu.prefix == prefix
    assert any(s.startswith("criu check: Looks good") for s in said), said
    marker = json.loads((prefix / debs.MARKER_NAME).read_text())
    assert marker["lock_sha256"] == toolprefix.load_lock().digest
    assert not [p for p in paths.criu_root().iterdir() if p.name.startswith(".install-")]

    found = ci.locate()
    assert found == criu
    assert found.version.startswith("4.2.")
    assert found.argv[1] == "--library-path" and found.argv[-1] == str(prefix / "usr/sbin/criu")
    out = found.run(["--version"])
    assert out.returncode == 0 and "Version: 4.2." in out.stdout
    assert found.nft_argv is not None
    nft = subprocess.run(found.nft_command("--version"), capture_output=True, text=True, check=False)
    assert nft.returncode == 0 and nft.stdout.startswith("nftables v")

    st = ci.status()
    assert st["available"] is True and st["source"] == "prefix"
    assert st["pinned_prefix_current"] is True


@needs_root
def test_reinstall_is_idempotent_and_force_replaces(bundle: Path) -> None:
    first = ci.install(bundle=bundle)
    assert first.prefix is not None
    marker = first.prefix / debs.MARKER_NAME
    inode = marker.stat().st_ino
    said: list[str] = []
    t0 = time.monotonic()
    again = ci.install(bundle=bundle, progress=said.append)
    assert time.monotonic() - t0 < 1.0
    assert again == first and marker.stat().st_ino == inode
    assert any("already installed" in s for s in said)
    forced = ci.install(bundle=bundle, force=True)
    assert forced == first and marker.stat().st_ino != inode
    assert not [p for p in paths.criu_root().iterdir() if p.name.startswith((".install-", ".old-"))]


# --------------------------------------------------------------------------------------------- iproute2


def _bin_dir(tmp_path: Path, name: str, **links: str | Path) -> Path:
    """A directory holding only ``links`` (program name -> target), to serve as the whole PATH."""
    d = tmp_path / name
    d.mkdir()
    for prog, target in links.items():
        (d / prog).symlink_to(target)
    return d


def _ip_json(argv: tuple[str, ...] | list[str], *args: str) -> list[dict[str, Any]]:
    r = subprocess.run([*argv, "-j", *args], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    out: list[dict[str, Any]] = json.loads(r.stdout or "[]")
    return out


# Found while PATH is still the real one: the iproute2 tests run with a PATH that lacks ip.
TOOLS = {t: shutil.which(t) or "" for t in ("unshare", "setsid", "sleep", "nsenter")}
needs_tools = pytest.mark.skipif(not all(TOOLS.values()), reason=f"needs {', '.join(TOOLS)} (util-linux)")


def _netns_process(*opts: str) -> tuple[subprocess.Popen[bytes], int]:
    """``unshare --net`` (and the other ``opts``) running sleep; (the unshare process, the pid whose network
    namespace is the new one: with ``--fork``, unshare's child, made a session leader like a sandbox init)."""
    fork = "--fork" in opts
    cmd = [TOOLS["unshare"], *opts, "--", *([TOOLS["setsid"]] if fork else []), TOOLS["sleep"], "120"]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 5
    while True:
        pid: int | None = p.pid
        if fork:  # unshare itself enters the new network namespace too, but only its child the PID one
            kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            pid = int(kids[0]) if kids else None
        if pid is not None and os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net"):
            return p, pid
        assert time.monotonic() < end, "unshare did not make a network namespace"
        time.sleep(0.01)


@needs_root
@needs_tools
def test_prefix_ip_runs_and_stands_in_for_a_missing_system_ip(
    bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    criu = ci.install(bundle=bundle)
    assert criu.prefix is not None
    wrapper = criu.prefix / net_tools.WRAPPERS_DIR / "ip"
    version = subprocess.run([str(wrapper), "-V"], capture_output=True, text=True, env={}, check=False)
    assert version.returncode == 0 and "iproute2-" in version.stdout, version.stderr
    assert "lo" in {x["ifname"] for x in _ip_json([str(wrapper)], "link", "show")}
    assert isinstance(_ip_json([str(criu.prefix / net_tools.WRAPPERS_DIR / "bridge")], "link", "show"), list)

    # A system ip on PATH wins (a link to the wrapper stands for it, so that this runs on any machine).
    nsenter = TOOLS["nsenter"]
    system = _bin_dir(tmp_path, "system-bin", ip=wrapper, nsenter=nsenter)
    monkeypatch.setenv("PATH", str(system))
    assert net_tools.iproute_argv("ip") == (str(system / "ip"),)
    assert net_tools.ip_tool() == str(system / "ip") == criu.env()["CR_IP_TOOL"]

    # No ip on PATH: the prefix's, run through the prefix's loader exactly like its criu.
    bare = _bin_dir(tmp_path, "bare-bin", nsenter=nsenter)
    monkeypatch.setenv("PATH", str(bare))
    for tool in net_tools.IPROUTE_TOOLS:
        argv = net_tools.iproute_argv(tool)
        assert argv[:3] == criu.argv[:3] and Path(argv[3]).name == tool
        assert Path(argv[3]).is_relative_to(criu.prefix)
    addrs = _ip_json(net_tools.iproute_argv("ip"), "addr", "show", "lo")
    assert "127.0.0.1" in {a["local"] for link in addrs for a in link["addr_info"]}
    assert net_tools.ip_tool() == str(wrapper) == criu.env()["CR_IP_TOOL"]
    assert criu.env({"CR_IP_TOOL": "/opt/ip"})["CR_IP_TOOL"] == "/opt/ip"  # the user's choice is kept

    # The job network code runs it the same way, also inside another namespace (through nsenter).
    proc, pid = _netns_process("--net")
    try:
        assert [x["ifname"] for x in Host(pid).links()] == ["lo"]
    finally:
        proc.kill()
        proc.wait()


@needs_root
@needs_tools
def test_criu_dumps_and_restores_a_netns_with_the_prefix_ip(
    bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRIU runs $CR_IP_TOOL to save and restore a namespace's addresses and routes; with no ip on PATH it
    fails ("IP tool failed on addr save") unless the variable names the prefix's wrapper."""
    criu = ci.install(bundle=bundle)
    assert criu.prefix is not None
    monkeypatch.setenv("PATH", str(_bin_dir(tmp_path, "bare-bin", nsenter=TOOLS["nsenter"])))
    assert criu.env()["CR_IP_TOOL"] == str(criu.prefix / net_tools.WRAPPERS_DIR / "ip")
    images = tmp_path / "images"
    images.mkdir()
    proc, init = _netns_process("--pid", "--net", "--fork")
    restored: int | None = None
    try:
        sandbox = Host(init)
        sandbox.ip("link", "set", "lo", "up", what="loopback up")
        sandbox.ip("addr", "add", "10.9.8.7/32", "dev", "lo", what="a test address")
        sandbox.ip("route", "add", "10.77.0.0/16", "dev", "lo", what="a test route")
        r = criu.run(["dump", "-t", str(init), "-D", str(images), "-o", "dump.log", "-v4",
                      "--network-lock", "nftables"])
        log = (images / "dump.log").read_text()
        assert r.returncode == 0, log[-3000:]
        assert "Running ip addr save" in log and "IP tool failed" not in log
        proc.wait(timeout=10)
        r = criu.run(["restore", "-D", str(images), "-o", "restore.log", "-v4", "--restore-detached",
                      "--pidfile", str(images / "pid")])
        assert r.returncode == 0, (images / "restore.log").read_text()[-3000:]
        restored = int((images / "pid").read_text())
        after = Host(restored)
        addrs = json.loads(after.ip("-j", "addr", "show", "lo", what="the restored addresses"))
        assert "10.9.8.7" in {a["local"] for link in addrs for a in link["addr_info"]}
        assert "10.77.0.0/16 dev lo" in after.ip("route", "show", what="the restored routes")
    finally:
        if proc.poll() is None:  # not dumped (a dump ends it): end the sandbox by its PID 1, unshare's child
            os.kill(init, signal.SIGKILL)
        proc.kill()
        proc.wait()
        if restored is not None:
            os.kill(restored, signal.SIGKILL)


def test_no_ip_anywhere_says_what_failed_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _empty_path(tmp_path, monkeypatch)
    prefix = toolprefix.load_lock().prefix_dir()
    with pytest.raises(IprouteUnavailable) as info:
        net_tools.iproute_argv("ip")
    e = info.value
    assert "ip" in e.what and "no ip on PATH" in e.why and str(prefix) in e.why
    assert "cryosleep criu install" in e.hint and "--bundle" in e.hint and "iproute2" in e.hint
    with pytest.raises(NetError) as net:
        Host().links()
    assert net.value.what == "cannot list network interfaces"
    assert "no ip on PATH" in net.value.why and net.value.hint == e.hint
    assert net_tools.ip_tool() is None
    assert "CR_IP_TOOL" not in ci.Criu(("criu",), None, "4.2.1", "system", None).env({})
    # A prefix installed from an older lock, without iproute2, is named as such.
    prefix.mkdir(parents=True)
    (prefix / debs.MARKER_NAME).write_text("{}")
    with pytest.raises(IprouteUnavailable, match="iproute2") as info:
        net_tools.iproute_argv("bridge")
    assert "older lock" in info.value.why and net_tools.ip_tool() is None


def test_tampered_deb_is_refused_and_nothing_installed(
    bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = toolprefix.load_lock()
    victim = next(p for p in lock.packages if p.name == "libc6")
    with tarfile.open(bundle) as tar:
        f = tar.extractfile(victim.basename)
        assert f is not None
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0x01
    bad = tmp_path / "tampered.tar"
    _rewrite_bundle(bundle, bad, {victim.basename: bytes(data)})

    with pytest.raises(CryosleepError) as info:
        ci.install(bundle=bad)
    msg = str(info.value)
    assert victim.basename in msg and victim.sha256 in msg
    assert hashlib.sha256(bytes(data)).hexdigest() in msg
    assert "what to do" in msg
    root = paths.criu_root()
    assert not lock.prefix_dir().exists()
    assert [p.name for p in root.iterdir()] == [".install.lock"]
    _empty_path(tmp_path, monkeypatch)
    with pytest.raises(CriuUnavailable):
        ci.locate()


def test_bundle_for_another_lock_is_refused(bundle: Path, tmp_path: Path) -> None:
    raw = json.loads(toolprefix.LOCK_PATH.read_text())
    raw["criu_version"] = "9.9.9-1"
    raw["packages"][0]["version"] = "9.9.9-1"
    other = tmp_path / "other.tar"
    _rewrite_bundle(bundle, other, {ci.LOCK_MEMBER: json.dumps(raw).encode()})
    with pytest.raises(CriuUnavailable, match="different lock"):
        ci.install(bundle=other)
    assert not toolprefix.load_lock().prefix_dir().exists()


def test_python_extraction_matches_dpkg(bundle: Path, tmp_path: Path) -> None:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("needs dpkg-deb to compare with")
    lock = toolprefix.load_lock()
    with tarfile.open(bundle) as tar:
        for name in ("libc6", "nftables"):
            basename = next(p.basename for p in lock.packages if p.name == name)
            tar.extract(basename, tmp_path / "debs", filter="data")
            trees = []
            for use_dpkg in (True, False):
                dest = tmp_path / f"{name}-{use_dpkg}"
                dest.mkdir()
                debs.extract_deb(tmp_path / "debs" / basename, dest, use_dpkg=use_dpkg)
                trees.append(
                    sorted(
                        (str(p.relative_to(dest)), os.readlink(p) if p.is_symlink() else p.stat().st_size)
                        for p in dest.rglob("*")
                        if not p.is_dir() or p.is_symlink()
                    )
                )
            assert trees[0] == trees[1] and trees[0]


@needs_apt
def test_unserved_pinned_version_says_update_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = json.loads(toolprefix.LOCK_PATH.read_text())
    for p in raw["packages"]:
        if p["name"] == "criu":
            p["version"] = raw["criu_version"] = "0.0.1~cryosleep-test-1"
    gone = tmp_path / "gone.lock.json"
    gone.write_text(json.dumps(raw))
    monkeypatch.setattr(toolprefix, "LOCK_PATH", gone)
    with pytest.raises(CriuUnavailable) as info:
        ci.install()
    msg = str(info.value)
    assert "no longer served" in msg and "criu=0.0.1~cryosleep-test-1" in msg
    assert "update-lock" in msg and "bundle" in msg


@needs_apt
@pytest.mark.extended  # minutes of downloads from the archive: the extended tier (CI runs it)
def test_update_lock_resolves_closure(tmp_path: Path) -> None:
    out = ci.update_lock(out=tmp_path / "new.lock.json")
    new = toolprefix.load_lock(out)
    names = {p.name for p in new.packages}
    assert {"criu", "nftables", "iproute2", "libc6", "libnftables1"} <= names
    assert new.suite == "unstable" and new.criu_version.startswith("4.")
    # The archive moves; the names of what criu + nft need move much more slowly.
    assert names == {p.name for p in toolprefix.load_lock().packages}


# ----------------------------------------------------------------------------------------------- locate


def test_nothing_available_raises_with_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _empty_path(tmp_path, monkeypatch)
    with pytest.raises(CriuUnavailable) as info:
        ci.locate()
    err = info.value
    assert "cryosleep criu install" in err.hint
    assert "no criu on PATH" in err.why and "not installed" in err.why
    st = ci.status()
    assert st["available"] is False
    assert isinstance(st["error"], dict) and st["error"]["error"] == "criu_unavailable"


def test_env_override_is_used_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _empty_path(tmp_path, monkeypatch)
    fake = _fake_criu(tmp_path / "custom", "3.1.0", check_ok=False)  # as is: no version or check gate
    monkeypatch.setenv("CRYOSLEEP_CRIU", str(fake))
    criu = ci.locate()
    assert criu.argv == (str(fake),) and criu.source == "system" and criu.prefix is None
    assert criu.version == "3.1.0" and criu.nft_argv is None
    assert criu.command("dump", "-t", "1") == [str(fake), "dump", "-t", "1"]
    monkeypatch.setenv("CRYOSLEEP_CRIU", str(tmp_path / "missing"))
    with pytest.raises(CriuUnavailable, match="CRYOSLEEP_CRIU"):
        ci.locate()


def test_system_criu_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _empty_path(tmp_path, monkeypatch)
    _fake_criu(path, "4.2.1")
    criu = ci.locate()
    assert criu.argv == (str(path / "criu"),) and criu.source == "system" and criu.version == "4.2.1"
    assert criu.run(["check"]).stdout.strip() == "Looks good."
    # Cached per process until reset, even if the binary changes under it.
    _fake_criu(path, "3.17")
    assert ci.locate() is criu
    ci.reset_cache()
    with pytest.raises(CriuUnavailable) as info:
        ci.locate()
    assert "3.17" in info.value.why and ">= 4.2" in info.value.why
    _fake_criu(path, "4.3.0", check_ok=False)
    with pytest.raises(CriuUnavailable, match="fails `criu check`"):
        ci.locate(refresh=True)


# ------------------------------------------------------------------------------------------ apt sources


def test_mirror_from_one_line_sources_list(tmp_path: Path) -> None:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text(
        "# a comment\n"
        "deb-src http://src.invalid/debian bookworm main\n"
        "deb http://security.invalid/debian-security bookworm-security main\n"
        "deb [signed-by=/usr/share/keyrings/other.gpg] http://thirdparty.invalid/apt bookworm main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
        "http://mirror.invalid/debian/ bookworm main contrib  # trailing comment\n"
    )
    (etc / "sources.list.d" / "x.list.disabled").write_text("deb http://disabled.invalid/debian sid main\n")
    m = debs.debian_mirror(etc)
    assert m.uri == "http://mirror.invalid/debian"
    assert m.origin == str(etc / "sources.list")


def test_mirror_one_line_without_signed_by_is_a_fallback(tmp_path: Path) -> None:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text("deb http://unsigned.invalid/debian bullseye main\n")
    assert debs.debian_mirror(etc).uri == "http://unsigned.invalid/debian"
    (etc / "sources.list.d" / "debian.list").write_text(
        "deb [ signed-by=/usr/share/keyrings/debian-archive-keyring.gpg ] "
        "http://mirror.invalid/debian sid main\n"
    )
    assert debs.debian_mirror(etc).uri == "http://mirror.invalid/debian"


def test_mirror_from_deb822_sources(tmp_path: Path) -> None:
    etc = tmp_path / "apt"
    parts = etc / "sources.list.d"
    parts.mkdir(parents=True)
    (parts / "a-thirdparty.sources").write_text(
        "Types: deb\nURIs: https://thirdparty.invalid/node\nSuites: nodistro\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/nodesource.gpg\n"
    )
    (parts / "debian.sources").write_text(
        "Types: deb\n"
        "# a comment inside a paragraph\n"
        "URIs: http://security.invalid/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        "\n"
        "Types: deb\n"
        "URIs: http://disabled.invalid/debian\n"
        "Suites: bookworm\n"
        "Enabled: no\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        "\n"
        "Types: deb-src deb\n"
        "URIs: http://mirror.invalid/debian\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    (parts / "inline.sources").write_text(
        "Types: deb\nURIs: http://inline.invalid/debian\nSuites: trixie\nSigned-By:\n"
        " -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n abc\n -----END PGP PUBLIC KEY BLOCK-----\n"
    )
    m = debs.debian_mirror(etc)
    assert m.uri == "http://mirror.invalid/debian"
    assert m.origin == str(parts / "debian.sources")


def test_mirror_env_override_and_none_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    etc = tmp_path / "apt"
    etc.mkdir()
    (etc / "sources.list").write_text("deb http://archive.invalid/ubuntu noble main\n")
    with pytest.raises(CriuUnavailable, match="Debian mirror") as info:
        debs.debian_mirror(etc)
    assert "CRYOSLEEP_DEBIAN_MIRROR" in info.value.hint
    monkeypatch.setenv("CRYOSLEEP_DEBIAN_MIRROR", "http://override.invalid/debian/")
    m = debs.debian_mirror(etc)
    assert m.uri == "http://override.invalid/debian" and m.origin == "$CRYOSLEEP_DEBIAN_MIRROR"


# -------------------------------------------------------------------------------------------------- CLI


def test_module_cli_status_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_criu(tmp_path / "custom", "4.2.1")
    env = dict(os.environ, CRYOSLEEP_CRIU=str(fake))
    src = Path(ci.__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-m", "cryosleep.capture.criu_install", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["available"] is True and out["argv"] == [str(fake)] and out["version"] == "4.2.1"
    assert out["lock"]["criu_version"] == "4.2.1-1"

    _empty_path(tmp_path, monkeypatch)
    assert ci.main(["--json", "install", "--bundle", str(tmp_path / "nope.tar")]) == 1
