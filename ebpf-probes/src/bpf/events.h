/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Every record that crosses the ring buffer between the kernel probes and
 * the agent. The Rust side uses the types libbpf-cargo generates from this
 * header (through the skeleton's BTF), so this file is the single source of
 * truth for the wire layout.
 */
#ifndef TOKENTRACE_EVENTS_H
#define TOKENTRACE_EVENTS_H

/* Largest payload prefix one data record can carry. The runtime cap
 * (`capture_bytes` in rodata) is at most this; it must stay a power of two
 * because the probe masks offsets with MAX_CAPTURE - 1 for the verifier. */
#ifndef MAX_CAPTURE
#define MAX_CAPTURE 16384
#endif

/* How many iovec entries of a readv/writev/sendmsg/recvmsg are copied.
 * grpcio writes a frame header, a gRPC prefix and a message as separate
 * iovecs (2-3 per message; 11 for the first response HEADERS of a
 * connection), and a burst of 32 concurrent streams' HEADERS went out as
 * one sendmsg of ~130: with 32, frame headers still fell past the copy.
 * 1024 is UIO_MAXIOV, the kernel's own limit, so every iovec is seen;
 * copying still stops at capture_bytes. */
#ifndef MAX_IOV
#define MAX_IOV 1024
#endif

/* Frames kept per stack of a CPU sample (the kernel's default
 * perf_event_max_stack). */
#ifndef MAX_STACK_DEPTH
#define MAX_STACK_DEPTH 127
#endif

/* Arrival marks one data record carries: one per ingress segment whose
 * bytes the read returned (see struct tt_ingress_mark). */
#ifndef TT_INGRESS_MARKS
#define TT_INGRESS_MARKS 8
#endif

/* Payload pieces a data record can gather (struct tt_data_event): the
 * iovecs the probes copy inline, without a loop. */
#define TT_GATHER_SEGS 4

#define TASK_COMM_LEN 16
#define LLM_ID_LEN 64
#define EXEC_FILENAME_LEN 128

enum tt_event_kind {
	TT_EVENT_DATA = 1,
	TT_EVENT_ACCEPT = 2,
	TT_EVENT_CLOSE = 3,
	TT_EVENT_EXEC = 4,
	TT_EVENT_EXIT = 5,
	TT_EVENT_LISTEN = 6,
	/* A traced process mapped a file executable (a library was loaded):
	 * the agent re-reads its maps to find libssl. Uses tt_proc_event. */
	TT_EVENT_LIB_MAPPED = 7,
	/* An on-CPU sample of a profiled process (profile.bpf.c, its own ring
	 * buffer). Uses tt_cpu_sample. */
	TT_EVENT_CPU_SAMPLE = 8,
	TT_EVENT_USDT = 9,
	TT_EVENT_CUDA_SYNC = 10,
	TT_EVENT_OFFCPU = 11,
	TT_EVENT_NAGLE = 12,
	/* A traced process forked a child (traced from then on by the kernel):
	 * the agent attaches the child's uprobes, which a fork does not copy.
	 * Uses tt_proc_event: hdr.tgid is the child, ppid the parent. */
	TT_EVENT_FORK = 13,
	/* The peer of a traced connection closed it (FIN or RST), or a write
	 * failed because it had (EPIPE/ECONNRESET). Uses tt_conn_event with
	 * `reason` an enum tt_peer_close. */
	TT_EVENT_PEER_CLOSED = 14,
	/* SSL_do_handshake succeeded on a traced SSL*. Uses tt_conn_event:
	 * sock_ino = the SSL*, fd = its socket (-1 if unknown), start_ns = when
	 * the connection's first byte (the ClientHello) reached the host. */
	TT_EVENT_TLS_HANDSHAKE = 15,
};

/* How the peer ended a connection (tt_conn_event.reason of
 * TT_EVENT_PEER_CLOSED). */
enum tt_peer_close {
	TT_PEER_FIN = 1,
	TT_PEER_RST = 2,
	TT_PEER_WRITE_EPIPE = 3,
	TT_PEER_WRITE_ECONNRESET = 4,
};

/* The `llm` USDT provider's probes (instrument/README.md has the argument
 * contract). The value is the USDT cookie the agent attaches with. */
enum tt_llm_probe {
	TT_LLM_REQUEST_START = 1,
	TT_LLM_REQUEST_QUEUED = 2,
	TT_LLM_REQUEST_SCHEDULED = 3,
	TT_LLM_PREFILL_START = 4,
	TT_LLM_PREFILL_END = 5,
	TT_LLM_TOKEN = 6,
	TT_LLM_REQUEST_END = 7,
	TT_LLM_BATCH_STEP = 8,
	TT_LLM_REQUEST_PREEMPTED = 9,
};

/* CUDA calls that wait for the GPU (entry and return are probed). */
enum tt_cuda_sync {
	TT_CUDA_STREAM_SYNCHRONIZE = 1,
	TT_CUDA_DEVICE_SYNCHRONIZE = 2,
	TT_CUDA_EVENT_SYNCHRONIZE = 3,
	TT_CU_STREAM_SYNCHRONIZE = 4,
	TT_CU_CTX_SYNCHRONIZE = 5,
};

enum tt_direction {
	TT_DIR_INGRESS = 0,
	TT_DIR_EGRESS = 1,
};

/* Which syscall produced a data record (for diagnostics and tests). */
enum tt_io_call {
	TT_IO_READ = 1,
	TT_IO_READV = 2,
	TT_IO_RECVFROM = 3,
	TT_IO_RECVMSG = 4,
	TT_IO_WRITE = 5,
	TT_IO_WRITEV = 6,
	TT_IO_SENDTO = 7,
	TT_IO_SENDMSG = 8,
	TT_IO_SENDFILE = 9,
	/* OpenSSL calls: plaintext of a TLS connection. fd is -1 and sock_ino
	 * is the SSL* (the connection identity); addrs are filled when the
	 * SSL* was seen doing socket I/O on a thread (a socket BIO). */
	TT_IO_SSL_READ = 10,
	TT_IO_SSL_WRITE = 11,
	TT_IO_SSL_READ_EX = 12,
	TT_IO_SSL_WRITE_EX = 13,
	/* Never in a record: marks SSL_do_handshake in flight. */
	TT_IO_SSL_HANDSHAKE = 14,
};

/* TCP endpoint pair of a socket, in network byte order for addresses and
 * host byte order for ports. family is AF_INET (2) or AF_INET6 (10). */
struct tt_sock_addrs {
	__u16 family;
	__u16 local_port;
	__u16 remote_port;
	__u16 _pad;
	__u8 local_addr[16];
	__u8 remote_addr[16];
};

/* When bytes [offset, offset + len) of a read reached the host: the
 * arrival of the segment that carried them (tcp_probe). For an OpenSSL
 * read, the arrival of the first byte of the TLS record the plaintext came
 * from (one mark over the whole read). */
struct tt_ingress_mark {
	__u32 offset;
	__u32 len;
	__u64 ts;
};

/* Common prefix of every record: the kind tells the reader which struct
 * follows. */
struct tt_event_header {
	__u32 kind;
	__u32 tgid;
	__u32 tid;
	__u32 _pad;
	__u64 ts_ns; /* CLOCK_MONOTONIC (bpf_ktime_get_ns) */
	char comm[TASK_COMM_LEN];
};

/* One read- or write-family syscall on a TCP socket. The record on the
 * ring buffer is this struct immediately followed by at least `captured`
 * payload bytes (the first `captured` of the `len` bytes moved); room past
 * `captured` (a copy into the reserved record that faulted part way) is
 * not payload. */
struct tt_data_event {
	struct tt_event_header hdr; /* hdr.ts_ns = syscall exit */
	__u64 ts_enter_ns;
	__u64 sock_ino; /* socket inode: tells a reused fd apart */
	__s32 fd;
	__u32 len; /* bytes the syscall really moved */
	__u32 captured; /* bytes of data[] that follow */
	__u8 direction; /* enum tt_direction */
	__u8 call; /* enum tt_io_call */
	/* Egress on a TCP socket: 1 if TCP_NODELAY is set, 0 if Nagle is on. */
	__u8 tcp_nodelay;
	/* 0: data[0 .. captured) is the payload, in order. n > 0: iovecs that
	 * lie inside or right after one another in memory were read once (a
	 * writer that keeps its chunk-size line and event in one buffer and
	 * sends the same CRLF twice: node), so the payload is its first n
	 * pieces, data[gather_off[i] .. + gather_len[i]) for i < n in order,
	 * then data[gather_tail .. captured). */
	__u8 gather_segs;
	/* Egress: bytes written but not yet sent when the write returned
	 * (held by Nagle, cwnd or the peer's window). */
	__u32 unsent_bytes;
	__u16 gather_off[TT_GATHER_SEGS];
	__u16 gather_len[TT_GATHER_SEGS];
	__u16 gather_tail;
	__u16 _pad2;
	/* Ingress: when the oldest byte this read returned reached the host
	 * (tcp_probe at the start of tcp_rcv_established); 0 if unknown (it
	 * arrived before the socket was tracked). */
	__u64 ingress_ns;
	struct tt_sock_addrs addrs;
	/* Ingress: marks[0 .. nmarks) date the read's bytes by the segment
	 * (or TLS record) that carried them, in offset order; bytes no mark
	 * covers are undated. */
	__u32 nmarks;
	__u32 _pad3;
	struct tt_ingress_mark marks[TT_INGRESS_MARKS];
};

/* accept/accept4 returned a new TCP connection, or close() of a TCP socket
 * in a traced process. SSL_free of a traced process's SSL* is a close with
 * fd -1 and sock_ino = the SSL*. */
struct tt_conn_event {
	struct tt_event_header hdr;
	__u64 sock_ino;
	__s32 fd;
	__u32 reason; /* TT_EVENT_PEER_CLOSED: enum tt_peer_close, else 0 */
	/* Accept: when the connection became ESTABLISHED (the handshake's last
	 * ACK reached the host; 0 if unknown). TLS handshake: see its kind. */
	__u64 start_ns;
	struct tt_sock_addrs addrs;
};

/* listen() was called on a TCP socket (any process, when the agent selects
 * by port or automatically): lets the agent pick up servers that start
 * after it, by port or as LLM-endpoint candidates. */
struct tt_listen_event {
	struct tt_event_header hdr;
	__u16 port;
	__u16 family;
	__u32 _pad;
};

/* A process exec'd (a traced one, or any when the agent selects by
 * executable or name), a traced process exited or forked. */
struct tt_proc_event {
	struct tt_event_header hdr;
	__u32 ppid;
	__s32 exit_code;
	char filename[EXEC_FILENAME_LEN];
};

/* One on-CPU sample: the profiled thread was running when the perf event
 * fired. Stacks are instruction pointers, innermost first; a length is the
 * number of bytes bpf_get_stack filled, or a negative errno when the stack
 * could not be read. */
struct tt_cpu_sample {
	struct tt_event_header hdr; /* hdr.ts_ns = sample time */
	__u32 cpu;
	__s32 kstack_bytes;
	__s32 ustack_bytes;
	__u32 _pad;
	__u64 kstack[MAX_STACK_DEPTH];
	__u64 ustack[MAX_STACK_DEPTH];
};

/* One `llm:*` USDT probe fired in a traced process. */
struct tt_usdt_event {
	struct tt_event_header hdr;
	__u32 probe; /* enum tt_llm_probe */
	__u32 nargs;
	/* The integer arguments after the request id (batch_step: all three). */
	__u64 args[3];
	char request_id[LLM_ID_LEN];
};

/* A CUDA synchronisation call returned. Launches are counted in the kernel
 * per thread and reported with the thread's next sync, so a launch-heavy
 * loop costs a map update per launch, not a record. */
struct tt_cuda_sync_event {
	struct tt_event_header hdr; /* hdr.ts_ns = return */
	__u64 ts_enter_ns;
	__u64 handle; /* stream or event argument, 0 for device/context syncs */
	__u32 call; /* enum tt_cuda_sync */
	__u32 _pad;
	/* Work this thread enqueued since its previous sync. */
	__u64 kernel_launches;
	__u64 graph_launches;
	__u64 memcpy_bytes;
};

/* A traced thread was off-CPU for at least `offcpu_min_ns`. The header
 * describes the thread (not the CPU's current task). */
struct tt_offcpu_event {
	struct tt_event_header hdr; /* hdr.ts_ns = back on CPU */
	__u64 start_ns; /* switched out */
	__s64 syscall; /* syscall it blocked in, -1 if none (preempted) */
	__u32 state; /* prev_state at switch-out (0 = preempted, runnable) */
	__u32 in_cuda_sync; /* blocked inside a probed CUDA sync */
};

/* Bytes a traced process wrote were held in the socket's send queue (Nagle
 * waiting for an ACK) until the ACK that released them arrived. */
struct tt_nagle_event {
	struct tt_event_header hdr; /* tgid/tid of the writer, ts = release */
	__u64 sock_ino;
	__u64 write_ts_ns; /* entry of the write whose bytes were held */
	__u32 held_bytes;
	__u32 _pad;
};

#endif /* TOKENTRACE_EVENTS_H */
