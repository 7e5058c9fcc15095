// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Socket probes: syscall tracepoints for accept/read/write/close on TCP
 * sockets of traced processes, plus listen/exec/fork/exit so the agent can
 * find servers that start after it.
 *
 * Cost control, in order: the pid filter (`traced_flags`, an array load)
 * runs first on every syscall; only calls that moved bytes on an IPv4/IPv6 TCP socket
 * produce a record (unix socketpairs used as event-loop wake-ups, pipes and
 * files are dropped in the kernel); payloads are bounded by `capture_bytes`;
 * ring buffer wake-ups are batched (`wakeup_bytes`) and the agent polls on a
 * short timeout instead.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "common.bpf.h"
#include "thread_state.bpf.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Set by the agent before load. */
const volatile __u32 capture_bytes = 8192;
/* Send-queue holds shorter than this are not reported (ACK clocking holds
 * bytes for microseconds all the time under load). */
const volatile __u64 hold_min_ns = 1000000;

/* What the agent selects processes by: only then do all execs / listens
 * on the host produce records. */
const volatile bool report_all_execs = false;
const volatile bool report_listens = false;

/* Data records skipped because the per-CPU staging slot was missing. */
__u64 scratch_misses = 0;
/* Forked children of traced processes that did not fit in traced_tgids. */
__u64 traced_full = 0;

/* Arguments of an in-flight syscall, from sys_enter to sys_exit. */
struct io_args {
	__u64 ts_enter;
	__u64 buf; /* flat buffer, or struct iovec * when iovcnt > 0 */
	__u32 iovcnt;
	__s32 fd;
	__u8 call;
	__u8 direction;
	/* `buf` is the kernel's copy of the iovec array (socket hooks: the
	 * send's msghdr), not the user's. */
	bool kernel_iov;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct io_args);
} active_io SEC(".maps");

/* An OpenSSL call in flight on a thread, from uprobe to uretprobe (ts_enter
 * 0: none). While it is there, socket syscalls of that thread are the
 * call's own ciphertext: they tie the SSL* to its fd and are not reported. */
struct ssl_call {
	__u64 ssl;
	__u64 buf;
	__u64 out_len; /* size_t * of the _ex variants, else 0 */
	__u64 ts_enter;
	/* ns from ts_enter to the entry of the first socket write made inside
	 * the call: when a socket-BIO SSL_write handed its records to the
	 * kernel (a thread preempted between encrypting and writing sends
	 * later than the call began; seen 0.7 ms under load). 0: none (a
	 * memory BIO's records leave with the event loop's own write, dated
	 * in userspace). 32 bits keep the entry programs' stack under 64
	 * bytes (no private stack, see common.bpf.h). */
	__u32 first_write_after;
	__u8 call;
	__u8 direction;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct ssl_call);
} ssl_calls SEC(".maps");

/* The same in task storage (thread_state.bpf.h). */
TASK_STORAGE_MAP(task_ssl_call, struct ssl_call);

/* The OpenSSL call in flight on the current thread, or NULL. */
static __always_inline struct ssl_call *ssl_call_of(const __u64 *pid_tgid)
{
	return thread_call_of(struct ssl_call, &task_ssl_call, &ssl_calls, NULL, pid_tgid);
}

/* One byte per tgid, the shape of `traced_flags` (sized with it by the
 * agent; the probes alone write it): 1 once a thread of the process entered
 * an OpenSSL call, before its first `ssl_calls` entry, 0 again when the
 * process exits. A traced send or read of a process that never made one
 * (no OpenSSL probes, or a plaintext server) skips the `ssl_calls` hash
 * lookup: ~60 ns per chunk under the node flood, a tenth of on_send_length's
 * samples going to hash lookups. A byte, not a bit, so that no two
 * processes share a read-modify-write; tgids past the array always look. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 32768 / 8);
	__type(key, __u32);
	__type(value, __u64);
} tls_tgids SEC(".maps");

/* The process may have an OpenSSL call in flight on some thread. */
static __always_inline bool may_be_in_ssl(__u32 tgid)
{
	__u8 *flag = tgid_byte(&tls_tgids, tgid);

	return !flag || *flag;
}

struct ssl_key {
	__u32 tgid;
	__u32 _pad;
	__u64 ssl;
};

/* SSL* -> the socket fd its BIO was seen using. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct ssl_key);
	__type(value, __s32);
} ssl_fds SEC(".maps");

/* The socket a thread last read from, and when the oldest byte of that
 * read reached the host. With a memory BIO (Python's asyncio SSL
 * transport) the socket read happens outside OpenSSL, just before the
 * SSL_read of the same connection on the same event-loop thread: the best
 * evidence of which socket an SSL* uses when no read nests in the call.
 * Either way (nested or not) the plaintext an SSL_read returns came in
 * with the thread's latest read of that socket, which dates it: by its
 * oldest byte, or by its newest when a handshake consumed the start of it
 * (a memory BIO fed the client's Finished and the first request together;
 * the request is the tail).
 *
 * The latest read is not always the SSL*'s own: an event loop can read
 * several sockets before it feeds their bytes to their SSL objects (a
 * loop that gathers a select() round first, or SSL_read from a callback
 * after another connection was read). So an untied SSL* is tied only to
 * the thread's one socket read that looks like TLS (a record header first)
 * and that no SSL call took yet (`pending`). With two or more untaken, or
 * after `pending` overflowed, it stays untied (no addresses, never wrong
 * ones) until a call that can be told apart; tied SSL*s take their own
 * socket's entry. A connection's first read, the ClientHello, always
 * starts with a record header. */
#define PENDING_READS 4

struct pending_read {
	__s32 fd;
	/* A handshake took the start of it (its SSL* is tied by then): an
	 * SSL_read of the rest is dated by its newest byte, see above. */
	__u32 handshake_taken;
	__u64 ingress_ns;
	__u64 newest_ns;
};

