/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The data path without syscall hooks (socket hooks, kernels 6.3+; the
 * agent loads these programs or the tp_btf/sys_enter + sys_exit pair of
 * sock.bpf.c, never both: see probes/data_hooks.rs).
 *
 * Why: a program on sys_enter/sys_exit, raw or not, sets
 * SYSCALL_WORK_SYSCALL_TRACEPOINT on every task of the host, so every
 * syscall of every process takes the slow entry and exit path and runs
 * both programs, traced or not (getppid() 0.65x as fast with the agent
 * running, 16-byte send()s 0.89x). The socket layer's own tracepoints fire
 * only for socket calls and cost nothing where they are not attached:
 *
 * - tcp_sendmsg_locked (6.16+, optional): inside a TCP send, before any
 *   byte is queued: the send's start, when its first byte is handed to the
 *   kernel (the chunk's emit time; a blocking send may return much later).
 *   Where the kernel lacks it, or the agent leaves it out (one hook less on
 *   every socket send of every process), a send is dated at its return;
 * - sock_send_length / sock_recv_length (6.3+): every socket send and
 *   receive, after the protocol moved its bytes, with the count;
 * - inet_sock_set_state (sock.bpf.c's on_sock_state): listen() and the
 *   close() of a connection in the closing process's context;
 * - vm_unmapped_area: a new mapping of a traced process (a library load).
 *
 * What the call was (fd, buffer or iovecs, which syscall) comes from the
 * user registers the syscall entered with (bpf_task_pt_regs): they hold
 * until it returns. Calls the registers do not describe (io_uring,
 * sendmmsg, a socket the kernel uses itself, 32-bit syscalls) are not
 * reported, as the syscall hooks never saw them either.
 *
 * What is lost against the syscall hooks: accept() is not hooked, so a
 * connection's accept is announced by the process's first send or
 * receive on it (dated then: at or after accept() returned); a socket
 * closed by a process exiting, or whose last reference another thread's
 * blocked call held, has no close record (the process exit, the peer's
 * FIN or a reused fd end it as before).
 */
#ifndef TOKENTRACE_SOCK_HOOKS_BPF_H
#define TOKENTRACE_SOCK_HOOKS_BPF_H

#define TT_TCP_LISTEN 10

/* Set by the agent before load: these programs are the data path, and
 * on_sock_state reports listen() and close() (the syscall hooks do not run). */
const volatile bool socket_hooks = false;

/* A traced thread's TCP send in flight, from its first tcp_sendmsg_locked
 * pass to sock_send_length (sk 0: none). Task-local storage: found through
 * the task (no hash of the thread id), created on a traced thread's first
 * send and freed with the thread. The agent does not create this map where
 * it loads the syscall hooks (kernels before 5.11 have no task storage). */
struct send_start {
	__u64 ts;
	__u64 sk;
	/* The kernel's copy of a writev's iovec array (the msghdr's iterator
	 * before its first byte was taken) and its length; 0: none. It lives
	 * on the syscall's stack (or heap) until the call returns, past
	 * sock_send_length, and reading it saves a user copy per send. */
	__u64 iov;
	__u64 nr_segs;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct send_start);
} send_starts SEC(".maps");

/* The syscall's user registers: they say what the current call is. */
static __always_inline struct pt_regs *syscall_regs(struct task_struct *task)
{
	return (struct pt_regs *)bpf_task_pt_regs(task);
}

/* A TCP socket over IPv4/IPv6, read from a tracepoint's trusted `sk`. */
static __always_inline bool inet_tcp(struct sock *sk)
{
	__u16 family = sk->__sk_common.skc_family;

	return (family == AF_INET || family == AF_INET6) && sk->sk_type == SOCK_STREAM &&
	       sk->sk_protocol == IPPROTO_TCP;
}

/* The data call the current syscall is, as the syscall hooks' entry would
 * have kept it (ts_enter aside); false when it is none of ours. */
static __always_inline bool io_args_of_syscall(struct io_args *a, bool egress)
{
	struct task_struct *task = bpf_get_current_task_btf();

	if (compat_syscall())
		return false;
	struct pt_regs *regs = syscall_regs(task);
	long nr = SYSCALL_NR(regs);

	a->fd = SYSCALL_ARG(regs, 0);
	a->buf = SYSCALL_ARG(regs, 1);
	a->iovcnt = 0;
	a->direction = egress ? TT_DIR_EGRESS : TT_DIR_INGRESS;
	if (egress) {
		switch (nr) {
		case TT_NR_WRITE:
			a->call = TT_IO_WRITE;
			return true;
		case TT_NR_SENDTO:
			a->call = TT_IO_SENDTO;
			return true;
		case TT_NR_WRITEV:
			a->call = TT_IO_WRITEV;
			a->iovcnt = SYSCALL_ARG(regs, 2);
			return true;
		case TT_NR_SENDFILE:
			a->call = TT_IO_SENDFILE;
			a->buf = 0;
			return true;
		case TT_NR_SENDMSG:
			a->call = TT_IO_SENDMSG;
			break;
		default:
			return false;
		}
	} else {
		switch (nr) {
		case TT_NR_READ:
			a->call = TT_IO_READ;
			return true;
		case TT_NR_RECVFROM:
			a->call = TT_IO_RECVFROM;
			return true;
		case TT_NR_READV:
			a->call = TT_IO_READV;
			a->iovcnt = SYSCALL_ARG(regs, 2);
			return true;
		case TT_NR_RECVMSG:
			a->call = TT_IO_RECVMSG;
			break;
		default:
			return false;
		}
	}
	/* sendmsg/recvmsg: the iovecs are behind the user's msghdr. */
	struct user_msghdr msg = {};
	if (bpf_probe_read_user(&msg, sizeof(msg), (void *)a->buf))
		return false;
	a->buf = (__u64)msg.msg_iov;
	a->iovcnt = msg.msg_iovlen ? msg.msg_iovlen : 1;
	return true;
}

/* io_done for a socket hook. Only a staged record (kernels before 6.16)
 * needs preemption off: it is built in the per-CPU scratch slot another
 * task could take over. A direct record is built in its own ring buffer
 * reservation, and these tracepoints are not faultable (the kernel calls
 * them with preemption disabled; where it may not, a preempting task's run
 * of the same program on the CPU is refused by the program's recursion
 * guard and counted as missed), so it skips the two kfunc calls: ~7 % of
 * on_send_length's own samples under the node flood. */
static __always_inline int hook_io_done(__u64 pid_tgid, const struct io_args *a, long ret, struct sock *sk)
{
	/* Known at load: the verifier walks one of the two ways. */
	bool staged = !data_direct();

	if (staged)
		no_preempt_begin();
	int rc = io_done(pid_tgid, a, ret, true, true, sk);
	if (staged)
		no_preempt_end();
	return rc;
}

/* A TCP send starts (and again per segment it fills, and after waiting for
 * room): the first pass of a traced thread's send keeps its start for
 * on_send_length. */
SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(on_sendmsg_locked, struct sock *sk, struct msghdr *msg, struct sk_buff *skb, int size_goal)
{
	struct task_struct *task = bpf_get_current_task_btf();

	if (!is_traced(task->tgid))
		return 0;
	struct send_start *start = bpf_task_storage_get(&send_starts, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);

	if (!start || start->sk == (__u64)sk)
		return 0; /* a later pass of the same send */
	start->ts = bpf_ktime_get_ns();
	start->sk = (__u64)sk;
	start->iov = 0;
	struct iov_iter *iter = &msg->msg_iter;
	if (iter->iter_type == bpf_core_enum_value(enum iter_type, ITER_IOVEC) && !iter->iov_offset) {
		start->iov = (__u64)iter->__iov;
		start->nr_segs = iter->nr_segs;
	}
	return 0;
}

/* A socket send returned `ret` (bytes queued, or -errno). */
SEC("tp_btf/sock_send_length")
int BPF_PROG(on_send_length, struct sock *sk, int ret, int flags)
{
	struct task_struct *task = bpf_get_current_task_btf();

	if (!is_traced(task->tgid))
		return 0;
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct io_args a = {};
	struct send_start *start = bpf_task_storage_get(&send_starts, task, 0, 0);

	__u64 kernel_iov = 0, kernel_nr_segs = 0;

	if (start) {
		if (start->sk == (__u64)sk) {
			a.ts_enter = start->ts;
			kernel_iov = start->iov;
			kernel_nr_segs = start->nr_segs;
		}
		start->sk = 0;
	}
	if (!inet_tcp(sk) || !io_args_of_syscall(&a, true))
		return 0;
	/* A writev whose iovecs the kernel still holds, all of them (none
	 * taken before the send's first pass): read them there. */
	if (kernel_iov && a.call == TT_IO_WRITEV && kernel_nr_segs == a.iovcnt && data_direct()) {
		a.buf = kernel_iov;
		a.kernel_iov = true;
	}
	/* No start: the send failed before its first byte, or the send-start
	 * hook is not loaded (dated at its return). */
	if (!a.ts_enter)
		a.ts_enter = bpf_ktime_get_ns();
	return hook_io_done(pid_tgid, &a, ret, sk);
}

/* A socket receive returned `ret` (bytes copied out, 0 at EOF, or -errno).
 * MSG_PEEK leaves the bytes queued for the next read: not data (see
 * enter_syscall). */
SEC("tp_btf/sock_recv_length")
int BPF_PROG(on_recv_length, struct sock *sk, int ret, int flags)
{
	if (!is_traced(bpf_get_current_task_btf()->tgid))
		return 0;
	if ((flags & TT_MSG_PEEK) || ret <= 0 || !inet_tcp(sk))
		return 0;
	struct io_args a = {};

	if (!io_args_of_syscall(&a, false))
		return 0;
	a.ts_enter = bpf_ktime_get_ns();
	return hook_io_done(bpf_get_current_pid_tgid(), &a, ret, sk);
}

/* A new mapping whose address the kernel picks (never MAP_FIXED): the
 * dynamic loader's first mapping of each library it loads. A traced
 * process mapping a file makes the agent re-read its mappings (Python
 * imports ssl lazily), as enter_mmap does for the syscall hooks. */
SEC("tp_btf/vm_unmapped_area")
int BPF_PROG(on_vm_unmapped_area, unsigned long addr, struct vm_unmapped_area_info *info)
{
	struct task_struct *task = bpf_get_current_task_btf();

	if (!is_traced(task->tgid) || compat_syscall())
		return 0;
	struct pt_regs *regs = syscall_regs(task);
	if (SYSCALL_NR(regs) != TT_NR_MMAP)
		return 0;
	/* The loader maps a library's whole span with its first segment's
	 * protection (read-only since binutils' separate-code), then its code
	 * over it with MAP_FIXED: any file counts, not only PROT_EXEC. */
	return (long)SYSCALL_ARG(regs, 4) >= 0 ? lib_mapped() : 0;
}

/* A traced process's close() of a connection it owns is its close record
 * (the fd is gone from its table by now: the socket's state says which fd
 * it was). Seen where the close moves the socket's state (FIN_WAIT1,
 * LAST_ACK, CLOSE: on_sock_state) or, for a socket the peer's RST already
 * closed, where it frees it (on_tcp_destroy). Softirq work that interrupts
 * a traced task's close() on another socket is told apart by ownership. */
static __always_inline void closed_by_owner(struct sock *sk, struct sock_state *st)
{
	struct task_struct *task = bpf_get_current_task_btf();
	__u32 tgid = task->tgid;

	if (st->tgid != tgid || !is_traced(tgid) || compat_syscall())
		return;
	struct pt_regs *regs = syscall_regs(task);
	__s32 fd = SYSCALL_ARG(regs, 0);
	if (SYSCALL_NR(regs) != TT_NR_CLOSE || st->fd != fd)
		return;
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct last_read *lr = last_read_of(&pid_tgid);
	if (lr)
		consume_read(lr, fd);
	send_conn(TT_EVENT_CLOSE, sk, st->sock_ino, fd, NULL);
	/* One record per close: the close walks through several states. */
	st->fd = -1;
}

/* inet_sock_set_state in the context of the task that caused it: listen()
 * marks (and reports) a listener; a close() may be a traced process's. */
static __always_inline void owner_state_change(struct sock *sk, int newstate)
{
	__u32 tgid = bpf_get_current_task_btf()->tgid;

	if (newstate == TT_TCP_LISTEN) {
		bool traced = is_traced(tgid);
		if (traced || (report_listens && tgid != agent_tgid))
			listening(sk, traced);
		return;
	}
	if (!is_traced(tgid))
		return;
	__u64 key = (__u64)sk;
	struct sock_state *st = bpf_map_lookup_elem(&sock_states, &key);
	if (st)
		closed_by_owner(sk, st);
}

#endif /* TOKENTRACE_SOCK_HOOKS_BPF_H */
