/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * What every tokentrace BPF object shares: the ring buffer and the pid
 * filter (one instance: objects loaded after the first reuse its map fds),
 * the loss counter, and helpers to fill record headers and look at the
 * socket behind an fd. Included by each *.bpf.c after vmlinux.h and the
 * libbpf headers.
 */
#ifndef TOKENTRACE_COMMON_BPF_H
#define TOKENTRACE_COMMON_BPF_H

#include "events.h"

#define AF_INET 2
#define AF_INET6 10
#define S_IFMT 00170000
#define S_IFSOCK 0140000
#define SOCK_STREAM 1
#define IPPROTO_TCP 6

/* Set by the agent before load. */
const volatile __u64 wakeup_bytes = 256 * 1024;
const volatile __u32 agent_tgid = 0;

/* Records that did not fit in the ring buffer, read by the agent. */
__u64 ringbuf_drops = 0;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 << 20);
} events SEC(".maps");

/* The pid filter, first check of every program: one byte per tgid (1:
 * traced), in an array the verifier inlines (an untraced hit costs a
 * bounds check and a load, no hash). Each 8-byte element holds the flags
 * of 8 consecutive tgids, so the array's memory, which the agent mmaps
 * (BPF_F_MMAPABLE) and writes directly, is a plain byte array indexed by
 * tgid. Sized by the agent to /proc/sys/kernel/pid_max before load. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 32768 / 8);
	__type(key, __u32);
	__type(value, __u64);
} traced_flags SEC(".maps");

/* tgid -> 1 for traced processes whose tgid is past `traced_flags` (pid_max
 * raised after the agent started). Maintained by the agent; children of
 * traced processes are added at fork, like the flags. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, __u8);
} traced_tgids SEC(".maps");

/* The byte of `tgid` in `map`, an array shaped like `traced_flags` (each
 * 8-byte element holds 8 consecutive tgids' bytes), or NULL when it is
 * past the array. Inlined: the verifier sees which map. */
static __always_inline __u8 *tgid_byte(void *map, __u32 tgid)
{
	__u32 slot = tgid >> 3;
	__u8 *bytes = bpf_map_lookup_elem(map, &slot);

	return bytes ? &bytes[tgid & 7] : NULL;
}

/* The flag byte of `tgid`, or NULL when it is past the array. */
static __always_inline __u8 *traced_flag(__u32 tgid)
{
	return tgid_byte(&traced_flags, tgid);
}

static __always_inline bool is_traced(__u32 tgid)
{
	__u8 *flag = traced_flag(tgid);

	if (flag)
		return *flag && tgid != agent_tgid;
	if (tgid == agent_tgid)
		return false;
	return bpf_map_lookup_elem(&traced_tgids, &tgid) != NULL;
}

/* Marks `tgid` traced (1) or not (0) in the kernel, where the agent would. */
static __always_inline int set_traced(__u32 tgid, __u8 on)
{
	__u8 *flag = traced_flag(tgid);

	if (flag) {
		*flag = on;
		return 0;
	}
	if (on)
		return bpf_map_update_elem(&traced_tgids, &tgid, &on, BPF_ANY);
	bpf_map_delete_elem(&traced_tgids, &tgid);
	return 0;
}

/* Kernels >= 6.13 run uprobe programs preemptible (migrate-disabled only),
 * and programs with 64+ bytes of stack on a per-CPU private stack: two
 * tasks preempting each other on one CPU would share it and any per-CPU
 * staging slot (`scratch`). Programs that stage a record there, or whose
 * stack is that deep, disable preemption first thing (weak kfuncs, 6.10+;
 * older kernels run every program here non-preemptible, and the calls are
 * dead code there). The socket-layer tracepoints' programs do it only to
 * stage (see hook_io_done): the kernel calls them non-preemptible. */
extern void bpf_preempt_disable(void) __weak __ksym;
extern void bpf_preempt_enable(void) __weak __ksym;

static __always_inline void no_preempt_begin(void)
{
	if (bpf_ksym_exists(bpf_preempt_disable))
		bpf_preempt_disable();
}

