"""The `llm` USDT probes for Python servers (ctypes over libllm_usdt.so).

    import llm_usdt
    llm_usdt.request_start(request_id, prompt_tokens)
    llm_usdt.token(request_id, i)

The library is taken from $LLM_USDT_LIB, else from libllm_usdt.so next to
this file (build it with `cargo xtask native`, then copy it here or point
the variable at target/native/libllm_usdt.so). Without it every function is
a no-op and AVAILABLE is False, so instrumented code runs unchanged where
the library is not installed.

request_id is a str or bytes, the id the server returns to the client
("chatcmpl-..."); tracers read at most 63 bytes of it. Integers must fit in
64 bits. instrument/README.md documents the probes and their arguments.

Every request-id probe takes an optional at_ns: the time.monotonic_ns()
(CLOCK_MONOTONIC) when the event happened, for code that learns of an
event after the fact; 0 (the default) means now.

semaphore(name) returns the probe's semaphore as a ctypes c_ushort (None
without the library): reading .value costs no foreign call, so a hot path
can skip all of its work while no tracer is attached.

Cost when no tracer is attached: one ctypes call into a function that tests
the probe's semaphore and returns (about a microsecond from CPython).
"""

import ctypes
import os

__all__ = [
    "AVAILABLE",
    "LIBRARY",
    "request_start",
    "request_queued",
    "request_scheduled",
    "prefill_start",
    "prefill_end",
    "token",
    "request_end",
    "request_preempted",
    "batch_step",
    "semaphore",
]

_RID_PROBES = (
    "request_start",
    "request_queued",
    "request_scheduled",
    "prefill_start",
    "prefill_end",
    "token",
    "request_end",
    "request_preempted",
)


def _library_path():
    explicit = os.environ.get("LLM_USDT_LIB")
    if explicit:
        return explicit
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libllm_usdt.so")


def _load(path):
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for name in _RID_PROBES:
        fn = getattr(lib, "llm_usdt_" + name)
        fn.argtypes = (ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64)
        fn.restype = None
    lib.llm_usdt_batch_step.argtypes = (ctypes.c_uint64,) * 3
    lib.llm_usdt_batch_step.restype = None
    lib.llm_usdt_semaphore.argtypes = (ctypes.c_char_p,)
    lib.llm_usdt_semaphore.restype = ctypes.c_void_p
    return lib


LIBRARY = _library_path()
_lib = _load(LIBRARY)
AVAILABLE = _lib is not None


def _rid(request_id):
    # ctypes passes bytes as a pointer to CPython's own NUL-terminated buffer:
    # no copy beyond the encode.
    return request_id if isinstance(request_id, bytes) else request_id.encode()


def _rid_probe(name):
    if _lib is None:
        def noop(request_id, value, at_ns=0):
            pass

        noop.__name__ = name
        return noop
    fn = getattr(_lib, "llm_usdt_" + name)

    def fire(request_id, value, at_ns=0):
        fn(_rid(request_id), value, at_ns)

    fire.__name__ = name
    return fire


request_start = _rid_probe("request_start")
request_start.__doc__ = "llm:request_start(request_id, prompt_tokens): the server accepted a request."
request_queued = _rid_probe("request_queued")
request_queued.__doc__ = "llm:request_queued(request_id, queue_depth): waiting for the scheduler; depth includes it."
request_scheduled = _rid_probe("request_scheduled")
request_scheduled.__doc__ = "llm:request_scheduled(request_id, batch_size): admitted into a batch of that size."
prefill_start = _rid_probe("prefill_start")
prefill_start.__doc__ = "llm:prefill_start(request_id, prompt_tokens): prompt processing begins."
prefill_end = _rid_probe("prefill_end")
prefill_end.__doc__ = "llm:prefill_end(request_id, prompt_tokens): prompt processing is done."
token = _rid_probe("token")
token.__doc__ = "llm:token(request_id, token_index): token token_index (from 0) was generated."
request_end = _rid_probe("request_end")
request_end.__doc__ = "llm:request_end(request_id, completion_tokens): the request is finished."
request_preempted = _rid_probe("request_preempted")
request_preempted.__doc__ = (
    "llm:request_preempted(request_id, preemptions): the engine evicted it; it waits again."
)


def batch_step(step_id, batch_size, tokens_in_step):
    """llm:batch_step(step_id, batch_size, tokens_in_step): one engine step done."""
    if _lib is not None:
        _lib.llm_usdt_batch_step(step_id, batch_size, tokens_in_step)


def semaphore(name):
    """The semaphore of probe `name` (a ctypes.c_ushort; nonzero while a
    tracer is attached), or None without the library or for an unknown name."""
    if _lib is None:
        return None
    address = _lib.llm_usdt_semaphore(name.encode())
    if not address:
        return None
    return ctypes.c_ushort.from_address(address)
