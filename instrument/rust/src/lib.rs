//! The `llm` USDT provider for Rust LLM servers.
//!
//! Each function fires one probe of the provider; tokentrace (or bpftrace,
//! `stap`) attaches to them by name. The argument contract is documented in
//! `instrument/README.md` and is the same for the C header and the Python
//! helper:
//!
//! | probe               | arg0                | arg1              | arg2           |
//! |---------------------|---------------------|-------------------|----------------|
//! | `request_start`     | request id (char *) | prompt tokens     |                |
//! | `request_queued`    | request id          | queue depth       |                |
//! | `request_scheduled` | request id          | batch size        |                |
//! | `prefill_start`     | request id          | prompt tokens     |                |
//! | `prefill_end`       | request id          | prompt tokens     |                |
//! | `token`             | request id          | token index       |                |
//! | `request_end`       | request id          | completion tokens |                |
//! | `request_preempted` | request id          | preemptions       |                |
//! | `batch_step`        | step id             | batch size        | tokens in step |
//!
//! The request id is the one the server returns to its client
//! (`"id": "chatcmpl-…"`), passed as a pointer to a NUL-terminated copy of
//! at most [`REQUEST_ID_MAX`] bytes; the integers are 64-bit.
//!
//! Every probe has a semaphore (`probe_lazy!`): while nothing is attached a
//! call costs a function call, a load and a branch, and the request id is
//! not copied. The functions are never inlined so that every binary holds
//! exactly one site, hence one uprobe, per probe.

#![cfg_attr(not(test), no_std)]

use probe::probe_lazy;

/// Bytes of a request id a tracer reads; longer ids are cut here.
pub const REQUEST_ID_MAX: usize = 63;

/// A request id as the probes pass it: NUL-terminated, at most
/// [`REQUEST_ID_MAX`] bytes. An id with a NUL inside ends there for readers,
/// as it would in C.
struct RequestId([u8; REQUEST_ID_MAX + 1]);

impl RequestId {
    fn new(id: &str) -> Self {
        let mut buf = [0u8; REQUEST_ID_MAX + 1];
        let len = id.len().min(REQUEST_ID_MAX);
        buf[..len].copy_from_slice(&id.as_bytes()[..len]);
        Self(buf)
    }

    fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
}

/// Defines a probe function taking (request id, u64). The id is copied
/// into `id`, a local of the function, only when the probe is enabled, and
/// stays alive across the probe site, which hands the tracer its address.
macro_rules! request_probe {
    ($(#[$doc:meta])* $name:ident, $value:ident) => {
        $(#[$doc])*
        #[inline(never)]
        pub fn $name(request_id: &str, $value: u64) {
            let id: RequestId;
            probe_lazy!(
                llm,
                $name,
                {
                    id = RequestId::new(request_id);
                    id.as_ptr()
                },
                $value
            );
        }
    };
}

request_probe!(
    /// `llm:request_start`: the server accepted a request.
    request_start,
    prompt_tokens
);
request_probe!(
    /// `llm:request_queued`: the request waits for the scheduler;
    /// `queue_depth` counts the waiting requests, this one included.
    request_queued,
    queue_depth
);
request_probe!(
    /// `llm:request_scheduled`: the request joined a batch of `batch_size`
    /// requests and runs from now on.
    request_scheduled,
    batch_size
);
request_probe!(
    /// `llm:prefill_start`: processing of the prompt begins.
    prefill_start,
    prompt_tokens
);
request_probe!(
    /// `llm:prefill_end`: the prompt is processed.
    prefill_end,
    prompt_tokens
);
request_probe!(
    /// `llm:token`: token `token_index` (from 0) of the request was generated.
    token,
    token_index
);
request_probe!(
    /// `llm:request_end`: the request is finished after `completion_tokens`
    /// tokens.
    request_end,
    completion_tokens
);

request_probe!(
    /// `llm:request_preempted`: the engine evicted the request (its KV
    /// cache went to others) for the `preemptions`-th time; it waits to be
    /// scheduled again.
    request_preempted,
    preemptions
);

/// `llm:batch_step`: engine step `step_id` finished, serving `batch_size`
/// requests and producing `tokens_in_step` tokens.
#[inline(never)]
pub fn batch_step(step_id: u64, batch_size: u64, tokens_in_step: u64) {
    probe_lazy!(llm, batch_step, step_id, batch_size, tokens_in_step);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(id: &RequestId) -> &[u8] {
        let end = id.0.iter().position(|&b| b == 0).unwrap_or(id.0.len());
        &id.0[..end]
    }

    #[test]
    fn request_id_is_nul_terminated() {
        let id = RequestId::new("chatcmpl-0123");
        assert_eq!(read(&id), b"chatcmpl-0123");
    }

    #[test]
    fn long_request_id_is_cut_at_the_read_limit() {
        let long = "x".repeat(100);
        let id = RequestId::new(&long);
        assert_eq!(read(&id).len(), REQUEST_ID_MAX);
        assert_eq!(id.0[REQUEST_ID_MAX], 0);
    }
}
