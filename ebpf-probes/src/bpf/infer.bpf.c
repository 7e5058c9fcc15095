// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * "Why was this token late": probes inside inference processes.
 *
 * - `llm:*` USDT probes (one program; the USDT cookie says which probe).
 * - CUDA runtime/driver uprobes: launches are counted per thread in a map;
 *   synchronisation calls are timed (entry + return) and carry the launch
 *   count since the thread's previous sync. Uprobes see work being
 *   enqueued, not executed: GPU time is inferred from how long syncs wait.
 * - Off-CPU intervals of traced threads (sched_switch), with the syscall
 *   they blocked in and whether a CUDA sync was in flight.
 *
 * Shares the ring buffer and pid filter with sock.bpf.c (the agent reuses
 * their fds before loading this object), so it is optional: if uprobes or
 * tp_btf are unavailable the socket probes still work.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/usdt.bpf.h>
#include "common.bpf.h"
#include "thread_state.bpf.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Shorter off-CPU intervals are not reported (set by the agent). */
const volatile __u64 offcpu_min_ns = 1000000;

/* Keep the record types and enums in BTF for the generated Rust types. */
struct tt_usdt_event _usdt_event = {};
struct tt_cuda_sync_event _cuda_sync_event = {};
struct tt_offcpu_event _offcpu_event = {};
enum tt_llm_probe _llm_probe = 0;
enum tt_cuda_sync _cuda_sync = 0;

/* ---- llm:* USDT ----------------------------------------------------------- */

SEC("usdt")
int llm_probe(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!is_traced(pid_tgid >> 32))
		return 0;
	struct tt_usdt_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	__u32 probe = bpf_usdt_cookie(ctx);
	int nargs = bpf_usdt_arg_cnt(ctx);
	long value = 0;

	fill_header(&e->hdr, TT_EVENT_USDT);
	e->probe = probe;
	e->nargs = nargs < 0 ? 0 : nargs;
	e->request_id[0] = 0;
	/* Every probe but batch_step starts with the request id. */
	int first_int = probe == TT_LLM_BATCH_STEP ? 0 : 1;
	if (first_int && bpf_usdt_arg(ctx, 0, &value) == 0)
		bpf_probe_read_user_str(e->request_id, sizeof(e->request_id), (void *)value);
	for (int i = 0; i < 3; i++) {
		e->args[i] = 0;
		if (first_int + i < nargs && bpf_usdt_arg(ctx, first_int + i, &value) == 0)
			e->args[i] = value;
	}
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
	return 0;
}

/* ---- CUDA ------------------------------------------------------------------ */

/* Work a thread enqueued since its previous sync. */
struct cuda_work {
	__u64 kernel_launches;
	__u64 graph_launches;
	__u64 memcpy_bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64); /* pid_tgid */
	__type(value, struct cuda_work);
} cuda_work SEC(".maps");

/* The same in task storage (thread_state.bpf.h). */
TASK_STORAGE_MAP(task_cuda_work, struct cuda_work);

/* A sync call in flight on a thread (ts_enter 0: none). */
struct cuda_call {
	__u64 ts_enter;
	__u64 handle;
	__u32 call;
	__u32 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64); /* pid_tgid */
	__type(value, struct cuda_call);
} cuda_calls SEC(".maps");

/* The same in task storage (thread_state.bpf.h). */
TASK_STORAGE_MAP(task_cuda_call, struct cuda_call);

static __always_inline struct cuda_work *work_of_thread(const __u64 *pid_tgid)
{
	return thread_state(&task_cuda_work, &cuda_work, NULL, pid_tgid, true);
}

/* The sync call in flight on `task` (NULL: the current thread), or NULL. */
static __always_inline struct cuda_call *cuda_call_of(struct task_struct *task, const __u64 *pid_tgid)
{
	return thread_call_of(struct cuda_call, &task_cuda_call, &cuda_calls, task, pid_tgid);
}

static __always_inline int count_launch(bool graph, __u64 memcpy_bytes)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!is_traced(pid_tgid >> 32))
		return 0;
	struct cuda_work *work = work_of_thread(&pid_tgid);
	if (!work)
		return 0;
	if (memcpy_bytes)
		__sync_fetch_and_add(&work->memcpy_bytes, memcpy_bytes);
	else if (graph)
		__sync_fetch_and_add(&work->graph_launches, 1);
	else
		__sync_fetch_and_add(&work->kernel_launches, 1);
	return 0;
}

SEC("uprobe")
int BPF_UPROBE(cuda_launch_kernel)
{
	return count_launch(false, 0);
}

SEC("uprobe")
int BPF_UPROBE(cuda_graph_launch)
{
	return count_launch(true, 0);
}

/* cudaMemcpyAsync(dst, src, count, kind, stream) */
SEC("uprobe")
int BPF_UPROBE(cuda_memcpy_async, void *dst, const void *src, __u64 count)
{
	return count_launch(false, count ? count : 1);
}

static __always_inline int sync_enter(__u32 call, __u64 handle)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!is_traced(pid_tgid >> 32))
		return 0;
	struct cuda_call c = {
		.ts_enter = bpf_ktime_get_ns(),
		.handle = handle,
		.call = call,
	};
	thread_state_put(&task_cuda_call, &cuda_calls, NULL, &pid_tgid, &c);
	return 0;
}

SEC("uprobe")
int BPF_UPROBE(cuda_stream_sync, __u64 stream)
{
	return sync_enter(TT_CUDA_STREAM_SYNCHRONIZE, stream);
}

SEC("uprobe")
int BPF_UPROBE(cuda_device_sync)
{
	return sync_enter(TT_CUDA_DEVICE_SYNCHRONIZE, 0);
}

