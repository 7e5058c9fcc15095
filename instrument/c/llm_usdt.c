/*
 * libllm_usdt.so: the `llm` USDT probes behind plain C functions, for
 * runtimes that cannot expand the llm_usdt.h macros (Python via ctypes).
 * Each function holds the one and only site of its probe in this library,
 * so a tracer attaching llm:token here gets exactly one uprobe.
 */
#define LLM_USDT_DEFINE_SEMAPHORES
#include "llm_usdt.h"

#define LLM_USDT_EXPORT __attribute__((visibility("default")))

LLM_USDT_EXPORT void llm_usdt_request_start(const char *request_id,
                                            uint64_t prompt_tokens) {
  LLM_USDT_REQUEST_START(request_id, prompt_tokens);
}

LLM_USDT_EXPORT void llm_usdt_request_queued(const char *request_id,
                                             uint64_t queue_depth) {
  LLM_USDT_REQUEST_QUEUED(request_id, queue_depth);
}

LLM_USDT_EXPORT void llm_usdt_request_scheduled(const char *request_id,
                                                uint64_t batch_size) {
  LLM_USDT_REQUEST_SCHEDULED(request_id, batch_size);
}

LLM_USDT_EXPORT void llm_usdt_prefill_start(const char *request_id,
                                            uint64_t prompt_tokens) {
  LLM_USDT_PREFILL_START(request_id, prompt_tokens);
}

LLM_USDT_EXPORT void llm_usdt_prefill_end(const char *request_id,
                                          uint64_t prompt_tokens) {
  LLM_USDT_PREFILL_END(request_id, prompt_tokens);
}

LLM_USDT_EXPORT void llm_usdt_token(const char *request_id,
                                    uint64_t token_index) {
  LLM_USDT_TOKEN(request_id, token_index);
}

LLM_USDT_EXPORT void llm_usdt_request_end(const char *request_id,
                                          uint64_t completion_tokens) {
  LLM_USDT_REQUEST_END(request_id, completion_tokens);
}

LLM_USDT_EXPORT void llm_usdt_batch_step(uint64_t step_id, uint64_t batch_size,
                                         uint64_t tokens_in_step) {
  LLM_USDT_BATCH_STEP(step_id, batch_size, tokens_in_step);
}