struct last_read {
	__s32 fd;
	/* SSL_do_handshake completed on this read's bytes. */
	__u32 after_handshake;
	__u64 ingress_ns;
	__u64 newest_ns;
	/* Reads of `pending` lost because it was full: no "exactly one". */
	__u32 overflow;
	/* `pending` is set up (0: a new, zeroed entry whose fds read 0). */
	__u32 slots_ready;
	/* Socket reads not yet taken by an SSL_read since (fd -1: free slot),
	 * with when their oldest and newest bytes arrived: an SSL_read from a
	 * callback is dated by its own socket's read, not the latest. */
	struct pending_read pending[PENDING_READS];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct last_read);
} last_read SEC(".maps");

/* The same in task storage (thread_state.bpf.h). */
TASK_STORAGE_MAP(task_last_read, struct last_read);

_Static_assert(sizeof(struct last_read) <= THREAD_STATE_MAX_BYTES, "thread_state_zeros too small");

/* The current thread's latest read, or NULL. */
static __always_inline struct last_read *last_read_of(const __u64 *pid_tgid)
{
	return thread_state(&task_last_read, &last_read, NULL, pid_tgid, false);
}

/* Per-CPU staging area for one data record: the fixed fields, then the
 * payload. Copies are bounded for the verifier with masks (clang reorders
 * plain comparisons away from the helper call): offsets by MAX_CAPTURE - 1
 * and sizes by 2 * MAX_CAPTURE - 1, hence three MAX_CAPTURE of room. The
 * masks never change a value: the logic already keeps offset + size within
 * capture_bytes <= MAX_CAPTURE. Indexed by CPU id; resized to the number of
 * CPUs by the agent. */
#define OFF_MASK (MAX_CAPTURE - 1)
#define LEN_MASK (2 * MAX_CAPTURE - 1)

/* `v & mask` in a form clang cannot drop when it can prove the mask is a
 * no-op: the verifier cannot prove it and needs to see the AND. */
static __always_inline __u64 verifier_mask(__u64 v, const __u64 mask)
{
	asm volatile("%[v] &= %[m]" : [v] "+r"(v) : [m] "i"(mask));
	return v;
}
struct data_scratch {
	struct tt_data_event ev;
	__u8 payload[3 * MAX_CAPTURE];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct data_scratch);
} scratch SEC(".maps");

#include "sock_state.bpf.h"
#include "data_record.bpf.h"
#include "ingress_marks.bpf.h"

/* Keep the record types in BTF so libbpf-cargo generates Rust types. */
struct tt_data_event _data_event = {};
struct tt_conn_event _conn_event = {};
struct tt_listen_event _listen_event = {};
struct tt_proc_event _proc_event = {};
struct tt_nagle_event _nagle_event = {};
enum tt_event_kind _event_kind = 0;
enum tt_direction _direction = 0;
enum tt_io_call _io_call = 0;
enum tt_peer_close _peer_close = 0;

/* ---- data path ---------------------------------------------------------- */

/* Whether a read's bytes start like a TLS record (content type 20-23,
 * version major 3): only those can be an SSL* 's ciphertext. A read that
 * starts inside a record (the previous one ended mid-record) is missed:
 * no tie from it, never a wrong one. */
static __always_inline bool tls_like(const struct io_args *a)
{
	__u8 head[2] = {};
	__u64 src = a->buf;

	if (a->iovcnt) {
		struct iovec v = {};
		if (bpf_probe_read_user(&v, sizeof(v), (void *)a->buf))
			return false;
		src = (__u64)v.iov_base;
	}
	if (bpf_probe_read_user(head, sizeof(head), (void *)src))
		return false;
	return head[0] >= 20 && head[0] <= 23 && head[1] == 3;
}

/* A socket read by a traced thread: the thread's latest; if it looks like
 * TLS, one an SSL_read may take (pending). A read of a socket already
 * pending keeps the older entry (its oldest byte is the one to date by)
 * unless a handshake took that one. */
static __always_inline void note_read(__u64 pid_tgid, __s32 fd, __u64 ingress, __u64 newest, bool tls)
{
	struct last_read *lr = thread_state(&task_last_read, &last_read, NULL, &pid_tgid, true);

	if (!lr)
		return;
	if (!lr->slots_ready) {
		/* A new entry (zeroed): no pending reads. */
		for (int i = 0; i < PENDING_READS; i++)
			lr->pending[i].fd = -1;
		lr->slots_ready = 1;
	}
	lr->fd = fd;
	lr->after_handshake = 0;
	lr->ingress_ns = ingress;
	lr->newest_ns = newest;
	if (tls) {
		int idx = -1, free = -1, spare = -1;
		for (int i = 0; i < PENDING_READS; i++) {
			if (lr->pending[i].fd == fd)
				idx = i;
			else if (lr->pending[i].fd < 0 && free < 0)
				free = i;
			else if (lr->pending[i].handshake_taken && spare < 0)
				spare = i;
		}
		/* A handshake's leftover (tied already, kept only to date what
		 * follows the handshake) gives way before a read is lost. */
		if (free < 0)
			free = spare;
		struct pending_read p = { .fd = fd, .ingress_ns = ingress, .newest_ns = newest };
		if (idx >= 0) {
			if (lr->pending[idx & (PENDING_READS - 1)].handshake_taken)
				lr->pending[idx & (PENDING_READS - 1)] = p;
		} else if (free >= 0) {
			lr->pending[free & (PENDING_READS - 1)] = p;
		} else {
			lr->overflow = 1;
		}
	}
}

/* The pending read of `fd`, or NULL. */
static __always_inline struct pending_read *pending_of(struct last_read *lr, __s32 fd)
{
	for (int i = 0; i < PENDING_READS; i++) {
		if (lr->pending[i].fd == fd)
			return &lr->pending[i];
	}
	return NULL;
}

