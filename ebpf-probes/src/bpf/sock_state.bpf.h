/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Per-socket state of traced TCP connections, shared by the softirq hooks
 * (tcp_probe, inet_sock_set_state, tcp_receive_reset, tcp_destroy_sock)
 * and the syscall probes of sock.bpf.c:
 *
 * - ingress: when the bytes still unread in the receive queue reached the
 *   host, so the read that consumes a request's first byte can report when
 *   the request arrived, not when the server got around to reading it;
 * - when a passively opened connection became ESTABLISHED (accept wait);
 * - who owns it (tgid, fd, inode), for records sent from softirq context.
 *
 * The Nagle hold (bytes a write left unsent until an incoming segment
 * released them) has its own map, `send_holds`, also keyed by the socket:
 * see note_unsent.
 *
 * Cost model: every hook starts with an array load by local port
 * (`port_refs`: no traced listener or socket on the port, return), then
 * ONE lookup in `sock_states`, keyed by the `struct sock *`; a socket
 * nobody traces has no entry and the hook returns there. Entries are created only for traced sockets: at the
 * handshake's end for connections to a listener in `ingress_listeners`
 * (one hash lookup per passive open, none per packet), and at the first
 * read or write of a traced process on any other TCP socket. They go when
 * the kernel destroys the socket (tcp_destroy_sock), so a reused `struct
 * sock` address never inherits state; the LRU bound covers the rest.
 *
 * Consistency without locks: the ingress segments are written only by the
 * tcp_probe hook, which the kernel serialises per socket (softirq under the
 * socket spinlock, or backlog processing by the lock owner); readers copy
 * and validate. A hold is one `send_holds` entry, inserted whole by the
 * writer (BPF_NOEXIST: of two writers racing on one socket exactly one
 * wins), never changed after, and copied then deleted by the tcp_probe
 * hook: no record mixes two writers' fields.
 */
#ifndef TOKENTRACE_SOCK_STATE_BPF_H
#define TOKENTRACE_SOCK_STATE_BPF_H

#define TT_TCP_ESTABLISHED 1
#define TT_TCP_SYN_RECV 3
#define TT_TCP_CLOSE_WAIT 8
#define TT_EPIPE 32
#define TT_ECONNRESET 104

/* Ingress segments remembered per socket while their bytes are unread. A
 * request usually fits one; more queue only when the server is behind on
 * a connection (pipelining, 32 HTTP/2 streams opened at once, a large
 * body). With every slot unread, the last slot takes the new segment's
 * bytes too and its arrival: the bytes it covers are then dated by the
 * newest of its segments, never before they reached the host (a request
 * in them looks to have waited less than it did, never to have arrived
 * before its client sent it), and `ingress_segs_merged` counts it. */
#define INGRESS_SEGS TT_INGRESS_MARKS

/* Incoming segments merged into a socket's last ingress slot (see
 * INGRESS_SEGS): the requests they carry are dated late by up to the
 * time the slot spans. */
__u64 ingress_segs_merged = 0;

struct ingress_seg {
	__u32 start; /* first new sequence number the segment brought */
	__u32 end; /* one past its last */
	__u64 ts; /* when it reached the host (segment_arrival); 0 = empty slot */
};

/* CLOCK_REALTIME - CLOCK_MONOTONIC in ns, kept current by the agent (0
 * until it has measured it): turns a segment's receive stamp into
 * bpf_ktime_get_ns's clock. In a section of its own, so that the agent
 * rewrites it without touching the counters in .bss. */
SEC(".data.wall") __s64 wall_minus_mono_ns = 0;

/* A receive stamp older than this when tcp_probe runs is not believed (a
 * wall clock stepped since the agent last measured the offset): the run's
 * own time dates the segment then. */
#define ARRIVAL_STAMP_MAX_AGE_NS (2ULL * 1000 * 1000 * 1000)

/* When an incoming segment reached the host. tcp_probe runs when TCP
 * processes the segment, and a segment that arrived while the socket's
 * owner was inside a send or a read on it waits in the socket's backlog
 * until that call's release_sock: under CPU load a millisecond and more
 * later (a TLS client's Finished, an upstream response's first chunk).
 * While any socket on the host asks for receive timestamps, the kernel
 * stamps each packet (skb->tstamp, CLOCK_REALTIME) as it enters the
 * receive path, the time a packet capture shows; the agent keeps such a
 * socket open (probes/arrival_stamps.rs). Without a stamp (taken before
 * that socket existed), without the offset, or with a stamp out of range:
 * `now`. */
