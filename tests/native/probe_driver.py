"""Makes a known number of uprobe-visible calls, for tests that count what
the agent saw (tests/ebpf_capabilities.rs).

    probe_driver.py [--cudart LIB] [--usdt LIB] --iterations N

Loads the libraries (so a tracer started next finds them mapped), prints
{"ready": PID}, waits for a line on stdin, then per iteration:

- with --cudart (the stand-in or NVIDIA's real libcudart): one
  cudaLaunchKernel, one cudaStreamSynchronize(0), one cudaDeviceSynchronize();
  without a GPU the real runtime returns an error from each (35: no driver),
  but they are real calls into the real library;
- with --usdt (libllm_usdt.so): one llm:token probe, through the library's
  function, after checking its semaphore (set by the tracer's attach).

Prints {"launches": N, "syncs": 2N, "usdt_tokens": T, "cuda_errors": [...]}
(T counts the probes fired with the semaphore set) and exits.
"""

import argparse
import ctypes
import json
import os
import sys


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def load_cudart(path):
    lib = ctypes.CDLL(path)
    lib.cudaLaunchKernel.argtypes = [
        ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
    ]
    lib.cudaLaunchKernel.restype = ctypes.c_int
    lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    lib.cudaStreamSynchronize.restype = ctypes.c_int
    lib.cudaDeviceSynchronize.argtypes = []
    lib.cudaDeviceSynchronize.restype = ctypes.c_int
    return lib


def load_usdt(path):
    lib = ctypes.CDLL(path)
    lib.llm_usdt_token.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64]
    lib.llm_usdt_token.restype = None
    lib.llm_usdt_semaphore.argtypes = [ctypes.c_char_p]
    lib.llm_usdt_semaphore.restype = ctypes.POINTER(ctypes.c_ushort)
    return lib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cudart")
    ap.add_argument("--usdt")
    ap.add_argument("--iterations", type=int, required=True)
    args = ap.parse_args()
    cudart = load_cudart(args.cudart) if args.cudart else None
    usdt = load_usdt(args.usdt) if args.usdt else None
    print(json.dumps({"ready": os.getpid()}), flush=True)
    if not sys.stdin.readline():
        sys.exit("probe_driver: stdin closed before the gate opened")

    launches = syncs = tokens = 0
    errors = set()
    kernel = ctypes.c_void_p(0x1000)
    one = Dim3(1, 1, 1)
    semaphore = usdt.llm_usdt_semaphore(b"token") if usdt else None
    for i in range(args.iterations):
        if cudart:
            errors.add(cudart.cudaLaunchKernel(kernel, one, one, None, 0, None))
            launches += 1
            errors.add(cudart.cudaStreamSynchronize(None))
            errors.add(cudart.cudaDeviceSynchronize())
            syncs += 2
        if usdt and semaphore and semaphore[0]:
            usdt.llm_usdt_token(b"driver-req", i, 0)
            tokens += 1
    print(json.dumps({
        "launches": launches,
        "syncs": syncs,
        "usdt_tokens": tokens,
        "cuda_errors": sorted(errors),
    }), flush=True)


if __name__ == "__main__":
    main()