/* What was read from `fd` is taken (or will never be: closed). */
static __always_inline void consume_read(struct last_read *lr, __s32 fd)
{
	int left = 0;

	for (int i = 0; i < PENDING_READS; i++) {
		if (lr->pending[i].fd == fd)
			lr->pending[i].fd = -1;
		else if (lr->pending[i].fd >= 0)
			left++;
	}
	if (!left)
		lr->overflow = 0;
}

/* The only pending read of the thread whose SSL* is not known yet (not
 * taken by a handshake), or -1. */
static __always_inline __s32 only_pending(struct last_read *lr)
{
	__s32 fd = -1;
	int n = 0;

	for (int i = 0; i < PENDING_READS; i++) {
		if (lr->pending[i].fd >= 0 && !lr->pending[i].handshake_taken) {
			fd = lr->pending[i].fd;
			n++;
		}
	}
	return n == 1 && !lr->overflow ? fd : -1;
}

/* The entry of a data syscall of a traced thread: its arguments, for the exit. */
static __always_inline int enter_io(__u64 pid_tgid, int fd, __u64 buf, __u32 iovcnt, __u8 call, __u8 direction)
{
	struct io_args args = {
		.ts_enter = bpf_ktime_get_ns(),
		.buf = buf,
		.iovcnt = iovcnt,
		.fd = fd,
		.call = call,
		.direction = direction,
	};
	bpf_map_update_elem(&active_io, &pid_tgid, &args, BPF_ANY);
	return 0;
}

static __always_inline int enter_msg(__u64 pid_tgid, int fd, __u64 msghdr, __u8 call, __u8 direction)
{
	struct user_msghdr msg = {};

	if (bpf_probe_read_user(&msg, sizeof(msg), (void *)msghdr))
		return 0;
	return enter_io(pid_tgid, fd, (__u64)msg.msg_iov, msg.msg_iovlen ? msg.msg_iovlen : 1, call, direction);
}

/* A connection record of the current process for `sk` (its `fd`, inode
 * `ino`); an accept's carries when the handshake completed (`st`). */
static __always_inline void send_conn(__u32 kind, struct sock *sk, __u64 ino, int fd, struct sock_state *st)
{
	struct tt_conn_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return;
	}
	fill_header(&e->hdr, kind);
	e->sock_ino = ino;
	e->fd = fd;
	e->reason = 0;
	e->start_ns = st ? st->established_ns : 0;
	fill_addrs(sk, &e->addrs);
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
	/* The client left while the connection waited to be accepted: said
	 * after the accept (timed now), so the connection exists for it. */
	if (kind == TT_EVENT_ACCEPT && st && st->pending_close) {
		__u32 reason = st->pending_close;
		st->pending_close = 0;
		peer_closed(st, sk, reason);
	}
}

/* A data call of a traced thread returned `ret`: its record (or, inside an
 * OpenSSL call, the SSL*'s tie to the socket). `a` comes from the syscall
 * entry (syscall hooks) or from the user registers at the socket hook
 * (socket hooks, see sock_hooks.bpf.h), which also hands over the call's
 * TCP socket (`hooked_sk`; NULL: look it up by the fd). With the socket
 * hooks no accept() hook runs, so the first call of a process on a
 * connection it accepted announces the accept. */
static __always_inline int io_done(__u64 pid_tgid, const struct io_args *a, long ret, const bool vec, const bool loop,
				   struct sock *hooked_sk)
{
	__u64 ino = hooked_sk ? sock_file_ino(hooked_sk) : 0;

	if (ret <= 0) {
		/* A write the peer refused: it is gone (reset, or closed and reset
		 * by now). The socket's own hooks usually told already; this also
		 * covers sockets whose RST came before they were tracked. */
		if (a->direction == TT_DIR_EGRESS && (ret == -TT_EPIPE || ret == -TT_ECONNRESET)) {
			struct sock *sk = hooked_sk ? hooked_sk : tcp_sock_of_fd(a->fd, &ino);
			struct sock_state *st = sk ? own_sock(sk, ino, a->fd) : NULL;
			if (st)
				peer_closed(st, sk, ret == -TT_EPIPE ? TT_PEER_WRITE_EPIPE : TT_PEER_WRITE_ECONNRESET);
		}
		return 0;
	}
	struct sock *sk = hooked_sk ? hooked_sk : tcp_sock_of_fd(a->fd, &ino);
	if (!sk)
		return 0;
	bool unowned = false;
	struct sock_state *st = own_sock_of(sk, ino, a->fd, &unowned);
	/* Socket hooks (no accept() hook): the first call of a traced process
	 * on a connection that came in through a traced listener (state since
	 * the handshake, no owner yet) stands for its accept, reported before
	 * the call's own record and dated now: at or after accept() returned. */
	if (hooked_sk && unowned && st && st->established_ns)
		send_conn(TT_EVENT_ACCEPT, sk, ino, a->fd, st);
	__u64 ingress = 0, newest = 0;
	if (a->direction == TT_DIR_INGRESS) {
		if (st)
			ingress = read_ingress(sk, st, ret, &newest);
		note_read(pid_tgid, a->fd, ingress, newest, tls_like(a));
		if (st)
			tls_walk_read(sk, st, a->buf, a->iovcnt, ret);
	}

	struct ssl_call *in_ssl = may_be_in_ssl(pid_tgid >> 32) ? ssl_call_of(&pid_tgid) : NULL;
	if (in_ssl) {
		/* Ciphertext of an OpenSSL call on this thread: remember which
		 * socket the SSL* uses; the plaintext is reported by the uprobe. */
		if (a->direction == TT_DIR_EGRESS && !in_ssl->first_write_after && a->ts_enter > in_ssl->ts_enter) {
			__u64 after = a->ts_enter - in_ssl->ts_enter;
			in_ssl->first_write_after = after > 0xffffffff ? 0xffffffff : after;
		}
		struct ssl_key key = { .tgid = pid_tgid >> 32, .ssl = in_ssl->ssl };
		bpf_map_update_elem(&ssl_fds, &key, &a->fd, BPF_ANY);
		return 0;
	}

