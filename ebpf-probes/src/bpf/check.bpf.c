// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * One trivial program per attach type, so `tokentrace check` can find out
 * what this kernel really allows by loading and attaching each one on its
 * own (a failed fentry load must not hide a working tracepoint).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

__u64 hits = 0;

SEC("tracepoint/syscalls/sys_enter_getppid")
int check_tracepoint(void *ctx)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(check_tp_btf, struct task_struct *parent, struct task_struct *child)
{
	return 0;
}

SEC("kprobe/do_nanosleep")
int check_kprobe(void *ctx)
{
	return 0;
}

SEC("fentry/do_nanosleep")
int BPF_PROG(check_fentry)
{
	return 0;
}

/* Attached by the agent to a function of its own executable. */
SEC("uprobe")
int check_uprobe(void *ctx)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

/* The same through a uprobe_multi link (kernel 6.6+), which needs no
 * CAP_SYS_ADMIN where perf-event uprobes do (CVE-2025-38466 fix). */
SEC("uprobe.multi")
int check_uprobe_multi(void *ctx)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}
