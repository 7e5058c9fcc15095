/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Per-thread state: a thread's latest socket read, its OpenSSL or CUDA
 * call in flight, the CUDA work it enqueued, its last switch-out. Each
 * kind has two maps, and a run creates one of them (the agent leaves the
 * other out, and the verifier drops the code that would use it):
 *
 * - task storage (`task_*`) where the kernel offers it to tracing
 *   programs and allocates it from any context, sched_switch's included
 *   (6.4+; the agent checks, see probes/thread_state.rs): memory only for
 *   the threads that keep some, freed with the thread, never evicted, and
 *   found through the task itself rather than by hashing its id;
 * - elsewhere a hash map keyed by the thread, preallocated to its
 *   capacity: 5.5 to 12.5 MiB of kernel memory each for 65,536 threads.
 *
 * In task storage a call's entry outlives the call (a delete would free it
 * and the next call allocate it again): it is cleared, and readers test
 * the call's start, never the entry's presence. Included after
 * common.bpf.h.
 */
#ifndef TOKENTRACE_THREAD_STATE_BPF_H
#define TOKENTRACE_THREAD_STATE_BPF_H

/* Set by the agent before load. */
const volatile bool task_storage = false;

/* The task storage twin of a per-thread map: `name` holding `entry`s. */
#define TASK_STORAGE_MAP(name, entry)                                                             \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_TASK_STORAGE);                                           \
		__uint(map_flags, BPF_F_NO_PREALLOC);                                              \
		__type(key, int);                                                                  \
		__type(value, entry);                                                              \
	} name SEC(".maps")

/* The largest per-thread value (struct last_read). */
#define THREAD_STATE_MAX_BYTES 128

/* Entries a thread needed and could not get, read by the agent: a map by
 * thread id full, or task storage refused (out of memory, or its per-CPU
 * lock held by a program this one interrupted). */
__u64 thread_state_misses = 0;

/* What a map entry is created from. */
static const char thread_state_zeros[THREAD_STATE_MAX_BYTES];

/* The entry of `task` (NULL: the current thread), whose key in `tid_map`
 * is *key; or NULL. Wrappers pass the key on by pointer: a copy of it made
 * on their own stack left the verifier walking the rest of the data
 * programs twice (on_send_length 102k -> 197k instructions processed,
 * +90 ms to load). `create`: a zeroed entry when it has none. The current
 * task is looked up only for task storage (bpf_get_current_task_btf is
 * 5.11+, and the verifier of an older kernel must not meet it). */
static __always_inline void *thread_state(void *task_map, void *tid_map, struct task_struct *task,
					  const void *key, bool create)
{
	void *state;

	if (task_storage) {
		if (!task)
			task = bpf_get_current_task_btf();
		state = bpf_task_storage_get(task_map, task, 0, create ? BPF_LOCAL_STORAGE_GET_F_CREATE : 0);
	} else {
		state = bpf_map_lookup_elem(tid_map, key);
		if (state || !create)
			return state;
		bpf_map_update_elem(tid_map, key, thread_state_zeros, BPF_NOEXIST);
		state = bpf_map_lookup_elem(tid_map, key);
	}
	if (!state && create)
		__sync_fetch_and_add(&thread_state_misses, 1);
	return state;
}

/* Sets the entry of `task` (NULL: the current thread) to *value, creating
 * it: in place where it exists (an LRU map's update swaps a new node in
 * under the map's locks, ~300 ns of a traced context switch), else by an
 * update of the map. Only the thread's own code touches its entry, so the
 * plain writes never race. */
#define thread_state_put(task_map, tid_map, task, key, value)                                      \
	({                                                                                         \
		typeof(value) slot_ = thread_state(task_map, tid_map, task, key, task_storage);    \
		if (slot_)                                                                         \
			*slot_ = *(value);                                                         \
		else if (!task_storage && bpf_map_update_elem(tid_map, key, value, BPF_ANY))      \
			__sync_fetch_and_add(&thread_state_misses, 1);                             \
	})

/* The call in flight on `task` (NULL: the current thread), a `type` entry
 * with a `ts_enter` (0: none, see above), or NULL. */
#define thread_call_of(type, task_map, tid_map, task, key)                                        \
	({                                                                                         \
		type *call_ = thread_state(task_map, tid_map, task, key, false);                   \
		call_ && call_->ts_enter ? call_ : NULL;                                           \
	})

/* The current thread's call `call` returned: its entry cleared in task
 * storage, deleted from the map by thread id. */
#define thread_call_end(tid_map, key, call)                                                        \
	do {                                                                                       \
		if (task_storage)                                                                  \
			(call)->ts_enter = 0;                                                      \
		else                                                                               \
			bpf_map_delete_elem(tid_map, key);                                         \
	} while (0)

#endif