	/* sendfile's bytes come from a file, not a user buffer. */
	__u32 limit = capture_bytes < (__u32)ret ? capture_bytes : (__u32)ret;
	if (a->call == TT_IO_SENDFILE)
		limit = 0;
	struct data_out out;
	struct tt_data_event *e = data_begin(&out, limit);
	if (!e)
		return 0;
	fill_header(&e->hdr, TT_EVENT_DATA);
	e->ts_enter_ns = a->ts_enter;
	e->sock_ino = ino;
	e->fd = a->fd;
	e->len = ret;
	e->direction = a->direction;
	e->call = a->call;
	e->tcp_nodelay = 0;
	e->unsent_bytes = 0;
	e->ingress_ns = ingress;
	e->nmarks = 0;
	if (a->direction == TT_DIR_EGRESS)
		note_unsent(st, sk, a->ts_enter, e);
	else
		fill_ingress_marks(sk, st, ret, e);
	fill_addrs(sk, &e->addrs);
	/* Only readv/writev/recvmsg/sendmsg take iovecs (`vec`): the other
	 * programs carry no iovec walk for the verifier to check. */
	if (vec && a->iovcnt)
		return data_iov(&out, e, a->buf, a->iovcnt, limit, loop, a->kernel_iov);
	return data_flat(&out, e, a->buf, limit);
}

/* The exit of a data syscall whose entry was kept in `active_io`. */
static __always_inline int exit_io(long ret, const bool vec, const bool loop)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct io_args *args = bpf_map_lookup_elem(&active_io, &pid_tgid);

	if (!args)
		return 0;
	struct io_args a = *args;
	bpf_map_delete_elem(&active_io, &pid_tgid);
	return io_done(pid_tgid, &a, ret, vec, loop, NULL);
}

/* ---- connection lifecycle ------------------------------------------------ */

static __always_inline int emit_conn(__u32 kind, int fd)
{
	__u64 ino = 0;
	struct sock *sk = tcp_sock_of_fd(fd, &ino);
	if (!sk)
		return 0;
	struct sock_state *st = NULL;
	if (kind == TT_EVENT_ACCEPT) {
		/* Its listener is a traced one from now on (one lookup when it
		 * already is), and the connection is ours. */
		mark_listener(sk);
		st = own_sock(sk, ino, fd);
	}
	send_conn(kind, sk, ino, fd, st);
	return 0;
}

/* accept returns the new connection's fd. Only the exit is probed: a
 * server is usually blocked in accept() when tracing starts, and the
 * connection that call returns must not be missed. */
static __always_inline int exit_accept(long ret)
{
	if (ret < 0)
		return 0;
	return emit_conn(TT_EVENT_ACCEPT, ret);
}

static __always_inline int enter_close(__u64 pid_tgid, int fd)
{
	/* A read nobody will consume: it must not keep "exactly one" away. */
	struct last_read *lr = last_read_of(&pid_tgid);
	if (lr)
		consume_read(lr, fd);
	return emit_conn(TT_EVENT_CLOSE, fd);
}

/* listen() is rare; it is watched in every process only when the agent
 * selects by port or automatically (`report_listens`), so servers started
 * after it are found. Read at entry: the port is bound by then (a listen
 * that autobinds reports port 0, a failing one is reported anyway; both
 * only make the agent look at a process). A traced process's listener is
 * marked for ingress timing either way (one lookup more per listen()). */
static __always_inline int listening(struct sock *sk, bool traced)
{
	if (traced)
		mark_listener(sk);
	if (!report_listens)
		return 0;
	struct tt_listen_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	fill_header(&e->hdr, TT_EVENT_LISTEN);
	e->port = BPF_CORE_READ(sk, __sk_common.skc_num);
	e->family = BPF_CORE_READ(sk, __sk_common.skc_family);
	e->_pad = 0;
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
	return 0;
}

static __always_inline int enter_listen(int fd, bool traced)
{
	__u64 ino = 0;
	struct sock *sk = tcp_sock_of_fd(fd, &ino);

	return sk ? listening(sk, traced) : 0;
}

/* ---- process lifecycle --------------------------------------------------- */

/* Execs are reported for traced processes (their mappings change), and
 * for every process only when the agent selects by executable or name
 * (`report_all_execs`): otherwise an untraced exec costs one lookup. */
SEC("tracepoint/sched/sched_process_exec")
int on_exec(struct trace_event_raw_sched_process_exec *ctx)
{
	if (!report_all_execs && !is_traced(bpf_get_current_pid_tgid() >> 32))
		return 0;
	struct tt_proc_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	unsigned int filename_off = ctx->__data_loc_filename & 0xFFFF;

	fill_header(&e->hdr, TT_EVENT_EXEC);
	e->ppid = BPF_CORE_READ(task, real_parent, tgid);
	e->exit_code = 0;
	bpf_probe_read_kernel_str(e->filename, sizeof(e->filename), (void *)ctx + filename_off);
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
	return 0;
}

/* A child process of a traced process is traced from its first instruction
 * (uvicorn/gunicorn workers are forked after the parent listened). Its
 * uprobes are not: a fork copies the parent's breakpoints but not the
 * probes, so the agent is told and attaches them for the child. */
SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork, struct task_struct *parent, struct task_struct *child)
{
	__u32 parent_tgid = parent->tgid;
	__u32 child_tgid = child->tgid;

	if (child_tgid == parent_tgid || child->pid != child_tgid)
		return 0; /* a new thread, already covered by its tgid */
	if (!is_traced(parent_tgid))
		return 0;
	if (set_traced(child_tgid, 1))
		__sync_fetch_and_add(&traced_full, 1);
	struct tt_proc_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	fill_header(&e->hdr, TT_EVENT_FORK);
	e->hdr.tgid = child_tgid;
	e->hdr.tid = child_tgid;
	e->ppid = parent_tgid;
	e->exit_code = 0;
	e->filename[0] = 0;
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
	return 0;
}