static __always_inline __u64 segment_arrival(const struct sk_buff *skb, __u64 now)
{
	__s64 offset = wall_minus_mono_ns;
	__s64 stamp = KREAD(struct sk_buff, skb, tstamp);

	if (!offset || stamp <= 0)
		return now;
	__u64 at = (__u64)(stamp - offset);
	if (at > now || now - at > ARRIVAL_STAMP_MAX_AGE_NS)
		return now;
	return at;
}

struct sock_state {
	struct ingress_seg segs[INGRESS_SEGS];
	/* Passive open: when the handshake completed, and rcv_nxt then (the
	 * sequence number of the connection's first data byte). */
	__u64 established_ns;
	__u32 est_rcv_nxt;
	/* Holds inserted in `send_holds` for this socket that tcp_probe has
	 * not looked for yet (see note_unsent): the incoming segments of a
	 * socket without one (nearly every ACK) skip that map. */
	__u32 holds_new;
	/* When the connection's first data byte reached the host (a TLS
	 * connection's ClientHello). */
	__u64 first_ingress_ns;
	/* Owner, filled by the traced process's accept/read/write. */
	__u32 tgid;
	__u64 sock_ino;
	__s32 fd;
	/* The peer closed (enum tt_peer_close) before any traced process
	 * owned the socket (still in the accept queue): reported at accept. */
	__u32 pending_close;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 32768);
	__type(key, __u64); /* struct sock * */
	__type(value, struct sock_state);
} sock_states SEC(".maps");

/* A send-queue hold: the first write since the last release that left
 * bytes unsent on a traced socket. Written once (see note_unsent). */
struct send_hold {
	__u64 write_ts; /* entry of the write */
	__u32 tid; /* the writer */
	__u32 unsent; /* bytes unsent when it returned */
	__u32 end_seq; /* write_seq then: the held bytes end before it */
	__u32 _pad;
};

/* Holds of traced sockets, keyed by the `struct sock *`. An entry lives from
 * the write to the next incoming segment on the socket (tcp_probe), or the
 * socket's destruction; only sockets with an entry in `sock_states` get one. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u64);
	__type(value, struct send_hold);
} send_holds SEC(".maps");

/* Listening endpoints of traced processes: connections to them get state
 * from their first packet, before anyone accepts them. Filled by the agent
 * from /proc when it starts tracing a process, and by the probes at
 * listen() and accept() of traced processes. */
struct listen_key {
	__u32 netns; /* network namespace inode number */
	__u16 port;
	__u16 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct listen_key);
	__type(value, __u8);
} ingress_listeners SEC(".maps");

/* The softirq hooks' first check, by local port (their `current` is not
 * the socket's owner, so the pid filter cannot tell): a port with no
 * traced listener and no traced socket is not ours, decided by an array
 * load before the `sock_states` lookup. `listener` is set (never cleared)
 * for ports of traced listeners, by the agent through the mmapped array
 * and by mark_listener; `socks` counts sock_states entries created on the
 * port (one down when the socket is destroyed; entries the LRU evicts
 * leave it high: a wasted lookup, never a missed socket). Ports are not
 * netns-qualified here: another namespace's socket on a traced port only
 * pays the lookup. */
struct port_ref {
	__u32 listener;
	__u32 socks;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct port_ref);
} port_refs SEC(".maps");

static __always_inline struct port_ref *port_ref_at(__u32 port)
{
	return bpf_map_lookup_elem(&port_refs, &port);
}

/* `sk` as a tp_btf argument (trusted: read directly, no helper call). */
#define port_ref_of_btf(sk) port_ref_at((sk)->__sk_common.skc_num)
#define port_ref_of(sk) port_ref_at(BPF_CORE_READ(sk, __sk_common.skc_num))

/* Whether the tp_btf argument `sk` may have state: false means surely
 * not. */
static __always_inline bool port_maybe_traced(struct sock *sk)
{
	struct port_ref *r = port_ref_of_btf(sk);

	return r && (r->listener | r->socks);
}

/* A sock_states entry was created for `sk` (or is gone: -1). */
static __always_inline void port_socks_add(struct sock *sk, int delta)
{
	struct port_ref *r = port_ref_of(sk);

	if (r)
		__sync_fetch_and_add(&r->socks, delta);
}

