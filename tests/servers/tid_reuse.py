"""A thread id handed to a new thread of the same process after its first
owner died (tests/session_record.rs, the dead thread's off-CPU start).

Prints `READY 0` and waits for SIGUSR1 (the recording is attached). Then,
until the kernel gives the new thread the dead one's id (other processes
forking on the host can take it first; at most 50 tries):

- thread A runs, sleeps 20 ms and exits; 300 ms later
- /proc/sys/kernel/ns_last_pid is set to A's id - 1 (root: the next pid the
  kernel allocates is A's if it is free) and thread B is started.

Prints one JSON line: {"tid": A's and B's id, "created_ns": CLOCK_MONOTONIC
just before B was started, "tries": n}, or {"error": ...}; then sleeps until
killed.
"""

import json
import signal
import sys
import threading
import time

TRIES = 50


def run_in_thread(body):
    """Runs `body` in a new thread, waits for it; returns its thread id."""
    out = []

    def main():
        out.append(threading.get_native_id())
        body()

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    return out[0]


def main():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print("READY 0", flush=True)
    signal.sigwait({signal.SIGUSR1})
    result = {"error": f"no thread got its dead predecessor's id in {TRIES} tries"}
    for tries in range(1, TRIES + 1):
        dead = run_in_thread(lambda: time.sleep(0.02))
        time.sleep(0.3)
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(dead - 1))
        created = time.monotonic_ns()
        reused = run_in_thread(lambda: time.sleep(0.02))
        if reused == dead:
            result = {"tid": dead, "created_ns": created, "tries": tries}
            break
    print(json.dumps(result), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    sys.exit(main())
