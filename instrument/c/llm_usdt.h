/*
 * llm_usdt.h - the `llm` USDT provider (SystemTap SDT notes, <sys/sdt.h>).
 *
 * The contract, read by the tokentrace agent exactly as written here
 * (instrument/README.md has the full table):
 *
 *   llm:request_start     (const char *request_id, uint64_t prompt_tokens)
 *   llm:request_queued    (const char *request_id, uint64_t queue_depth)
 *   llm:request_scheduled (const char *request_id, uint64_t batch_size)
 *   llm:prefill_start     (const char *request_id, uint64_t prompt_tokens)
 *   llm:prefill_end       (const char *request_id, uint64_t prompt_tokens)
 *   llm:token             (const char *request_id, uint64_t token_index)
 *   llm:request_end       (const char *request_id, uint64_t completion_tokens)
 *   llm:request_preempted (const char *request_id, uint64_t preemptions)
 *   llm:batch_step        (uint64_t step_id, uint64_t batch_size,
 *                          uint64_t tokens_in_step)
 *
 * request_id: NUL-terminated, the id the server returns to the client
 * ("chatcmpl-..."); readers copy at most 63 bytes. Every argument is passed
 * as an 8-byte value.
 *
 * Every probe with a request id takes an optional third argument, at_ns:
 * the CLOCK_MONOTONIC time (ns, the clock of bpf_ktime_get_ns and Python's
 * time.monotonic()) when the event happened, for instrumentation that
 * learns of an event after the fact (vLLM stamps its scheduler events and
 * hands them on a step later). 0, or a site without it: the firing time.
 * The plain macros fire without it; the _AT forms pass it.
 *
 * Every probe has a semaphore: the macros test it first, so an unattached
 * probe costs one load and a predicted branch, and its arguments are not
 * evaluated. A tracer (libbpf, bpftrace, stap) increments the semaphore
 * while attached.
 *
 * Use: include this header anywhere, and in exactly ONE translation unit of
 * each executable or shared object define LLM_USDT_DEFINE_SEMAPHORES before
 * including it, which defines the semaphore variables. They are hidden, so
 * every object (your binary, libllm_usdt.so) keeps its own set and a tracer
 * enables each object's probes independently.
 */
#ifndef LLM_USDT_H
#define LLM_USDT_H

#include <stdint.h>

/* The notes must name a semaphore address; without this sdt.h writes 0. */
#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>

#define LLM_USDT_PROBES(X) \
  X(request_start)         \
  X(request_queued)        \
  X(request_scheduled)     \
  X(prefill_start)         \
  X(prefill_end)           \
  X(token)                 \
  X(request_end)           \
  X(request_preempted)     \
  X(batch_step)

/* sdt.h requires the semaphore of probe P of provider llm to be called
 * llm_P_semaphore; tools expect an unsigned short in section .probes. */
#ifdef LLM_USDT_DEFINE_SEMAPHORES
#define LLM_USDT_SEMAPHORE_(name)                                        \
  __attribute__((visibility("hidden"), section(".probes"), used))        \
  volatile unsigned short llm_##name##_semaphore;
#else
#define LLM_USDT_SEMAPHORE_(name)                                        \
  __attribute__((visibility("hidden")))                                  \
  extern volatile unsigned short llm_##name##_semaphore;
#endif
LLM_USDT_PROBES(LLM_USDT_SEMAPHORE_)
#undef LLM_USDT_SEMAPHORE_

/* True while a tracer is attached to llm:<name>. */
#define LLM_USDT_ENABLED(name) __builtin_expect(llm_##name##_semaphore != 0, 0)

/* The casts pin each argument to the contract's type, so a caller passing
 * an int or a char array still produces the documented 8-byte argument. */
#define LLM_USDT_RID_PROBE_(name, request_id, value)                     \
  do {                                                                   \
    if (LLM_USDT_ENABLED(name))                                          \
      DTRACE_PROBE2(llm, name, (const char *)(request_id),               \
                    (uint64_t)(value));                                  \
  } while (0)

