"""`cryosleep criu install|bundle|status|build-uffd`: provisioning CRIU in Cryosleep's private prefix."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cryosleep.capture import criu_install, criu_uffd
from cryosleep.cli.output import emit_json
from cryosleep.core.debs import Say


def add_criu(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("criu", help="install CRIU 4.2 into Cryosleep's private prefix, or bundle it")
    csub = c.add_subparsers(dest="criu_cmd", required=True)
    i = csub.add_parser("install", help="download (or take from --bundle), verify and install the pinned CRIU")
    i.add_argument("--bundle", type=Path, help="an offline bundle made by `cryosleep criu bundle`")
    i.add_argument("--force", action="store_true")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_install)
    b = csub.add_parser("bundle", help="write an offline bundle of the pinned packages (for machines "
                        "that reach no package registry)")
    b.add_argument("out", type=Path)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bundle)
    s = csub.add_parser("status", help="which CRIU Cryosleep uses")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    u = csub.add_parser("build-uffd", help="build the pinned CRIU with memory tracked by userfaultfd write-protect "
                        "(criu-uffd, beside the prefix's criu; needs a compiler and CRIU's -dev packages: "
                        "`make criu-uffd` installs them)")
    u.add_argument("--force", action="store_true", help="build again even if it is built from this source and patch")
    u.add_argument("--json", action="store_true")
    u.set_defaults(func=cmd_build_uffd)


def _progress(enabled: bool) -> Say | None:
    if not enabled:
        return None

    def show(msg: str) -> None:
        sys.stderr.write(f"  {msg}\n")

    return show


def cmd_install(a: argparse.Namespace) -> int:
    criu = criu_install.install(bundle=a.bundle, force=a.force, progress=_progress(not a.json))
    info = {"version": criu.version, "source": criu.source, "prefix": str(criu.prefix) if criu.prefix else None,
            "argv": list(criu.argv)}
    if a.json:
        emit_json(info)
    else:
        print(f"CRIU {criu.version} ready ({criu.source}{': ' + str(criu.prefix) if criu.prefix else ''})")
    return 0


def cmd_bundle(a: argparse.Namespace) -> int:
    out = criu_install.make_bundle(a.out)
    if a.json:
        emit_json({"bundle": str(out)})
    else:
        print(f"wrote {out}; install it elsewhere with `cryosleep criu install --bundle {out.name}`")
    return 0


def cmd_build_uffd(a: argparse.Namespace) -> int:
    argv = criu_uffd.build(force=a.force, progress=_progress(not a.json))
    st = criu_uffd.status()
    if a.json:
        emit_json({**st, "argv": list(argv)})
    else:
        print(f"criu-uffd ready at {st['criu_uffd']}; tracks memory on this kernel: "
              + ("yes" if st["tracks"] else f"no ({st['why']})"))
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    st = {**criu_install.status(), "uffd": criu_uffd.status()}
    if a.json:
        emit_json(st)
    else:
        for k, v in st.items():
            print(f"{k:12} {v}")
    return 0
