"""tokentrace-vllm: vLLM's engine fires tokentrace's `llm:*` USDT probes.

vLLM loads this by itself (entry point group `vllm.general_plugins`) and
calls `register()` once in each of its processes. Only the EngineCore runs
the scheduler, so only there does the hook ever run: after each
`Scheduler.update_from_output` it fires queued / scheduled / prefill /
preempted / token / end probes per request and one batch_step (see
engine.py). Nothing is done per step beyond reading the probes' semaphores
while no tracer is attached.

On a vLLM whose internals this was not written against it logs one line and
changes nothing: a tracing aid must never break the server it traces.
"""

import logging
import os

from . import compat

# A child of "vllm": vLLM configures that logger's handlers and format.
_log = logging.getLogger("vllm.tokentrace")
_registered = False


def register():
    """vLLM's plugin entry point; idempotent (vLLM may call it twice)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        _install()
    except Exception as err:  # never take vLLM down with us
        _log.warning("tokentrace-vllm: disabled, could not hook vLLM: %r", err)


def _install():
    problem, parts = compat.check()
    if problem is not None:
        _log.warning("tokentrace-vllm: disabled: %s", problem)
        return
    from . import llm_usdt

    if not llm_usdt.AVAILABLE:
        _log.warning(
            "tokentrace-vllm: disabled: cannot load %s (set LLM_USDT_LIB to libllm_usdt.so)",
            llm_usdt.LIBRARY,
        )
        return
    from .engine import EngineProbes
    from .ids import external_id

    randomized = not parts.ids_not_randomized()
    probes = EngineProbes(
        llm_usdt,
        lambda internal: external_id(internal, randomized),
        parts.event_names,
    )
    scheduler_cls = parts.scheduler_cls
    original = scheduler_cls.update_from_output
    told_stats_off = []

    told_firing = []

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        if not told_firing:
            told_firing.append(True)
            _log.info(
                "tokentrace-vllm: llm:* probes armed in the engine, pid %d (%s)",
                os.getpid(),
                llm_usdt.LIBRARY,
            )
        if probes.active():
            if not self.log_stats and not told_stats_off:
                told_stats_off.append(True)
                _log.warning(
                    "tokentrace-vllm: vLLM stats are off (--disable-log-stats): "
                    "no queue, schedule or preemption events; tokens, steps and ends still fire"
                )
            try:
                probes.on_step(self, scheduler_output, outputs)
            except Exception as err:
                scheduler_cls.update_from_output = original
                _log.warning("tokentrace-vllm: disabled after an error: %r", err)
        return outputs

    update_from_output.__wrapped__ = original
    scheduler_cls.update_from_output = update_from_output
    # Every vLLM process gets here; only the EngineCore runs a scheduler, and
    # it says so at its first step.
    _log.debug("tokentrace-vllm: hooked %s in pid %d", scheduler_cls.__name__, os.getpid())