static __always_inline bool seq_before(__u32 a, __u32 b)
{
	return (__s32)(a - b) < 0;
}

static __always_inline struct listen_key listen_key_of(struct sock *sk)
{
	struct listen_key k = {
		.netns = BPF_CORE_READ(sk, __sk_common.skc_net.net, ns.inum),
		.port = BPF_CORE_READ(sk, __sk_common.skc_num),
	};
	return k;
}

/* Marks the local endpoint of `sk` (a listener, or a connection accepted
 * from one) as a traced listener. */
static __always_inline void mark_listener(struct sock *sk)
{
	struct listen_key k = listen_key_of(sk);
	__u8 one = 1;
	struct port_ref *r = port_ref_at(k.port);

	if (r && !r->listener)
		r->listener = 1;
	if (!bpf_map_lookup_elem(&ingress_listeners, &k))
		bpf_map_update_elem(&ingress_listeners, &k, &one, BPF_NOEXIST);
}

/* The state of a socket a traced process uses, created if missing, with the
 * owner filled in. NULL only when the map refuses the entry. `unowned`
 * (optional): set when no process owned it before this call. */
static __always_inline struct sock_state *own_sock_of(struct sock *sk, __u64 ino, int fd, bool *unowned)
{
	__u64 key = (__u64)sk;
	struct sock_state *st = bpf_map_lookup_elem(&sock_states, &key);

	if (!st) {
		struct sock_state fresh = {};
		/* A hold left by an earlier socket at this address whose state
		 * the LRU evicted (so its destruction did not clear the hold). */
		bpf_map_delete_elem(&send_holds, &key);
		if (!bpf_map_update_elem(&sock_states, &key, &fresh, BPF_NOEXIST))
			port_socks_add(sk, 1);
		st = bpf_map_lookup_elem(&sock_states, &key);
		if (!st)
			return NULL;
	}
	if (unowned)
		*unowned = !st->tgid;
	if (st->sock_ino != ino || st->fd != fd) {
		st->tgid = bpf_get_current_pid_tgid() >> 32;
		st->sock_ino = ino;
		st->fd = fd;
	}
	return st;
}

static __always_inline struct sock_state *own_sock(struct sock *sk, __u64 ino, int fd)
{
	return own_sock_of(sk, ino, fd, NULL);
}

/* When the byte at sequence number `seq` reached the host (0 if unknown). */
static __always_inline __u64 byte_arrival(struct sock_state *st, __u32 seq)
{
	for (int i = 0; i < INGRESS_SEGS; i++) {
		struct ingress_seg seg = st->segs[i];
		if (seg.ts && !seq_before(seq, seg.start) && seq_before(seq, seg.end))
			return seg.ts;
	}
	/* The connection's first byte with no segment for it: it came with the
	 * ACK that completed the handshake (handled by tcp_rcv_state_process,
	 * where tcp_probe does not fire), in the same softirq. */
	if (st->established_ns && seq == st->est_rcv_nxt)
		return st->established_ns;
	return 0;
}

/* When the oldest and the newest of the `ret` bytes a read just returned
 * reached the host (0 if unknown). copied_seq has already moved past them. */
static __always_inline __u64 read_ingress(struct sock *sk, struct sock_state *st, __u32 ret, __u64 *newest)
{
	__u32 end = KREAD(struct tcp_sock, sk, copied_seq);

	*newest = byte_arrival(st, end - 1);
	return byte_arrival(st, end - ret);
}

/* tcp_probe: an incoming segment with new bytes is remembered until they
 * are read (and after, while there is room; see below). */