SEC("tracepoint/sched/sched_process_exit")
int on_exit(struct trace_event_raw_sched_process_template *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;

	if ((__u32)pid_tgid != tgid || !is_traced(tgid))
		return 0; /* only the group leader of a traced process */
	set_traced(tgid, 0);
	__u8 *tls = tgid_byte(&tls_tgids, tgid);
	if (tls)
		*tls = 0;
	struct tt_proc_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	fill_header(&e->hdr, TT_EVENT_EXIT);
	e->ppid = BPF_CORE_READ(task, real_parent, tgid);
	e->exit_code = BPF_CORE_READ(task, exit_code);
	e->filename[0] = 0;
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
	return 0;
}

/* ---- OpenSSL uprobes ----------------------------------------------------
 * Attached by the agent per traced process (so untraced processes mapping
 * the same libssl take no breakpoint), on the exported functions or on the
 * internal helpers they share (OpenSSL 1.1/3.0 `ssl_read_internal` and
 * `ssl_write_internal`, which take the `_ex` arguments and start with an
 * emulated push). The pid filter still runs first: the opt-in global mode
 * attaches them for every process. */

static __always_inline int ssl_enter(struct pt_regs *ctx, __u8 call, __u8 direction, bool ex)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!is_traced(pid_tgid >> 32))
		return 0;
	__u8 *tls = tgid_byte(&tls_tgids, pid_tgid >> 32);
	if (tls && !*tls)
		*tls = 1;
	struct ssl_call c = {
		.ssl = PT_REGS_PARM1(ctx),
		.buf = PT_REGS_PARM2(ctx),
		.out_len = ex ? PT_REGS_PARM4(ctx) : 0,
		.ts_enter = bpf_ktime_get_ns(),
		.call = call,
		.direction = direction,
	};
	thread_state_put(&task_ssl_call, &ssl_calls, NULL, &pid_tgid, &c);
	return 0;
}

SEC("uprobe")
int BPF_UPROBE(ssl_read_enter)
{
	return ssl_enter(ctx, TT_IO_SSL_READ, TT_DIR_INGRESS, false);
}

SEC("uprobe")
int BPF_UPROBE(ssl_write_enter)
{
	return ssl_enter(ctx, TT_IO_SSL_WRITE, TT_DIR_EGRESS, false);
}

SEC("uprobe")
int BPF_UPROBE(ssl_read_ex_enter)
{
	return ssl_enter(ctx, TT_IO_SSL_READ_EX, TT_DIR_INGRESS, true);
}

SEC("uprobe")
int BPF_UPROBE(ssl_write_ex_enter)
{
	return ssl_enter(ctx, TT_IO_SSL_WRITE_EX, TT_DIR_EGRESS, true);
}

/* The handshake's socket I/O ties the SSL* to its fd before any data. */
SEC("uprobe")
int BPF_UPROBE(ssl_handshake_enter)
{
	return ssl_enter(ctx, TT_IO_SSL_HANDSHAKE, TT_DIR_INGRESS, false);
}

/* The handshake as the TLS walk saw it on the wire: from the ClientHello's
 * arrival to the client's Finished's, reported once per connection (by
 * SSL_do_handshake's success or the SSL*'s first read, whichever comes
 * first: servers drive handshakes through either). */
static __always_inline int walk_handshake(__u64 ssl, __s32 fd, struct sock *sk, struct tt_tls_walk *w)
{
	if (w->reported)
		return 0;
	w->reported = 1;
	struct tt_conn_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	fill_header(&e->hdr, TT_EVENT_TLS_HANDSHAKE);
	e->hdr.ts_ns = w->finished_ns;
	e->sock_ino = ssl;
	e->fd = fd;
	e->reason = 0;
	e->start_ns = w->hello_ns;
	fill_addrs(sk, &e->addrs);
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
	return 0;
}

/* SSL_do_handshake succeeded: the handshake ran from the arrival of the
 * connection's first byte (the ClientHello) to now, unless the TLS walk
 * saw the client's Finished (walk_handshake). */
static __always_inline int handshake_done(__u64 ssl, __u64 pid_tgid, struct last_read *lr, __s32 tie)
{
	struct ssl_key key = { .tgid = pid_tgid >> 32, .ssl = ssl };
	__s32 *fdp = bpf_map_lookup_elem(&ssl_fds, &key);
	__s32 fd = -1;
	__u64 start = 0, ino = 0;

	if (!fdp && tie >= 0)
		fdp = &tie;
	if (lr && fdp && lr->fd == *fdp)
		lr->after_handshake = 1;
	struct sock *sk = fdp ? tcp_sock_of_fd(*fdp, &ino) : NULL;
	if (sk) {
		__u64 skey = (__u64)sk;
		struct sock_state *st = bpf_map_lookup_elem(&sock_states, &skey);
		fd = *fdp;
		struct tt_tls_walk *w = bpf_map_lookup_elem(&tls_walks, &skey);
		if (w && !w->lost && w->finished && w->hello_ns)
			return walk_handshake(ssl, fd, sk, w);
		if (st)
			start = st->first_ingress_ns ? st->first_ingress_ns : st->established_ns;
	}
	struct tt_conn_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	fill_header(&e->hdr, TT_EVENT_TLS_HANDSHAKE);
	e->sock_ino = ssl;
	e->fd = fd;
	e->reason = 0;
	e->start_ns = start;
	if (sk)
		fill_addrs(sk, &e->addrs);
	else
		__builtin_memset(&e->addrs, 0, sizeof(e->addrs));
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
	return 0;
}

