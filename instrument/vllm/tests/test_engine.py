"""The step hook against hand-built vLLM records (no vLLM needed).

Run: python3 -m unittest discover -s instrument/vllm/tests
(tests/vllm_plugin.rs runs it in `cargo test`).
"""

import ctypes
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokentrace_vllm.engine import PROBES, EngineProbes  # noqa: E402
from tokentrace_vllm.ids import external_id  # noqa: E402


class Recorder:
    """Stands in for llm_usdt: records calls, semaphores settable."""

    def __init__(self):
        self.calls = []
        self.sems = {name: ctypes.c_ushort(0) for name in PROBES}
        for name in PROBES:
            setattr(self, name, self._fire(name))

    def _fire(self, name):
        def fire(*args):
            self.calls.append((name,) + args)

        return fire

    def semaphore(self, name):
        return self.sems.get(name)


def event(kind, ts):
    return types.SimpleNamespace(type=kind, timestamp=ts)


def output(rid, tokens, events=None, finish=None):
    return types.SimpleNamespace(
        request_id=rid, new_token_ids=tokens, events=events, finish_reason=finish
    )


def step_outputs(ts, *outs):
    return {0: types.SimpleNamespace(timestamp=ts, outputs=list(outs))}


class Scheduler:
    def __init__(self):
        self.requests = {}
        self.waiting = []


def request(prompt, produced):
    return types.SimpleNamespace(num_prompt_tokens=prompt, num_output_tokens=produced)


EVENTS = {"Q": "queued", "S": "scheduled", "P": "preempted"}
A = "chatcmpl-a-0123abcd"
B = "chatcmpl-b-89abcdef"


class EngineProbesTest(unittest.TestCase):
    def setUp(self):
        self.usdt = Recorder()
        self.probes = EngineProbes(self.usdt, external_id, EVENTS)
        self.sched = Scheduler()

    def step(self, scheduled, outputs):
        self.probes.on_step(
            self.sched, types.SimpleNamespace(num_scheduled_tokens=scheduled), outputs
        )

    def test_untraced_does_nothing(self):
        self.assertFalse(self.probes.active())
        self.step({A: 5}, step_outputs(1.0, output(A, [7])))
        self.assertEqual(self.usdt.calls, [])

    def test_a_request_with_dated_events_shared_steps_and_a_preemption(self):
        self.usdt.sems["token"].value = 1
        self.assertTrue(self.probes.active())
        self.sched.requests = {A: request(5, 1), B: request(3, 1)}
        # Step 1: both get their first token; A's events ride along.
        self.step(
            {A: 5, B: 3},
            step_outputs(
                2.5,
                output(A, [7], events=[event("Q", 1.0), event("S", 2.0)]),
                output(B, [8], events=[event("Q", 1.5), event("S", 2.0)]),
            ),
        )
        self.sched.requests[A].num_output_tokens = 2
        # Step 2: only A; B was preempted at 2.6 (learnt with its next output).
        self.step({A: 1}, step_outputs(2.7, output(A, [9])))
        self.sched.requests[B].num_output_tokens = 2
        self.step(
            {B: 1},
            step_outputs(
                3.5,
                output(B, [4], events=[event("P", 2.6), event("S", 3.0)], finish="length"),
            ),
        )
        a, b = b"chatcmpl-a", b"chatcmpl-b"
        ns = lambda s: int(s * 1e9)  # noqa: E731
        self.assertEqual(
            self.usdt.calls,
            [
                ("request_queued", a, 0, ns(1.0)),
                ("request_scheduled", a, 2, ns(2.0)),
                ("prefill_start", a, 5, ns(2.0)),
                ("token", a, 0),
                ("prefill_end", a, 5, ns(2.5)),
                ("request_queued", b, 0, ns(1.5)),
                ("request_scheduled", b, 2, ns(2.0)),
                ("prefill_start", b, 3, ns(2.0)),
                ("token", b, 0),
                ("prefill_end", b, 3, ns(2.5)),
                ("batch_step", 1, 2, 2),
                ("token", a, 1),
                ("batch_step", 2, 1, 1),
                ("request_preempted", b, 1, ns(2.6)),
                ("request_scheduled", b, 1, ns(3.0)),
                ("token", b, 1),
                ("request_end", b, 2),
                ("batch_step", 3, 1, 1),
            ],
        )

    def test_tracing_that_starts_mid_stream_counts_from_vllm(self):
        self.sched.requests = {A: request(5, 10)}
        self.step({A: 1}, step_outputs(1.0, output(A, [1])))
        self.usdt.sems["batch_step"].value = 1
        self.sched.requests[A].num_output_tokens = 12
        self.step({A: 1}, step_outputs(1.1, output(A, [2, 3])))
        self.assertEqual(
            self.usdt.calls,
            [
                ("token", b"chatcmpl-a", 10),
                ("token", b"chatcmpl-a", 11),
                ("batch_step", 2, 1, 2),
            ],
        )


class ExternalIdTest(unittest.TestCase):
    def test_strips_only_vllms_suffix(self):
        self.assertEqual(external_id("chatcmpl-abc-0123abcd"), "chatcmpl-abc")
        self.assertEqual(external_id("chatcmpl-abc-0123abcd", randomized=False),
                         "chatcmpl-abc-0123abcd")
        self.assertEqual(external_id("chatcmpl-abc-XYZ12345"), "chatcmpl-abc-XYZ12345")
        self.assertEqual(external_id("-0123abcd"), "-0123abcd")


if __name__ == "__main__":
    unittest.main()