static __always_inline void no_preempt_end(void)
{
	if (bpf_ksym_exists(bpf_preempt_enable))
		bpf_preempt_enable();
}

/* Ring buffer bytes a record of `size` takes: an 8-byte header, the record
 * padded to 8. */
static __always_inline __u64 ring_room(__u64 size)
{
	return 8 + ((size + 7) & ~7ULL);
}

/* Wakes the agent once per `wakeup_bytes` of unread records: when `unread`
 * (a record of `size` included) passes a multiple of it. Not "whenever it
 * is above": while the agent caught up from behind, every record woke it
 * again, each wake-up an irq_work raised by a self-IPI (an APIC write,
 * which exits to the hypervisor in a VM; in the bench's flood 24,595
 * irq_work interrupts in 4 s before, 2,380 after, and the APIC writes went
 * from 4.3 % to 0.4 % of the host's CPU samples). A crossing that two CPUs
 * race past unseen is caught at the next multiple, and the agent polls
 * every `poll_interval` besides. */
static __always_inline __u64 wakeup_for(__u64 unread, __u64 size)
{
	__u64 room = ring_room(size);

	if (wakeup_bytes <= room || unread < room)
		return BPF_RB_FORCE_WAKEUP;
	if (unread / wakeup_bytes != (unread - room) / wakeup_bytes)
		return BPF_RB_FORCE_WAKEUP;
	return BPF_RB_NO_WAKEUP;
}

/* The flags for submitting a reserved record of `size`. */
static __always_inline __u64 wakeup_flags(__u64 size)
{
	return wakeup_for(bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA), size);
}

/* Kernel memory read by plain loads instead of one bpf_probe_read_kernel
 * call per field (BPF_CORE_READ): bpf_rdonly_cast (6.2+) tells the
 * verifier what a pointer points to and costs nothing at run time; a load
 * through it that faults reads 0. A data record reads ~25 fields of the
 * task, the fd table, the file and the socket, and every helper call is a
 * call and a return (expensive where return thunks guard against SRSO).
 * Older kernels take the BPF_CORE_READ branch, the one not taken is dead
 * code the verifier never walks. */
static __always_inline bool direct_reads(void)
{
	return bpf_ksym_exists(bpf_rdonly_cast);
}

/* One field of a kernel object behind `ptr`: a plain load where
 * bpf_rdonly_cast exists, a BPF_CORE_READ (a helper call) before. */
#define KREAD(type, ptr, field)                                                                    \
	(direct_reads() ? bpf_core_cast(ptr, type)->field : BPF_CORE_READ((type *)(ptr), field))

static __always_inline void fill_header(struct tt_event_header *hdr, __u32 kind)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	hdr->kind = kind;
	hdr->tgid = pid_tgid >> 32;
	hdr->tid = (__u32)pid_tgid;
	hdr->ts_ns = bpf_ktime_get_ns();
	/* The process name, not the thread's: uvicorn's worker threads and the
	 * event loop all belong to one `python3`. */
	if (direct_reads()) {
		struct task_struct *leader = bpf_get_current_task_btf()->group_leader;
		__builtin_memcpy(hdr->comm, leader->comm, sizeof(hdr->comm));
		hdr->comm[sizeof(hdr->comm) - 1] = 0;
		return;
	}
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	BPF_CORE_READ_STR_INTO(&hdr->comm, task, group_leader, comm);
}

/* The socket behind `fd` in the current process if it is an IPv4/IPv6 TCP
 * socket, else NULL. */