/* Any request-id probe with the time the event happened (see at_ns above). */
#define LLM_USDT_AT(name, request_id, value, at_ns)                       \
  do {                                                                   \
    if (LLM_USDT_ENABLED(name))                                          \
      DTRACE_PROBE3(llm, name, (const char *)(request_id),               \
                    (uint64_t)(value), (uint64_t)(at_ns));               \
  } while (0)

#define LLM_USDT_REQUEST_START(request_id, prompt_tokens) \
  LLM_USDT_RID_PROBE_(request_start, request_id, prompt_tokens)
#define LLM_USDT_REQUEST_QUEUED(request_id, queue_depth) \
  LLM_USDT_RID_PROBE_(request_queued, request_id, queue_depth)
#define LLM_USDT_REQUEST_SCHEDULED(request_id, batch_size) \
  LLM_USDT_RID_PROBE_(request_scheduled, request_id, batch_size)
#define LLM_USDT_PREFILL_START(request_id, prompt_tokens) \
  LLM_USDT_RID_PROBE_(prefill_start, request_id, prompt_tokens)
#define LLM_USDT_PREFILL_END(request_id, prompt_tokens) \
  LLM_USDT_RID_PROBE_(prefill_end, request_id, prompt_tokens)
#define LLM_USDT_TOKEN(request_id, token_index) \
  LLM_USDT_RID_PROBE_(token, request_id, token_index)
#define LLM_USDT_REQUEST_END(request_id, completion_tokens) \
  LLM_USDT_RID_PROBE_(request_end, request_id, completion_tokens)
#define LLM_USDT_REQUEST_PREEMPTED(request_id, preemptions) \
  LLM_USDT_RID_PROBE_(request_preempted, request_id, preemptions)

#define LLM_USDT_BATCH_STEP(step_id, batch_size, tokens_in_step)         \
  do {                                                                   \
    if (LLM_USDT_ENABLED(batch_step))                                    \
      DTRACE_PROBE3(llm, batch_step, (uint64_t)(step_id),                \
                    (uint64_t)(batch_size), (uint64_t)(tokens_in_step)); \
  } while (0)

/* Functions of libllm_usdt.so (llm_usdt.c): the same probes for callers
 * that cannot expand C macros (Python through ctypes, other FFI). */
#ifdef __cplusplus
extern "C" {
#endif
void llm_usdt_request_start(const char *request_id, uint64_t prompt_tokens,
                            uint64_t at_ns);
void llm_usdt_request_queued(const char *request_id, uint64_t queue_depth,
                             uint64_t at_ns);
void llm_usdt_request_scheduled(const char *request_id, uint64_t batch_size,
                                uint64_t at_ns);
void llm_usdt_prefill_start(const char *request_id, uint64_t prompt_tokens,
                            uint64_t at_ns);
void llm_usdt_prefill_end(const char *request_id, uint64_t prompt_tokens,
                          uint64_t at_ns);
void llm_usdt_token(const char *request_id, uint64_t token_index,
                    uint64_t at_ns);
void llm_usdt_request_end(const char *request_id, uint64_t completion_tokens,
                          uint64_t at_ns);
void llm_usdt_request_preempted(const char *request_id, uint64_t preemptions,
                                uint64_t at_ns);
void llm_usdt_batch_step(uint64_t step_id, uint64_t batch_size,
                         uint64_t tokens_in_step);
/* Address of a probe's semaphore (NULL for an unknown name): a runtime that
 * pays for every foreign call (Python's ctypes) reads it directly to skip
 * all work, argument building included, while no tracer is attached. */
const volatile unsigned short *llm_usdt_semaphore(const char *probe);
#ifdef __cplusplus
}
#endif

#endif /* LLM_USDT_H */