static __always_inline int ssl_return(long ret)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct ssl_call *cp = ssl_call_of(&pid_tgid);
	__u64 len = 0;

	if (!cp)
		return 0;
	struct ssl_call c = *cp;
	/* Every probed call returns an int: only eax is defined. -1 (SSL_read
	 * or SSL_write wanting I/O on a non-blocking socket, as nginx's do)
	 * comes back as rax = 0xffffffff, which as a long is a 4 GiB read. */
	int rc = (int)ret;
	thread_call_end(&ssl_calls, &pid_tgid, cp);
	struct ssl_key key = { .tgid = pid_tgid >> 32, .ssl = c.ssl };
	__s32 *fd = bpf_map_lookup_elem(&ssl_fds, &key);
	/* Reads and handshakes take the thread's socket reads: which fd an
	 * untied SSL* uses (see struct last_read), and when its bytes came. */
	struct last_read *lr = c.direction == TT_DIR_INGRESS ? last_read_of(&pid_tgid) : NULL;
	__s32 tie = -1;
	struct pending_read taken = { .fd = -1 };
	if (lr) {
		tie = fd ? *fd : only_pending(lr);
		struct pending_read *p = tie >= 0 ? pending_of(lr, tie) : NULL;
		if (p)
			taken = *p;
	}
	/* Whatever the call returned, the tie is unambiguous: keep it. */
	if (!fd && tie >= 0) {
		bpf_map_update_elem(&ssl_fds, &key, &tie, BPF_ANY);
		fd = &tie;
	}
	if (c.call == TT_IO_SSL_HANDSHAKE) {
		/* The handshake took the start of its socket's read; what is left
		 * of it (a request sent with the client's Finished) is dated by
		 * its newest byte when SSL_read takes it. */
		struct pending_read *p = lr && tie >= 0 ? pending_of(lr, tie) : NULL;
		if (p)
			p->handshake_taken = 1;
		return rc == 1 ? handshake_done(c.ssl, pid_tgid, lr, tie) : 0;
	}
	/* The handshake as the TLS walk saw it goes first, once the client's
	 * Finished came: before this call's data record is reserved (the ring
	 * buffer hands records over in reservation order, and a connection
	 * that has data already takes no handshake), and whatever the call
	 * returns (Node's SSL_read that took the Finished wants more). */
	struct sock *sk = NULL;
	struct tt_tls_walk *w = NULL;
	if (fd) {
		__u64 ino = 0;
		sk = tcp_sock_of_fd(*fd, &ino);
		__u64 skey = (__u64)sk;
		w = sk ? bpf_map_lookup_elem(&tls_walks, &skey) : NULL;
		if (w && !w->lost && w->finished && w->hello_ns)
			walk_handshake(c.ssl, *fd, sk, w);
	}
	/* An SSL_read that wants more took what its socket's read brought
	 * (a memory BIO is drained before WANT_READ): that read is no longer
	 * pending. Left there, it made every later connection's read one of
	 * two and their SSL*s stayed untied (Node drives its handshakes with
	 * SSL_read; issue 27). */
	if (rc <= 0 && lr && fd)
		consume_read(lr, *fd);
	if (c.out_len) {
		/* _ex, and the internal helpers with their arguments: > 0 on
		 * success (the helpers may return other positive values), the
		 * byte count in *out_len. */
		if (rc <= 0 || bpf_probe_read_user(&len, sizeof(len), (void *)c.out_len))
			return 0;
	} else {
		if (rc <= 0)
			return 0;
		len = rc;
	}
	if (len == 0)
		return 0;

	__u32 moved = len > 0xffffffff ? 0xffffffff : len;
	__u32 limit = capture_bytes < moved ? capture_bytes : moved;
	struct data_out out;
	struct tt_data_event *e = data_begin(&out, limit);
	if (!e)
		return 0;
	fill_header(&e->hdr, TT_EVENT_DATA);
	/* A write's plaintext was handed over when its first record was. */
	e->ts_enter_ns = c.ts_enter + (c.direction == TT_DIR_EGRESS ? c.first_write_after : 0);
	e->sock_ino = c.ssl;
	e->fd = -1;
	e->len = moved;
	e->direction = c.direction;
	e->call = c.call;
	e->tcp_nodelay = 0;
	e->unsent_bytes = 0;
	e->ingress_ns = 0;
	__builtin_memset(&e->addrs, 0, sizeof(e->addrs));
	/* Dated by its own socket's untaken read (not the thread's latest:
	 * that may be another connection's); a TLS record that did not start
	 * that read (OpenSSL reading a record's body after its header) falls
	 * back to the latest read when it is the same socket's. */
	if (taken.fd >= 0) {
		e->ingress_ns = taken.handshake_taken ? taken.newest_ns : taken.ingress_ns;
	} else if (lr && fd && lr->fd == *fd) {
		e->ingress_ns = lr->after_handshake ? lr->newest_ns : lr->ingress_ns;
	}
	if (lr && fd) {
		lr->after_handshake = 0;
		consume_read(lr, *fd);
	}
	e->nmarks = 0;
	if (sk)
		fill_addrs(sk, &e->addrs);
	/* The plaintext's own record dates it (see ingress_marks.bpf.h). */
	if (w && !w->lost && w->finished && c.direction == TT_DIR_INGRESS) {
		__u64 ts = tls_take(w, e->len);
		if (ts) {
			e->ingress_ns = ts;
			set_ssl_mark(e, ts);
		}
	}

	return data_flat(&out, e, c.buf, limit);
}

/* One return probe for every SSL call above. Not preemptible: it stages
 * its record in the per-CPU scratch slot, and its stack is deeper than the
 * private-stack threshold. */
SEC("uretprobe")
int BPF_URETPROBE(ssl_exit, long ret)
{
	no_preempt_begin();
	int rc = ssl_return(ret);
	no_preempt_end();
	return rc;
}

