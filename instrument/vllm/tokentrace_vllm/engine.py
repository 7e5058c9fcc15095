"""What one EngineCore step tells the probes.

Hooked after `Scheduler.update_from_output`: its result is the step's
`EngineCoreOutputs`, the same records vLLM's API server computes its own
request stats from. Each output carries the tokens the step produced for a
request, its finish reason and, when vLLM's stats are on, the scheduler
events (QUEUED, SCHEDULED, PREEMPTED) stamped with time.monotonic() when they
happened: an event reaches us with the request's next output, often steps
later, so those probes pass the stamp as `at_ns` instead of being dated by
their firing. vLLM's own definitions are kept so the numbers agree with its
metrics: queue = first QUEUED -> first SCHEDULED; prefill = first SCHEDULED
-> the step output that carried the first token.

`token` for every request that got tokens, then one `batch_step`, all from
the engine's thread: that is how the agent learns which requests shared a
step.
"""

PROBES = (
    "request_queued",
    "request_scheduled",
    "request_preempted",
    "prefill_start",
    "prefill_end",
    "token",
    "request_end",
    "batch_step",
)

# Requests are forgotten when they finish; ones that vanish without a
# finishing output (aborted by the client) are swept this often (steps).
_SWEEP_EVERY = 256


def _ns(seconds):
    return int(seconds * 1e9)


class _Request:
    __slots__ = ("rid", "tokens", "prompt_tokens", "scheduled", "preemptions")

    def __init__(self, rid, tokens, prompt_tokens):
        self.rid = rid
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.scheduled = False
        self.preemptions = 0


class EngineProbes:
    """Fires the probes for the steps of one scheduler.

    `usdt` is the llm_usdt module (or anything with its functions and
    `semaphore`); `external_id` maps the engine's id to the user's;
    `events` maps vLLM's EngineCoreEventType members QUEUED, SCHEDULED and
    PREEMPTED to the names used here.
    """

    def __init__(self, usdt, external_id, events):
        self._usdt = usdt
        self._external_id = external_id
        self._events = events
        semaphores = [usdt.semaphore(name) for name in PROBES]
        self._semaphores = [s for s in semaphores if s is not None]
        self._requests = {}
        self._step = 0

    def active(self):
        """Whether any tracer is attached: one memory read per probe."""
        for semaphore in self._semaphores:
            if semaphore.value:
                return True
        return False

    def on_step(self, scheduler, scheduler_output, outputs):
        """After a step: `outputs` is update_from_output's result."""
        self._step += 1
        if not self.active():
            # Nothing to keep while untraced; counts restart from vLLM's
            # own request state when a tracer attaches.
            if self._requests:
                self._requests.clear()
            return
        usdt = self._usdt
        live = scheduler.requests
        produced = 0
        for engine_outputs in outputs.values():
            step_ns = _ns(engine_outputs.timestamp)
            for out in engine_outputs.outputs:
                req = self._request(out.request_id, live, len(out.new_token_ids))
                if out.events:
                    self._fire_events(req, out.events, scheduler, scheduler_output)
                n = len(out.new_token_ids)
                if n:
                    first = req.tokens
                    for index in range(first, first + n):
                        usdt.token(req.rid, index)
                    if first == 0:
                        usdt.prefill_end(req.rid, req.prompt_tokens, step_ns)
                    req.tokens = first + n
                    produced += n
                if out.finish_reason is not None:
                    usdt.request_end(req.rid, req.tokens)
                    self._requests.pop(out.request_id, None)
        usdt.batch_step(
            self._step, len(scheduler_output.num_scheduled_tokens), produced
        )
        if self._step % _SWEEP_EVERY == 0:
            for rid in [r for r in self._requests if r not in live]:
                del self._requests[rid]

    def _request(self, internal, live, new_tokens):
        req = self._requests.get(internal)
        if req is None:
            # First sight (a new request, or tracing began mid-stream): the
            # tokens produced before this step come from vLLM's own count.
            state = live.get(internal)
            before = 0
            prompt = 0
            if state is not None:
                before = max(0, state.num_output_tokens - new_tokens)
                prompt = state.num_prompt_tokens
            req = _Request(self._external_id(internal).encode(), before, prompt)
            self._requests[internal] = req
        return req

    def _fire_events(self, req, events, scheduler, scheduler_output):
        usdt = self._usdt
        for event in events:
            kind = self._events.get(event.type)
            at = _ns(event.timestamp)
            if kind == "queued":
                usdt.request_queued(req.rid, len(scheduler.waiting), at)
            elif kind == "scheduled":
                batch = len(scheduler_output.num_scheduled_tokens)
                usdt.request_scheduled(req.rid, batch, at)
                if not req.scheduled:
                    # vLLM's prefill interval starts at the first SCHEDULED.
                    req.scheduled = True
                    usdt.prefill_start(req.rid, req.prompt_tokens, at)
            elif kind == "preempted":
                req.preemptions += 1
                usdt.request_preempted(req.rid, req.preemptions, at)
