#!/usr/bin/env python3
"""tests/servers/stdlib_sse.py with a CPU-hot native function before every
streamed chunk, for the flame graph test of `tokentrace record`.

Run:  python3 tests/servers/hot_sse.py --port 0 --hot-lib PATH [--burn-ms 3]
      PATH is libtt_hot.so built from tests/servers/hot_spin.c. Prints
      ``READY <port>`` like the other test servers.

Each chunk first spends --burn-ms on the CPU in the exported C function
``tokentrace_test_hot_spin`` (ctypes releases the GIL around the call, so
concurrent streams burn in parallel), then writes the chunk exactly as
stdlib_sse.py does.
"""

import argparse
import ctypes
import importlib.util
import os
import signal
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def load_stdlib_server():
    spec = importlib.util.spec_from_file_location("stdlib_sse", os.path.join(HERE, "stdlib_sse.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--hot-lib", required=True, help="libtt_hot.so (tests/servers/hot_spin.c)")
    ap.add_argument("--burn-ms", type=float, default=3.0, help="CPU time burnt before each chunk")
    args = ap.parse_args()

    lib = ctypes.CDLL(args.hot_lib)
    spin = lib.tokentrace_test_hot_spin
    spin.argtypes = [ctypes.c_uint64]
    spin.restype = ctypes.c_uint64
    burn_ns = int(args.burn_ms * 1e6)

    stdlib_sse = load_stdlib_server()

    class HotHandler(stdlib_sse.Handler):
        def _write_chunk(self, data):
            spin(burn_ns)
            super()._write_chunk(data)

    srv = stdlib_sse.Server((args.host, args.port), HotHandler)
    print(f"READY {srv.server_address[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown).start())
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
