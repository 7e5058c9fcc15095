"""The request id users see, from the id vLLM's engine uses.

vLLM's API server names a chat request `chatcmpl-<X-Request-Id or uuid>`
and puts that id in every SSE chunk; its InputProcessor then hands the
engine `f"{external}-{random_uuid():.8}"` (8 hex characters) so that
duplicate client ids cannot collide inside the engine. Probes must carry the
external id: that is what the agent reads from the response and joins on.
"""

_HEX = frozenset("0123456789abcdef")
_SUFFIX = 9  # "-" and 8 hex characters


def external_id(internal, randomized=True):
    """`internal` without vLLM's random suffix; unchanged when it has none
    (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, or an id from another path)."""
    if not randomized or len(internal) <= _SUFFIX or internal[-_SUFFIX] != "-":
        return internal
    if not _HEX.issuperset(internal[-8:]):
        return internal
    return internal[:-_SUFFIX]
