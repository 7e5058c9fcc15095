/*
 * libllm_usdt.so: the `llm` USDT probes behind plain C functions, for
 * runtimes that cannot expand the llm_usdt.h macros (Python via ctypes).
 * Each function holds the one and only site of its probe in this library,
 * so a tracer attaching llm:token here gets exactly one uprobe. Each
 * request-id function takes at_ns (0: now) and fires the three-argument
 * form, so callers that learn of an event late can date it.
 */
#define LLM_USDT_DEFINE_SEMAPHORES
#include "llm_usdt.h"

#include <string.h>

#define LLM_USDT_EXPORT __attribute__((visibility("default")))

LLM_USDT_EXPORT void llm_usdt_request_start(const char *request_id,
    uint64_t prompt_tokens, uint64_t at_ns) {
  LLM_USDT_AT(request_start, request_id, prompt_tokens, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_request_queued(const char *request_id,
    uint64_t queue_depth, uint64_t at_ns) {
  LLM_USDT_AT(request_queued, request_id, queue_depth, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_request_scheduled(const char *request_id,
    uint64_t batch_size, uint64_t at_ns) {
  LLM_USDT_AT(request_scheduled, request_id, batch_size, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_prefill_start(const char *request_id,
    uint64_t prompt_tokens, uint64_t at_ns) {
  LLM_USDT_AT(prefill_start, request_id, prompt_tokens, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_prefill_end(const char *request_id,
    uint64_t prompt_tokens, uint64_t at_ns) {
  LLM_USDT_AT(prefill_end, request_id, prompt_tokens, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_token(const char *request_id,
    uint64_t token_index, uint64_t at_ns) {
  LLM_USDT_AT(token, request_id, token_index, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_request_end(const char *request_id,
    uint64_t completion_tokens, uint64_t at_ns) {
  LLM_USDT_AT(request_end, request_id, completion_tokens, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_request_preempted(const char *request_id,
    uint64_t preemptions, uint64_t at_ns) {
  LLM_USDT_AT(request_preempted, request_id, preemptions, at_ns);
}

LLM_USDT_EXPORT void llm_usdt_batch_step(uint64_t step_id, uint64_t batch_size,
                                         uint64_t tokens_in_step) {
  LLM_USDT_BATCH_STEP(step_id, batch_size, tokens_in_step);
}

LLM_USDT_EXPORT const volatile unsigned short *
llm_usdt_semaphore(const char *probe) {
#define LLM_USDT_MATCH_(name)                                            \
  if (strcmp(probe, #name) == 0)                                         \
    return &llm_##name##_semaphore;
  LLM_USDT_PROBES(LLM_USDT_MATCH_)
#undef LLM_USDT_MATCH_
  return NULL;
}
