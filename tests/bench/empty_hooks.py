#!/usr/bin/env python3
"""The tracepoint floor for `cargo xtask bench --only kernel`: an empty BPF
program (r0 = 0; exit) attached to each named raw tracepoint, held until
SIGINT or SIGTERM.

  python3 tests/bench/empty_hooks.py TRACEPOINT...
      prints READY <count> once every program is attached.

A tracepoint with any program on it costs the code that fires it a call
into BPF (the tracepoint's static call, bpf_trace_run's recursion guard and
RCU section, the indirect call into the program: a retpoline where the CPU
needs one). Run on the tracepoints the agent attaches, this measures what
any BPF program there costs a process nobody traces, so that the bench can
tell that floor apart from what the agent's own programs add to it.

bpf(2) is called through ctypes (x86-64 syscall number): no compiler, no
libbpf, nothing to install. Needs CAP_BPF and CAP_PERFMON (root).
"""
import ctypes
import os
import signal
import struct
import sys

SYS_BPF = 321  # x86-64
BPF_PROG_LOAD = 5
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
ATTR_SIZE = 128

libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(attr, ATTR_SIZE)
    fd = libc.syscall(SYS_BPF, cmd, buf, ATTR_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def main():
    names = sys.argv[1:]
    if not names:
        sys.exit("usage: empty_hooks.py TRACEPOINT...")
    # mov r0, 0; exit
    insns = ctypes.create_string_buffer(bytes.fromhex("b700000000000000" "9500000000000000"))
    license = ctypes.create_string_buffer(b"GPL")
    try:
        prog = bpf(
            BPF_PROG_LOAD,
            struct.pack(
                "IIQQIIQII16s",
                BPF_PROG_TYPE_RAW_TRACEPOINT,
                2,
                ctypes.addressof(insns),
                ctypes.addressof(license),
                0,
                0,
                0,
                0,
                0,
                b"tt_bench_empty",
            ),
        )
    except OSError as e:
        sys.exit(f"empty_hooks.py: loading the empty program: {e} (needs root)")
    links = []
    for name in names:
        cname = ctypes.create_string_buffer(name.encode())
        try:
            links.append(bpf(BPF_RAW_TRACEPOINT_OPEN, struct.pack("QII", ctypes.addressof(cname), prog, 0)))
        except OSError as e:
            sys.exit(f"empty_hooks.py: attaching to raw tracepoint {name}: {e}")
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    print("READY %d" % len(links), flush=True)
    signal.sigwait(stop)


if __name__ == "__main__":
    main()
