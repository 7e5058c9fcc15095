#!/usr/bin/env python3
"""Checks that the stand-in CUDA libraries behave as the eBPF tests assume.

  python3 tests/native/check_fake_cuda.py [--native-dir DIR]   (default target/native)

Run by `cargo xtask native` after building. The agent's tests inject a CUDA
sync stall of a known length and expect it back from the uprobes, so the
stand-in must: block a sync until the enqueued kernels' time has passed (not
less; later only by scheduling noise), keep the thread off-CPU meanwhile,
queue kernels back to back per stream, keep streams independent, read
hStream from CUlaunchConfig (the offsets are asserted in fake_cuda.c), and launch cheaply.
Prints one line per check, then "N passed, M failed"; exits 1 on a failure.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# A sync may end later than the GPU time by scheduler noise on a busy
# machine, never earlier. Where a wrong stand-in would wait for other work,
# that work is longer than LATE_MS, so noise cannot hide the error.
EARLY_MS = 0.3
LATE_MS = 40.0


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint),
    ]


def load(native_dir):
    rt = ctypes.CDLL(os.path.join(native_dir, "libcudart.so.12"))
    drv = ctypes.CDLL(os.path.join(native_dir, "libcuda.so.1"))
    vp, u = ctypes.c_void_p, ctypes.c_uint
    rt.cudaLaunchKernel.argtypes = (vp, Dim3, Dim3, vp, ctypes.c_size_t, vp)
    rt.cudaGraphLaunch.argtypes = (vp, vp)
    rt.cudaMemcpyAsync.argtypes = (vp, vp, ctypes.c_size_t, ctypes.c_int, vp)
    rt.cudaStreamSynchronize.argtypes = (vp,)
    rt.cudaEventSynchronize.argtypes = (vp,)
    rt.cudaEventRecord.argtypes = (vp, vp)
    rt.cudaStreamCreate.argtypes = (ctypes.POINTER(vp),)
    rt.cudaEventCreate.argtypes = (ctypes.POINTER(vp),)
    rt.cudaStreamDestroy.argtypes = (vp,)
    rt.cudaEventDestroy.argtypes = (vp,)
    drv.cuLaunchKernel.argtypes = (vp, u, u, u, u, u, u, u, vp, vp, vp)
    drv.cuLaunchKernelEx.argtypes = (ctypes.POINTER(CUlaunchConfig), vp, vp, vp)
    drv.cuStreamSynchronize.argtypes = (vp,)
    drv.fakecuda_set_kernel_ns.argtypes = (ctypes.c_uint64,)
    return rt, drv


def ok(ret, what):
    """API calls that only set up a check must succeed."""
    if ret != 0:
        raise RuntimeError(f"{what} returned error {ret}")


class Checks:
    def __init__(self, native_dir):
        self.native_dir = native_dir
        self.rt, self.drv = load(native_dir)
        self.passed = self.failed = 0

    def check(self, name, ok, detail):
        self.passed += ok
        self.failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    def kernel_ms(self, ms):
        self.rt.fakecuda_set_kernel_ns(int(ms * 1e6))

    def launch(self, stream=None):
        ok(self.rt.cudaLaunchKernel(None, Dim3(1, 1, 1), Dim3(32, 1, 1), None, 0, stream),
           "cudaLaunchKernel")

    def timed(self, call, *args):
        """(wall ms, on-CPU ms of this thread, return value) of call(*args)."""
        wall, cpu = time.monotonic_ns(), time.thread_time_ns()
        ret = call(*args)
        return (time.monotonic_ns() - wall) / 1e6, (time.thread_time_ns() - cpu) / 1e6, ret

    def blocks_for(self, name, expect_ms, call, *args, since=None):
        """Checks that call(*args) returns expect_ms after `since` (the
        CLOCK_MONOTONIC ns before the work was enqueued; default: the call's
        start). Timing from the enqueue keeps the lower bound exact however
        long a loaded machine takes between the launches and the sync."""
        start = time.monotonic_ns()
        wall, cpu, ret = self.timed(call, *args)
        if since is not None:
            wall += (start - since) / 1e6
        ok = ret == 0 and expect_ms - EARLY_MS <= wall <= expect_ms + LATE_MS
        self.check(name, ok, f"blocked {wall:.2f} ms for {expect_ms:.0f} ms of GPU work, "
                             f"{cpu:.2f} ms on CPU, returned {ret}")
        return wall, cpu

    def new(self, create):
        handle = ctypes.c_void_p()
        ok(create(ctypes.byref(handle)), "create")
        return handle

    def run(self):
        rt, drv = self.rt, self.drv

        self.kernel_ms(30)
        enqueued = time.monotonic_ns()
        self.launch()
        _, cpu = self.blocks_for("cudaStreamSynchronize waits for the kernel", 30,
                                 rt.cudaStreamSynchronize, None, since=enqueued)
        self.check("a sync waits off-CPU", cpu < 5, f"{cpu:.2f} ms on CPU while blocked")

        self.kernel_ms(10)
        enqueued = time.monotonic_ns()
        for _ in range(3):
            self.launch()
        self.blocks_for("kernels run back to back", 30, rt.cudaStreamSynchronize, None,
                        since=enqueued)

        self.blocks_for("a sync with nothing pending returns at once", 0,
                        rt.cudaStreamSynchronize, None)

        s1, s2 = self.new(rt.cudaStreamCreate), self.new(rt.cudaStreamCreate)
        self.kernel_ms(150)
        long_enqueued = time.monotonic_ns()
        self.launch(s1)
        self.kernel_ms(10)
        enqueued = time.monotonic_ns()
        self.launch(s2)
        self.blocks_for("streams are independent", 10, rt.cudaStreamSynchronize, s2,
                        since=enqueued)
        self.blocks_for("cudaDeviceSynchronize waits for every stream", 150,
                        rt.cudaDeviceSynchronize, since=long_enqueued)

        event = self.new(rt.cudaEventCreate)
        self.kernel_ms(20)
        enqueued = time.monotonic_ns()
        self.launch(s1)
        ok(rt.cudaEventRecord(event, s1), "cudaEventRecord")
        self.kernel_ms(100)
        self.launch(s1)  # after the event: not waited for
        self.blocks_for("cudaEventSynchronize waits up to the record", 20,
                        rt.cudaEventSynchronize, event, since=enqueued)
        rt.cudaStreamSynchronize(s1)

        self.kernel_ms(15)
        enqueued = time.monotonic_ns()
        ok(rt.cudaGraphLaunch(ctypes.c_void_p(0x1234), s1), "cudaGraphLaunch")
        self.blocks_for("cudaGraphLaunch is one unit of work", 15, rt.cudaStreamSynchronize, s1,
                        since=enqueued)

        src, dst = ctypes.create_string_buffer(b"token"), ctypes.create_string_buffer(8)
        self.kernel_ms(10)
        enqueued = time.monotonic_ns()
        self.launch(s1)
        ret = rt.cudaMemcpyAsync(dst, src, 6, 2, s1)
        self.blocks_for("cudaMemcpyAsync is ordered after the kernels", 10,
                        rt.cudaStreamSynchronize, s1, since=enqueued)
        self.check("cudaMemcpyAsync copies", ret == 0 and dst.value == b"token", repr(dst.value))

        # Driver API, on a stream the runtime created (handles are shared).
        self.kernel_ms(20)
        enqueued = time.monotonic_ns()
        ok(drv.cuLaunchKernel(None, 1, 1, 1, 32, 1, 1, 0, s2, None, None), "cuLaunchKernel")
        self.blocks_for("cuLaunchKernel + cuStreamSynchronize", 20, drv.cuStreamSynchronize, s2,
                        since=enqueued)
        config = CUlaunchConfig(1, 1, 1, 32, 1, 1, 0, s2, None, 0)
        self.kernel_ms(60)
        enqueued = time.monotonic_ns()
        ok(drv.cuLaunchKernelEx(ctypes.byref(config), None, None, None), "cuLaunchKernelEx")
        # Read at a wrong offset, hStream would be another stream or garbage.
        self.blocks_for("cuLaunchKernelEx leaves the default stream idle", 0,
                        drv.cuStreamSynchronize, None)
        self.blocks_for("cuLaunchKernelEx enqueues on config->hStream", 60,
                        drv.cuStreamSynchronize, s2, since=enqueued)
        self.kernel_ms(20)
        enqueued = time.monotonic_ns()
        self.launch(s1)
        self.blocks_for("cuCtxSynchronize waits for everything", 20, drv.cuCtxSynchronize,
                        since=enqueued)

        for handle in (s1, s2):
            rt.cudaStreamDestroy(handle)
        rt.cudaEventDestroy(event)

        env = dict(os.environ, FAKECUDA_KERNEL_US="25000")
        probe = (
            "import ctypes, sys, time; d = ctypes.CDLL(sys.argv[1]);"
            "d.cuLaunchKernel(None, 1, 1, 1, 32, 1, 1, 0, None, None, None);"
            "t = time.monotonic_ns(); d.cuCtxSynchronize();"
            "print((time.monotonic_ns() - t) / 1e6)"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, os.path.join(self.native_dir, "libcuda.so.1")],
            env=env, capture_output=True, text=True, check=False,
        )
        try:
            waited = float(out.stdout.strip())
        except ValueError:
            waited = -1.0
        self.check("FAKECUDA_KERNEL_US sets the initial kernel time",
                   25 - EARLY_MS <= waited <= 25 + LATE_MS, f"waited {waited:.2f} ms for 25 ms")

        loop = subprocess.run([os.path.join(self.native_dir, "launch_loop"), "200000"],
                              capture_output=True, text=True, check=False)
        try:
            rate = json.loads(loop.stdout)["launches_per_s"]
        except (ValueError, KeyError):
            rate = 0.0
        # No system call per launch: millions per second, where a uprobe
        # (a trap per call) costs microseconds each.
        self.check("launches are cheap", rate > 2e6, f"launch_loop: {rate:,.0f} launches/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--native-dir", default=os.path.join(REPO, "target", "native"))
    checks = Checks(os.path.abspath(ap.parse_args().native_dir))
    checks.run()
    print(f"fake_cuda: {checks.passed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