SEC("uprobe")
int BPF_UPROBE(cuda_event_sync, __u64 event)
{
	return sync_enter(TT_CUDA_EVENT_SYNCHRONIZE, event);
}

SEC("uprobe")
int BPF_UPROBE(cu_stream_sync, __u64 stream)
{
	return sync_enter(TT_CU_STREAM_SYNCHRONIZE, stream);
}

SEC("uprobe")
int BPF_UPROBE(cu_ctx_sync)
{
	return sync_enter(TT_CU_CTX_SYNCHRONIZE, 0);
}

/* One return probe for every sync above. */
SEC("uretprobe")
int BPF_URETPROBE(cuda_sync_exit)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct cuda_call *cp = cuda_call_of(NULL, &pid_tgid);

	if (!cp)
		return 0;
	struct cuda_call c = *cp;
	thread_call_end(&cuda_calls, &pid_tgid, cp);
	struct tt_cuda_sync_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	fill_header(&e->hdr, TT_EVENT_CUDA_SYNC);
	e->ts_enter_ns = c.ts_enter;
	e->handle = c.handle;
	e->call = c.call;
	e->_pad = 0;
	e->kernel_launches = 0;
	e->graph_launches = 0;
	e->memcpy_bytes = 0;
	struct cuda_work *work = thread_state(&task_cuda_work, &cuda_work, NULL, &pid_tgid, false);
	if (work) {
		e->kernel_launches = __sync_lock_test_and_set(&work->kernel_launches, 0);
		e->graph_launches = __sync_lock_test_and_set(&work->graph_launches, 0);
		e->memcpy_bytes = __sync_lock_test_and_set(&work->memcpy_bytes, 0);
	}
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
	return 0;
}

/* ---- off-CPU -------------------------------------------------------------- */

/* What only the switch-out knows. The syscall the thread sleeps in and
 * whether it sleeps in a CUDA sync are read at its switch-in, and only for
 * an interval that is reported: a thread off CPU has not moved, so its
 * saved registers and its cuda_calls entry are what they were. */
struct offcpu_start {
	__u64 ts;
	__u32 state;
	__u32 preempted;
};

/* TASK_DEAD (include/linux/sched.h): the state of a thread's switch-out
 * after do_exit(). */
#define TT_TASK_DEAD 0x80

/* A traced thread's last switch-out (ts 0: consumed by its switch-in).
 * Each thread's entry stays and is rewritten in place: an LRU update (a
 * new node swapped in under the map's locks) at every switch-out and a
 * delete at every switch-in were ~300 of a traced switch's ~820 ns
 * (bpf_stats, a traced pingpong). Only
 * the thread's own switches touch its entry, and the scheduler orders
 * them (a task runs on a CPU only after its switch-out elsewhere ended),
 * so the plain writes never race. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); /* tid */
	__type(value, struct offcpu_start);
} offcpu_starts SEC(".maps");

/* The same in task storage (thread_state.bpf.h). */
TASK_STORAGE_MAP(task_offcpu, struct offcpu_start);

/* The syscall `task` is in, or -1 (preempted in user space or in an IRQ:
 * orig_ax holds the syscall number only on the syscall entry path). */
static __always_inline __s64 current_syscall(struct task_struct *task)
{
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	long orig_ax = BPF_CORE_READ(regs, orig_ax);
	return orig_ax < 0 ? -1 : orig_ax;
}

/* Every context switch on the host runs this: the first check is both
 * tasks' pid-filter bytes (two array loads, no hash, no other work), so a
 * switch between untraced tasks costs a few instructions. */
SEC("tp_btf/sched_switch")
int BPF_PROG(on_sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	__u32 prev_tgid = prev->tgid;
	__u32 next_tgid = next->tgid;
	bool prev_traced = is_traced(prev_tgid);
	bool next_traced = is_traced(next_tgid);

	if (!prev_traced && !next_traced)
		return 0;
	__u64 now = bpf_ktime_get_ns();

	if (prev_traced && !preempt && (prev_state & TT_TASK_DEAD)) {
		/* Its last switch-out: the thread is gone, and a new thread the
		 * kernel gives its id must not find a start from its death (task
		 * storage goes with the task). */
		__u32 tid = prev->pid;
		if (!task_storage)
			bpf_map_delete_elem(&offcpu_starts, &tid);
	} else if (prev_traced) {
		__u32 tid = prev->pid;
		struct offcpu_start start = {
			.ts = now,
			.state = preempt ? 0 : prev_state,
			.preempted = preempt,
		};
		thread_state_put(&task_offcpu, &offcpu_starts, prev, &tid, &start);
	}
	if (!next_traced)
		return 0;
	__u32 next_tid = next->pid;
	struct offcpu_start *start = thread_state(&task_offcpu, &offcpu_starts, next, &next_tid, false);
	if (!start || !start->ts)
		return 0;
	struct offcpu_start s = *start;
	start->ts = 0;
	if (now - s.ts < offcpu_min_ns)
		return 0;
	struct tt_offcpu_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	/* The header describes `next`, the thread coming back on CPU. Its
	 * comm is left empty: the explainer does not use it. */
	e->hdr.kind = TT_EVENT_OFFCPU;
	e->hdr.tgid = next_tgid;
	e->hdr.tid = next_tid;
	e->hdr._pad = 0;
	e->hdr.ts_ns = now;
	__builtin_memset(e->hdr.comm, 0, sizeof(e->hdr.comm));
	e->start_ns = s.ts;
	e->syscall = s.preempted ? -1 : current_syscall(next);
	e->state = s.state;
	__u64 next_pid_tgid = ((__u64)next_tgid << 32) | next_tid;
	e->in_cuda_sync = cuda_call_of(next, &next_pid_tgid) != NULL;
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
	return 0;
}