static __always_inline struct sock *tcp_sock_of_fd(int fd, __u64 *ino)
{
	if (fd < 0)
		return NULL;
	if (direct_reads()) {
		struct fdtable *fdt = bpf_get_current_task_btf()->files->fdt;
		__u64 slot = 0;

		if ((unsigned int)fd >= fdt->max_fds)
			return NULL;
		/* fdt->fd is a pointer to pointers: the verifier types no load
		 * through it, so this one field is a probe read. */
		if (bpf_probe_read_kernel(&slot, sizeof(slot), (void *)fdt->fd + (__u64)fd * sizeof(void *)) || !slot)
			return NULL;
		struct file *file = bpf_core_cast((void *)slot, struct file);
		struct inode *inode = file->f_inode;
		if ((inode->i_mode & S_IFMT) != S_IFSOCK)
			return NULL;
		struct socket *sock = bpf_core_cast(file->private_data, struct socket);
		struct sock *sk = sock->sk;
		if (!sk)
			return NULL;
		__u16 family = sk->__sk_common.skc_family;
		if (family != AF_INET && family != AF_INET6)
			return NULL;
		if (sk->sk_type != SOCK_STREAM || sk->sk_protocol != IPPROTO_TCP)
			return NULL;
		*ino = inode->i_ino;
		return sk;
	}
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct file **fds = BPF_CORE_READ(task, files, fdt, fd);
	unsigned int max_fds = BPF_CORE_READ(task, files, fdt, max_fds);
	struct file *file = NULL;

	if ((unsigned int)fd >= max_fds)
		return NULL;
	if (bpf_probe_read_kernel(&file, sizeof(file), &fds[fd]) || !file)
		return NULL;
	struct inode *inode = BPF_CORE_READ(file, f_inode);
	umode_t mode = BPF_CORE_READ(inode, i_mode);
	if ((mode & S_IFMT) != S_IFSOCK)
		return NULL;
	struct socket *sock = BPF_CORE_READ(file, private_data);
	struct sock *sk = BPF_CORE_READ(sock, sk);
	if (!sk)
		return NULL;
	__u16 family = BPF_CORE_READ(sk, __sk_common.skc_family);
	if (family != AF_INET && family != AF_INET6)
		return NULL;
	if (BPF_CORE_READ(sk, sk_type) != SOCK_STREAM || BPF_CORE_READ(sk, sk_protocol) != IPPROTO_TCP)
		return NULL;
	*ino = BPF_CORE_READ(inode, i_ino);
	return sk;
}

/* The inode number of the socket file behind `sk`, what tcp_sock_of_fd
 * reports for its fd (0 for a socket without a file). */
static __always_inline __u64 sock_file_ino(struct sock *sk)
{
	if (direct_reads()) {
		struct socket *sock = bpf_core_cast(sk, struct sock)->sk_socket;
		if (!sock)
			return 0;
		struct file *file = bpf_core_cast(sock, struct socket)->file;
		if (!file)
			return 0;
		return bpf_core_cast(file, struct file)->f_inode->i_ino;
	}
	return BPF_CORE_READ(sk, sk_socket, file, f_inode, i_ino);
}

static __always_inline void fill_addrs(struct sock *sk, struct tt_sock_addrs *a)
{
	if (direct_reads()) {
		struct sock_common *c = &bpf_core_cast(sk, struct sock)->__sk_common;
		a->family = c->skc_family;
		a->local_port = c->skc_num;
		a->remote_port = bpf_ntohs(c->skc_dport);
		if (a->family == AF_INET) {
			__builtin_memcpy(a->local_addr, &c->skc_rcv_saddr, 4);
			__builtin_memcpy(a->remote_addr, &c->skc_daddr, 4);
		} else {
			__builtin_memcpy(a->local_addr, &c->skc_v6_rcv_saddr, 16);
			__builtin_memcpy(a->remote_addr, &c->skc_v6_daddr, 16);
		}
		return;
	}
	a->family = BPF_CORE_READ(sk, __sk_common.skc_family);
	a->local_port = BPF_CORE_READ(sk, __sk_common.skc_num);
	a->remote_port = bpf_ntohs(BPF_CORE_READ(sk, __sk_common.skc_dport));
	if (a->family == AF_INET) {
		bpf_core_read(a->local_addr, 4, &sk->__sk_common.skc_rcv_saddr);
		bpf_core_read(a->remote_addr, 4, &sk->__sk_common.skc_daddr);
	} else {
		bpf_core_read(a->local_addr, 16, &sk->__sk_common.skc_v6_rcv_saddr);
		bpf_core_read(a->remote_addr, 16, &sk->__sk_common.skc_v6_daddr);
	}
}

#endif /* TOKENTRACE_COMMON_BPF_H */