static __always_inline void note_ingress(struct sock_state *st, struct sock *sk, const struct sk_buff *skb)
{
	unsigned char *data = (unsigned char *)KREAD(struct sk_buff, skb, data);
	__u32 skb_len = KREAD(struct sk_buff, skb, len);
	__u32 hdr_len, seq;

	/* Plain loads where they exist: this runs for every incoming segment
	 * of a traced socket, and nearly all of them are pure ACKs. */
	if (direct_reads()) {
		const struct tcphdr *t = bpf_core_cast(data, struct tcphdr);
		hdr_len = BPF_CORE_READ_BITFIELD(t, doff) * 4;
		seq = t->seq;
	} else {
		struct tcphdr th = {};
		if (bpf_probe_read_kernel(&th, sizeof(th), data))
			return;
		hdr_len = th.doff * 4;
		seq = th.seq;
	}
	if (hdr_len < sizeof(struct tcphdr) || skb_len <= hdr_len)
		return; /* a pure ACK (or no header to read) */
	seq = bpf_ntohl(seq);
	__u32 end = seq + (skb_len - hdr_len);
	__u32 rcv_nxt = KREAD(struct tcp_sock, sk, rcv_nxt);
	__u32 copied = KREAD(struct tcp_sock, sk, copied_seq);

	if (!seq_before(rcv_nxt, end))
		return; /* nothing new: a retransmission of bytes already queued */
	__u64 arrival = segment_arrival(skb, bpf_ktime_get_ns());
	__u32 start = seq_before(rcv_nxt, seq) ? seq : rcv_nxt;

	/* The slots stay in sequence order: segments already read, then the
	 * unread ones, then this one. Read segments are dropped only for
	 * room, oldest first: a read returning on another CPU may be dating
	 * its bytes by them right now (its copied_seq has moved past them
	 * before its exit program looks them up; dropping them at once left
	 * such a read with its first byte dated and no mark for the rest,
	 * so a client dated a response chunk by the segment before it). */
	__u32 unread = 0, read = 0;
	for (int i = 0; i < INGRESS_SEGS; i++) {
		struct ingress_seg seg = st->segs[i];
		if (!seg.ts)
			continue;
		if (seq_before(copied, seg.end))
			unread++;
		else
			read++;
	}
	__u32 room = unread < INGRESS_SEGS ? INGRESS_SEGS - 1 - unread : 0;
	__u32 drop = read > room ? read - room : 0;
	struct ingress_seg keep[INGRESS_SEGS] = {};
	__u32 n = 0;
	for (int i = 0; i < INGRESS_SEGS; i++) {
		struct ingress_seg seg = st->segs[i];
		if (!seg.ts)
			continue;
		if (drop && !seq_before(copied, seg.end)) {
			drop--;
			continue;
		}
		if (n < INGRESS_SEGS) {
			keep[n & (INGRESS_SEGS - 1)] = seg;
			n++;
		}
	}
	if (n < INGRESS_SEGS) {
		keep[n & (INGRESS_SEGS - 1)].start = start;
		keep[n & (INGRESS_SEGS - 1)].end = end;
		keep[n & (INGRESS_SEGS - 1)].ts = arrival;
	} else {
		if (seq_before(keep[INGRESS_SEGS - 1].end, end))
			keep[INGRESS_SEGS - 1].end = end;
		keep[INGRESS_SEGS - 1].ts = arrival;
		__sync_fetch_and_add(&ingress_segs_merged, 1);
	}
	__builtin_memcpy(st->segs, keep, sizeof(keep));
	if (!st->first_ingress_ns)
		st->first_ingress_ns = arrival;
}

/* After a hold was inserted: the next incoming segment looks for it. A
 * locked add on both sides (the only atomic every supported kernel has):
 * tcp_probe subtracts what it saw before its lookup, so an insert it may
 * have missed leaves the count above zero for the next segment. */
static __always_inline void holds_noted(struct sock_state *st)
{
	__sync_fetch_and_add(&st->holds_new, 1);
}

/* Bytes left unsent by a write, until an incoming ACK releases them: the
 * time Nagle (or a full window) held a token back.
 *
 * Two threads may write one socket at once. The hold is inserted as one
 * whole entry with BPF_NOEXIST, so exactly one of racing writers gets it
 * (the other's bytes are behind the winner's, held as long or shorter), and
 * an existing hold whose bytes still wait is kept: the first write whose
 * bytes wait is the one that waits longest. The release (tcp_probe) copies
 * and deletes it. A replaced entry is whole too (the map swaps elements);
 * the one race left is a replacement between the release's copy and its
 * delete, which loses the new hold (a hold not reported, never a wrong one). */
static __always_inline void note_unsent(struct sock_state *st, struct sock *sk, __u64 ts_enter,
					struct tt_data_event *e)
{
	/* plain loads where possible: helper calls fewer on every traced write */
	__u32 write_seq = KREAD(struct tcp_sock, sk, write_seq);
	__u32 snd_nxt = KREAD(struct tcp_sock, sk, snd_nxt);
	__u8 nonagle = direct_reads() ? BPF_CORE_READ_BITFIELD(bpf_core_cast(sk, struct tcp_sock), nonagle)
				      : BPF_CORE_READ_BITFIELD_PROBED((struct tcp_sock *)sk, nonagle);
	__u32 unsent = write_seq - snd_nxt;