/* The SSL* is gone: its connection is over (and the address may be
 * reused by the next SSL_new). */
SEC("uprobe")
int BPF_UPROBE(ssl_free_enter)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!is_traced(pid_tgid >> 32))
		return 0;
	struct ssl_key key = { .tgid = pid_tgid >> 32, .ssl = PT_REGS_PARM1(ctx) };
	bpf_map_delete_elem(&ssl_fds, &key);
	struct tt_conn_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	fill_header(&e->hdr, TT_EVENT_CLOSE);
	e->sock_ino = key.ssl;
	e->fd = -1;
	e->reason = 0;
	e->start_ns = 0;
	__builtin_memset(&e->addrs, 0, sizeof(e->addrs));
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
	return 0;
}

/* ---- library loads --------------------------------------------------------
 * A traced process mapping a file executable is loading a library (Python
 * imports ssl lazily): the agent re-reads its maps and attaches to a new
 * libssl before the first handshake. */
#define PROT_EXEC 0x4

static __always_inline int lib_mapped(void)
{
	struct tt_proc_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return 0;
	}
	fill_header(&e->hdr, TT_EVENT_LIB_MAPPED);
	e->ppid = 0;
	e->exit_code = 0;
	e->filename[0] = 0;
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
	return 0;
}

static __always_inline int enter_mmap(__u64 prot, long fd)
{
	return (prot & PROT_EXEC) && fd >= 0 ? lib_mapped() : 0;
}

/* ---- syscall dispatch ------------------------------------------------------
 * Two BTF tracepoints on the raw syscall hooks (sys_enter, sys_exit) see
 * every syscall of every process, instead of one perf-event tracepoint per
 * syscall (`syscalls:sys_enter_write`, ...). Both kinds put every task on
 * the syscall slow path; on top of that a perf-event syscall tracepoint
 * builds a perf record of the arguments before the program runs (~140 ns
 * per hit here with a program that only compares the pid), a raw one calls
 * the program with the registers (a few ns). So an untraced process's
 * socket and pipe I/O costs one array load per hook instead of a perf
 * record, and its other syscalls (futex, epoll_wait) one array load where
 * they cost nothing before: `cargo xtask bench --only kernel` measures
 * both. The pid filter comes first; the syscall number only after it. */
#include "syscall_nr.bpf.h"

/* MSG_PEEK (uapi linux/socket.h; macros are not in vmlinux.h): the bytes
 * stay queued and the next read returns them again, so a peek is not data
 * (nginx peeks 1 byte of every connection on an `ssl` listener). */
#define TT_MSG_PEEK 0x2

SEC("tp_btf/sys_enter")
int BPF_PROG(enter_syscall, struct pt_regs *regs, long id)
{
	/* The tgid from the task: the JIT inlines bpf_get_current_task_btf (a
	 * per-CPU load), bpf_get_current_pid_tgid is a call. */
	__u32 tgid = bpf_get_current_task_btf()->tgid;

	if (!is_traced(tgid)) {
		if (id == TT_NR_LISTEN && report_listens && tgid != agent_tgid && !compat_syscall())
			return enter_listen(SYSCALL_ARG(regs, 0), false);
		return 0;
	}
	if (compat_syscall())
		return 0;
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	switch (id) {
	case TT_NR_READ:
		return enter_io(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), 0, TT_IO_READ, TT_DIR_INGRESS);
	case TT_NR_READV:
		return enter_io(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), SYSCALL_ARG(regs, 2),
				TT_IO_READV, TT_DIR_INGRESS);
	case TT_NR_RECVFROM:
		if (SYSCALL_ARG(regs, 3) & TT_MSG_PEEK)
			return 0;
		return enter_io(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), 0, TT_IO_RECVFROM,
				TT_DIR_INGRESS);
	case TT_NR_RECVMSG:
		if (SYSCALL_ARG(regs, 2) & TT_MSG_PEEK)
			return 0;
		return enter_msg(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), TT_IO_RECVMSG, TT_DIR_INGRESS);
	case TT_NR_WRITE:
		return enter_io(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), 0, TT_IO_WRITE, TT_DIR_EGRESS);
	case TT_NR_WRITEV:
		return enter_io(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), SYSCALL_ARG(regs, 2),
				TT_IO_WRITEV, TT_DIR_EGRESS);
	case TT_NR_SENDTO:
		return enter_io(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), 0, TT_IO_SENDTO, TT_DIR_EGRESS);
	case TT_NR_SENDMSG:
		return enter_msg(pid_tgid, SYSCALL_ARG(regs, 0), SYSCALL_ARG(regs, 1), TT_IO_SENDMSG, TT_DIR_EGRESS);
	case TT_NR_SENDFILE:
		return enter_io(pid_tgid, SYSCALL_ARG(regs, 0), 0, 0, TT_IO_SENDFILE, TT_DIR_EGRESS);
	case TT_NR_CLOSE:
		return enter_close(pid_tgid, SYSCALL_ARG(regs, 0));
	case TT_NR_LISTEN:
		return enter_listen(SYSCALL_ARG(regs, 0), true);
	case TT_NR_MMAP:
		return enter_mmap(SYSCALL_ARG(regs, 2), SYSCALL_ARG(regs, 4));
	}
	return 0;
}

/* The exits that report: accept's new connection (only the exit is
 * probed: a server is usually blocked in accept() when tracing starts, and
 * the connection that call returns must not be missed) and the data calls
 * whose entry was kept in `active_io`. exit_io may stage its record in the
 * per-CPU scratch slot that ssl_exit uses too (older kernels, see
 * data_record.bpf.h): neither may be preempted while it does (see
 * no_preempt_begin). Twice: with the bpf_loop iovec walk (loaded where the
 * kernel has bpf_loop) and `_compat` without it (older kernels: the agent
 * loads one of the two, see probes/sock.rs). */
