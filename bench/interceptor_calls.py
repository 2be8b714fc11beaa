"""What the interceptor costs per call, on the CPU (issue 3: "time per step within 1%").

    .venv/bin/python bench/interceptor_calls.py [--calls 20000000] [--repeats 5]

A small C program (built here with cc) calls, in a tight loop, ncclGroupStart + ncclGroupEnd (the NCCL
gate: the outermost group start is gated and counted like a collective) against the CPU stand-in NCCL,
and cudaLaunchKernel against the stand-in CUDA runtime of tests/native/fakecuda (the fast path's runtime
gate), once with the interceptor preloaded and once without. It prints nanoseconds per call for each and
the difference: the interceptor's cost per NCCL call and per kernel launch. Multiplied by the calls a
training step makes, that bounds its share of the step time (docs/benchmarks.md), which end-to-end GPU runs
can only show within their run-to-run spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "native"))

from fakecuda.build import build  # noqa: E402

from cryosleep import paths  # noqa: E402

SRC = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
struct dim3 { unsigned x, y, z; };
int ncclGroupStart(void);
int ncclGroupEnd(void);
int cudaLaunchKernel(const void*, struct dim3, struct dim3, void**, size_t, void*);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  long n = atol(argv[1]);
  struct dim3 one = {1, 1, 1};
  ncclGroupStart(); ncclGroupEnd();  /* the interceptor's one-time init happens here, untimed */
  double t0 = now();
  for (long i = 0; i < n; i++) { ncclGroupStart(); ncclGroupEnd(); }
  double t1 = now();
  for (long i = 0; i < n; i++) cudaLaunchKernel(NULL, one, one, NULL, 0, NULL);
  double t2 = now();
  printf("%.3f %.3f\n", (t1 - t0) / n * 1e9, (t2 - t1) / n * 1e9);
  return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    standin = paths.native_dir() / "standin"
    interceptor = paths.native_dir() / "libcryosleep_nccl.so"
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        _, cudart = build(t / "fake")
        (t / "calls.c").write_text(SRC)
        exe = t / "calls"
        subprocess.run(["cc", "-O2", "-o", str(exe), str(t / "calls.c"), f"-L{standin}", "-lnccl", str(cudart),
                        f"-Wl,-rpath,{standin}:{t / 'fake'}"], check=True)
        env = dict(os.environ, STANDIN_NCCL_LIB=str(standin / "libnccl.so.2"),
                   LD_LIBRARY_PATH=str(t / "fake"))  # the stand-in runtime dlopens the stand-in libcuda.so.1
        env.pop("CRYOSLEEP_NCCL_CTL", None)
        got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(a.repeats):  # alternating, so that drift hits both alike
            for pre in (False, True):
                e = dict(env, LD_PRELOAD=str(interceptor)) if pre else env
                out = subprocess.run([str(exe), str(a.calls)], env=e, capture_output=True, text=True, check=True)
                x, y = (float(v) for v in out.stdout.split())
                got[pre].append((x, y))
    print("| variant | ns per ncclGroupStart+End | ns per cudaLaunchKernel |")
    print("| --- | --- | --- |")
    med = {}
    for pre, label in ((False, "stand-ins alone"), (True, "interceptor preloaded")):
        g = statistics.median(x for x, _ in got[pre])
        k = statistics.median(y for _, y in got[pre])
        med[pre] = (g, k)
        print(f"| {label} | {g:.1f} | {k:.1f} |")
    print(f"\ninterceptor cost: {med[True][0] - med[False][0]:.1f} ns per NCCL group (start + end), "
          f"{med[True][1] - med[False][1]:.1f} ns per kernel launch (medians of {a.repeats} runs of "
          f"{a.calls} calls)")


if __name__ == "__main__":
    main()
