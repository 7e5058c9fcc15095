// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * CPU profile of a recording session (`tokentrace record`): a perf_event
 * program the agent attaches to one CPU-clock sampling event per CPU. When
 * the interrupted task belongs to a profiled process, its kernel and user
 * stacks are copied into a record on this object's own ring buffer; the
 * agent symbolises them after the session.
 *
 * Separate from sock.bpf.c on purpose: it is loaded only while a session
 * samples CPU, and its cost (one hash lookup per sample on every CPU, two
 * stack walks per sample of a profiled thread) never touches the
 * always-on tracing path.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "events.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Samples that did not fit in the ring buffer, read by the agent. */
__u64 ringbuf_drops = 0;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4 << 20);
} samples SEC(".maps");

/* tgid -> 1 for every profiled process. Filled by the agent; children
 * forked by a profiled process are added here at fork (server workers). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, __u8);
} profiled_tgids SEC(".maps");

/* Keep the record type in BTF so libbpf-cargo generates a Rust type. */
struct tt_cpu_sample _cpu_sample = {};

SEC("perf_event")
int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;

	if (tgid == 0 || !bpf_map_lookup_elem(&profiled_tgids, &tgid))
		return 0;
	struct tt_cpu_sample *s = bpf_ringbuf_reserve(&samples, sizeof(*s), 0);
	if (!s) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	s->hdr.kind = TT_EVENT_CPU_SAMPLE;
	s->hdr.tgid = tgid;
	s->hdr.tid = (__u32)pid_tgid;
	s->hdr._pad = 0;
	s->hdr.ts_ns = bpf_ktime_get_ns();
	bpf_get_current_comm(s->hdr.comm, sizeof(s->hdr.comm));
	s->cpu = bpf_get_smp_processor_id();
	s->_pad = 0;
	s->kstack_bytes = bpf_get_stack(ctx, s->kstack, sizeof(s->kstack), 0);
	s->ustack_bytes = bpf_get_stack(ctx, s->ustack, sizeof(s->ustack), BPF_F_USER_STACK);
	bpf_ringbuf_submit(s, 0);
	return 0;
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_profiled_fork, struct task_struct *parent, struct task_struct *child)
{
	__u32 parent_tgid = parent->tgid;
	__u32 child_tgid = child->tgid;
	__u8 one = 1;

	if (parent_tgid == child_tgid || !bpf_map_lookup_elem(&profiled_tgids, &parent_tgid))
		return 0;
	bpf_map_update_elem(&profiled_tgids, &child_tgid, &one, BPF_ANY);
	return 0;
}