static __always_inline int exit_syscall_(struct pt_regs *regs, long ret, const bool loop)
{
	if (!is_traced(bpf_get_current_task_btf()->tgid) || compat_syscall())
		return 0;
	switch (SYSCALL_NR(regs)) {
	case TT_NR_ACCEPT:
	case TT_NR_ACCEPT4:
		return exit_accept(ret);
	case TT_NR_READ:
	case TT_NR_READV:
	case TT_NR_RECVFROM:
	case TT_NR_RECVMSG:
	case TT_NR_WRITE:
	case TT_NR_WRITEV:
	case TT_NR_SENDTO:
	case TT_NR_SENDMSG:
	case TT_NR_SENDFILE: {
		no_preempt_begin();
		int rc = exit_io(ret, true, loop);
		no_preempt_end();
		return rc;
	}
	}
	return 0;
}

SEC("tp_btf/sys_exit")
int BPF_PROG(exit_syscall, struct pt_regs *regs, long ret)
{
	return exit_syscall_(regs, ret, true);
}

SEC("tp_btf/sys_exit")
int BPF_PROG(exit_syscall_compat, struct pt_regs *regs, long ret)
{
	return exit_syscall_(regs, ret, false);
}

#include "sock_hooks.bpf.h"

/* ---- softirq hooks on traced sockets (see sock_state.bpf.h) --------------
 * Each starts with an array load by local port (port_refs) and, on a port
 * that may be traced, one lookup; it returns there for a socket nobody
 * traces. */

/* Start of tcp_rcv_established: every segment of an established
 * connection, accepted or still in the accept queue. Its ACK releases held
 * bytes; its payload is dated for the read that will consume it. */
SEC("tp_btf/tcp_probe")
int BPF_PROG(on_tcp_probe, struct sock *sk, const struct sk_buff *skb)
{
	if (!port_maybe_traced(sk))
		return 0;
	__u64 key = (__u64)sk;
	struct sock_state *st = bpf_map_lookup_elem(&sock_states, &key);

	if (!st)
		return 0;
	/* Each takes the time only if it has something to date: most
	 * segments on a streaming server are ACKs releasing nothing. */
	release_hold(st, sk);
	note_ingress(st, sk, skb);
	return 0;
}

/* Passive open completed (SYN_RECV -> ESTABLISHED, softirq, before any
 * accept): connections to a traced listener get state now, so bytes that
 * wait in the accept queue are dated. The peer's FIN on a traced
 * connection (ESTABLISHED -> CLOSE_WAIT) is reported. With socket hooks,
 * listen() and close() are seen here too (owner_state_change). Other
 * transitions cost a comparison. */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(on_sock_state, struct sock *sk, int oldstate, int newstate)
{
	if (socket_hooks)
		owner_state_change(sk, newstate);
	if (oldstate == TT_TCP_SYN_RECV && newstate == TT_TCP_ESTABLISHED) {
		struct port_ref *r = port_ref_of_btf(sk);
		if (!r || !r->listener)
			return 0;
		struct listen_key lk = listen_key_of(sk);
		if (!bpf_map_lookup_elem(&ingress_listeners, &lk))
			return 0;
		__u64 key = (__u64)sk;
		struct sock_state fresh = {
			.established_ns = bpf_ktime_get_ns(),
			.est_rcv_nxt = BPF_CORE_READ((struct tcp_sock *)sk, rcv_nxt),
		};
		bpf_map_delete_elem(&send_holds, &key); /* see own_sock */
		/* A walk left by an earlier socket at this address (its
		 * destruction went unseen) would date this one's records by
		 * the old queue and never report its handshake. */
		tls_walk_forget(key);
		if (!bpf_map_update_elem(&sock_states, &key, &fresh, BPF_ANY))
			__sync_fetch_and_add(&r->socks, 1);
		return 0;
	}
	if (oldstate == TT_TCP_ESTABLISHED && newstate == TT_TCP_CLOSE_WAIT) {
		if (!port_maybe_traced(sk))
			return 0;
		__u64 key = (__u64)sk;
		struct sock_state *st = bpf_map_lookup_elem(&sock_states, &key);
		if (st)
			peer_closed(st, sk, TT_PEER_FIN);
	}
	return 0;
}

/* An RST arrived on a socket (rare). */
SEC("tp_btf/tcp_receive_reset")
int BPF_PROG(on_tcp_reset, struct sock *sk)
{
	if (!port_maybe_traced(sk))
		return 0;
	__u64 key = (__u64)sk;
	struct sock_state *st = bpf_map_lookup_elem(&sock_states, &key);

	if (st)
		peer_closed(st, sk, TT_PEER_RST);
	return 0;
}

/* The kernel frees the socket: its state and any hold go with it, so a
 * `struct sock` reused at the same address starts clean (one lookup for an
 * untraced socket: only traced ones have either). */
SEC("tp_btf/tcp_destroy_sock")
int BPF_PROG(on_tcp_destroy, struct sock *sk)
{
	/* By now the move to TCP_CLOSE gave the port back (inet_put_port
	 * zeroes skc_num): the local port is read from inet_sport. Read
	 * through skc_num, every closed socket's state stayed until the LRU
	 * evicted it and its port's count never went down. */
	struct port_ref *r = port_ref_at(bpf_ntohs(KREAD(struct inet_sock, sk, inet_sport)));
	if (!r || !(r->listener | r->socks))
		return 0;
	__u64 key = (__u64)sk;
	struct sock_state *st = bpf_map_lookup_elem(&sock_states, &key);

	if (!st)
		return 0;
	if (socket_hooks)
		closed_by_owner(sk, st);
	bpf_map_delete_elem(&send_holds, &key);
	if (!bpf_map_delete_elem(&sock_states, &key) && r->socks)
		__sync_fetch_and_add(&r->socks, -1);
	tls_walk_forget(key);
	return 0;
}