	/* TCP_NAGLE_OFF (1) is TCP_NODELAY; TCP_NAGLE_CORK (2) holds on purpose. */
	e->tcp_nodelay = (nonagle & 1) ? 1 : 0;
	e->unsent_bytes = unsent > (1u << 30) ? 0 : unsent;
	if (e->unsent_bytes == 0 || !st)
		return;
	__u64 key = (__u64)sk;
	struct send_hold h = {
		.write_ts = ts_enter,
		.tid = (__u32)bpf_get_current_pid_tgid(),
		.unsent = e->unsent_bytes,
		.end_seq = write_seq,
	};
	if (bpf_map_update_elem(&send_holds, &key, &h, BPF_NOEXIST)) {
		/* A hold stands. Kept while its bytes wait (they wait longer
		 * than ours); replaced when they already left with no segment
		 * coming in (uncorked, pushed out by a full segment): else it
		 * would block every later hold until the next segment, and the
		 * one it blocks is real. */
		struct send_hold *old = bpf_map_lookup_elem(&send_holds, &key);
		if (old && !seq_before(snd_nxt, old->end_seq))
			bpf_map_update_elem(&send_holds, &key, &h, BPF_EXIST);
	}
	holds_noted(st);
}

/* tcp_probe: the incoming segment's ACK releases held bytes (the held
 * segment goes out right after, in the same softirq). Runs in softirq
 * context, so the record's header comes from the writer.
 *
 * A hold whose bytes are no longer unsent when the segment comes ended
 * before it, at a time nobody saw: a later write pushed them out in a full
 * segment, the writer uncorked, or the ACK that sent them came between the
 * writer's read of snd_nxt and its insert. It is dropped, not reported as
 * lasting until this segment. */
static __always_inline void release_hold(struct sock_state *st, struct sock *sk)
{
	__u32 seen = st->holds_new;

	if (!seen)
		return;
	__sync_fetch_and_add(&st->holds_new, -seen);
	__u64 key = (__u64)sk;
	struct send_hold *held = bpf_map_lookup_elem(&send_holds, &key);

	if (!held)
		return;
	/* Entries are never written after insertion, and only this hook (one
	 * at a time per socket) and the socket's destruction delete them: the
	 * copy is one writer's. */
	struct send_hold h = *held;
	bpf_map_delete_elem(&send_holds, &key);
	__u32 snd_nxt = KREAD(struct tcp_sock, sk, snd_nxt);
	if (!seq_before(snd_nxt, h.end_seq))
		return;
	__u64 now = bpf_ktime_get_ns();
	if (now - h.write_ts < hold_min_ns)
		return;
	struct tt_nagle_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return;
	}
	__builtin_memset(&e->hdr, 0, sizeof(e->hdr));
	e->hdr.kind = TT_EVENT_NAGLE;
	e->hdr.tgid = st->tgid;
	e->hdr.tid = h.tid;
	e->hdr.ts_ns = now;
	e->sock_ino = st->sock_ino;
	e->write_ts_ns = h.write_ts;
	e->held_bytes = h.unsent;
	e->_pad = 0;
	bpf_ringbuf_submit(e, wakeup_flags(sizeof(*e)));
}

/* The peer ended the connection: reported for the owner (softirq context:
 * the current task is anyone). For a connection no traced process owns yet
 * (not accepted) it is kept and reported when the accept returns it. */
static __always_inline void peer_closed(struct sock_state *st, struct sock *sk, __u32 reason)
{
	if (!st->tgid) {
		if (!st->pending_close)
			st->pending_close = reason;
		return;
	}
	struct tt_conn_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&ringbuf_drops, 1);
		return;
	}
	__builtin_memset(&e->hdr, 0, sizeof(e->hdr));
	e->hdr.kind = TT_EVENT_PEER_CLOSED;
	e->hdr.tgid = st->tgid;
	e->hdr.ts_ns = bpf_ktime_get_ns();
	e->sock_ino = st->sock_ino;
	e->fd = st->fd;
	e->reason = reason;
	e->start_ns = 0;
	fill_addrs(sk, &e->addrs);
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
}

#endif /* TOKENTRACE_SOCK_STATE_BPF_H */
