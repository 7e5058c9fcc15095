#!/usr/bin/env python3
"""A real CUDA workload for `cargo xtask gpu-check`: PyTorch matmuls with a
synchronize after each step, for --seconds. Prints one JSON line with what
it did. Needs a CUDA GPU and PyTorch; exits 3 with a message otherwise.
"""

import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--wait-for-stdin", action="store_true",
                    help="load CUDA, then wait for a line on stdin before the timed loop")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: pip install torch", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("torch.cuda.is_available() is False: no usable CUDA GPU", file=sys.stderr)
        return 3
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    if args.wait_for_stdin:
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
    steps = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for _ in range(8):
            a = (a @ b).tanh_()
        torch.cuda.synchronize()
        steps += 1
    print(json.dumps({"steps": steps, "device": torch.cuda.get_device_name(0)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
