"""The tokentrace-vllm step hook alone: CPU per token, traced or not.

usage: python vllm_plugin_cost.py PLUGIN_SITE BATCH SECONDS

Runs the plugin's real EngineProbes over the real libllm_usdt.so on
hand-built step records (BATCH requests, one token each per step, the
events of a new request every 16 steps), so no vLLM is needed and nothing
else runs in the loop. Prints `READY <pid>`, then for each `run` line on
stdin measures SECONDS of steps and prints one JSON line: tokens, the
process CPU time they took and µs of CPU per token; `base` does the same
without the hook (building the records), to subtract. `cargo xtask bench
--only vllm` runs it untraced, then again with the agent attached (the
probes' semaphores on, every probe a uprobe hit).
"""

import json
import os
import sys
import time
import types

sys.path.insert(0, sys.argv[1])
from tokentrace_vllm import llm_usdt  # noqa: E402
from tokentrace_vllm.engine import EngineProbes  # noqa: E402
from tokentrace_vllm.ids import external_id  # noqa: E402

EVENTS = {"Q": "queued", "S": "scheduled", "P": "preempted"}


def records(batch):
    ids = [f"chatcmpl-bench{i:04d}-0123abcd" for i in range(batch)]
    sched = types.SimpleNamespace(
        requests={
            rid: types.SimpleNamespace(num_prompt_tokens=32, num_output_tokens=1) for rid in ids
        },
        waiting=[],
    )
    step = types.SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in ids})
    return ids, sched, step


def run(probes, ids, sched, step, seconds):
    now = time.monotonic()
    tokens = 0
    steps = 0
    cpu0 = time.process_time()
    deadline = now + seconds
    while time.monotonic() < deadline:
        steps += 1
        outs = []
        for n, rid in enumerate(ids):
            events = None
            if (steps + n) % 16 == 0:
                events = [
                    types.SimpleNamespace(type="Q", timestamp=now),
                    types.SimpleNamespace(type="S", timestamp=now),
                ]
            outs.append(
                types.SimpleNamespace(
                    request_id=rid, new_token_ids=[7], events=events, finish_reason=None
                )
            )
        outputs = {0: types.SimpleNamespace(timestamp=now, outputs=outs)}
        if probes is not None:
            probes.on_step(sched, step, outputs)
        tokens += len(ids)
    cpu = time.process_time() - cpu0
    return {"tokens": tokens, "steps": steps, "cpu_s": cpu, "us_per_token": cpu / tokens * 1e6,
            "hook": probes is not None, "traced": probes is not None and probes.active()}


def main():
    batch = int(sys.argv[2])
    seconds = float(sys.argv[3])
    if not llm_usdt.AVAILABLE:
        sys.exit(f"libllm_usdt.so not loadable: {llm_usdt.LIBRARY}")
    probes = EngineProbes(llm_usdt, external_id, EVENTS)
    ids, sched, step = records(batch)
    print(f"READY {os.getpid()}", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command in ("run", "base"):
            hook = probes if command == "run" else None
            print(json.dumps(run(hook, ids, sched, step, seconds)), flush=True)


if __name__ == "__main__":
    main()
