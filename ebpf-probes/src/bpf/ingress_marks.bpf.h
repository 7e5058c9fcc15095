/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Dating any byte of a read, not only its oldest (issue 27):
 *
 * - arrival marks: a read's record carries, for every remembered ingress
 *   segment of the socket (sock_state.segs) whose bytes it returned, the
 *   byte range and the segment's arrival, so the agent dates a request
 *   that starts mid-read (HTTP/2 HEADERS after the client preface, a
 *   pipelined request) by the segment that carried it;
 * - a TLS record walk: on a socket whose first read was a ClientHello,
 *   every read's ciphertext is cut into records (5-byte headers: type,
 *   version, length; a header or body may straddle reads). The client's
 *   ClientHello and Finished (the first record after its ChangeCipherSpec,
 *   or the first application-data record without one) date the handshake;
 *   each application-data record after it is queued with the arrival of
 *   its first byte, and an SSL read of the connection's plaintext is dated
 *   by the record it comes from, whatever read carried it (memory BIOs
 *   feed several records at once; the client's Finished and first request
 *   often share a segment).
 *
 * Called from sock.bpf.c's programs after their first checks; included
 * after sock_state.bpf.h.
 */
#ifndef TOKENTRACE_INGRESS_MARKS_BPF_H
#define TOKENTRACE_INGRESS_MARKS_BPF_H

#define TLS_CT_CCS 20
#define TLS_CT_ALERT 21
#define TLS_CT_HANDSHAKE 22
#define TLS_CT_APPDATA 23
/* A record's length can be at most 2^14 + 2048 (RFC 8446 5.2, 5246 6.2.3). */
#define TLS_MAX_RECORD (16384 + 2048)
/* Records a single read may hold that the walk cuts (32 HTTP/2 streams'
 * HEADERS sent at once fit; more and the walk gives up on the socket). */
#define TLS_WALK_MAX 64
/* Application-data records queued per socket until an SSL read takes them. */
#define TLS_QUEUE 16
/* Bytes a record's plaintext is shorter than the record, at least (TLS 1.3
 * AEAD: 16-byte tag + content type; TLS 1.2 GCM adds an 8-byte nonce). A
 * record is taken whole when an SSL read left less than TLS_SLACK of it. */
#define TLS_OVERHEAD 17
#define TLS_SLACK 24

/* TLS walks that gave up (a record header that is not one, too many
 * records in one read, a read split over iovecs). */
__u64 tls_walk_lost = 0;
/* Application-data records dropped because the socket's queue was full. */
__u64 tls_queue_full = 0;

struct tt_tls_rec {
	__u64 ts;
	__u32 len;
	__u32 _pad;
};

struct tt_tls_walk {
	__u64 hello_ns; /* the ClientHello's first byte reached the host */
	__u64 finished_ns; /* the client's Finished did */
	__u64 partial_ts; /* arrival of a header cut by the end of a read */
	__u32 need; /* body bytes of the current record still to come */
	__u32 front_left; /* plaintext left of the front record (0: whole) */
	__u32 head, tail; /* queue positions (free-running) */
	__u8 hdr[5]; /* a header cut by the end of a read */
	__u8 hdr_have;
	__u8 ccs_seen;
	__u8 finished;
	__u8 reported; /* the handshake was reported */
	__u8 lost;
	__u8 _pad[6];
	struct tt_tls_rec q[TLS_QUEUE];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 32768);
	__type(key, __u64); /* struct sock * */
	__type(value, struct tt_tls_walk);
} tls_walks SEC(".maps");

/* What a new walk starts from. Read from here, not from a zeroed local:
 * the struct on tls_walk_read's stack (344 bytes) plus sys_exit's own
 * frame passed the verifier's 512-byte combined limit wherever the kernel
 * gives the program no private stack (before 6.13, and 6.18 kernels seen
 * here). */
static const struct tt_tls_walk tls_walk_zero = {};

/* The read's marks: every remembered segment overlapping the `ret` bytes
 * just read (copied_seq has moved past them), clipped to them. */
static __always_inline void fill_ingress_marks(struct sock *sk, struct sock_state *st, __u32 ret,
					       struct tt_data_event *e)
{
	__u32 end = BPF_CORE_READ((struct tcp_sock *)sk, copied_seq);
	__u32 start = end - ret;
	__u32 n = 0;

	e->nmarks = 0;
	if (!st)
		return;
	for (int i = 0; i < INGRESS_SEGS; i++) {
		struct ingress_seg seg = st->segs[i];
		if (!seg.ts || !seq_before(start, seg.end) || !seq_before(seg.start, end))
			continue;
		__u32 from = seq_before(seg.start, start) ? start : seg.start;
		__u32 to = seq_before(end, seg.end) ? end : seg.end;
		struct tt_ingress_mark *m = &e->marks[n & (TT_INGRESS_MARKS - 1)];
		m->offset = from - start;
		m->len = to - from;
		m->ts = seg.ts;
		n++;
		if (n >= TT_INGRESS_MARKS)
			break;
	}
	/* The connection's first bytes came with the handshake's last ACK
	 * (see byte_arrival): no segment, the establishment dates them. */
	if (n < TT_INGRESS_MARKS && st->established_ns && start == st->est_rcv_nxt) {
		__u32 covered = ret;
		for (int i = 0; i < TT_INGRESS_MARKS; i++) {
			if (i < n && e->marks[i].offset < covered)
				covered = e->marks[i].offset;
		}
		if (covered) {
			struct tt_ingress_mark *m = &e->marks[n & (TT_INGRESS_MARKS - 1)];
			m->offset = 0;
			m->len = covered;
			m->ts = st->established_ns;
			n++;
		}
	}
	e->nmarks = n;
}

/* One SSL read's mark: the whole plaintext from the record at `ts`. */
static __always_inline void set_ssl_mark(struct tt_data_event *e, __u64 ts)
{
	e->marks[0].offset = 0;
	e->marks[0].len = e->len;
	e->marks[0].ts = ts;
	e->nmarks = ts ? 1 : 0;
}

struct tt_walk_ctx {
	struct tt_tls_walk *w;
	struct sock_state *st;
	__u64 src;
	__u32 avail;
	__u32 off;
	__u32 seq; /* sequence number of the read's first byte */
};

static __always_inline void tls_record(struct tt_tls_walk *w, __u8 type, __u32 len, __u64 ts)
{
	if (!w->finished) {
		if (type == TLS_CT_HANDSHAKE && !w->ccs_seen) {
			if (!w->hello_ns)
				w->hello_ns = ts;
		} else if (type == TLS_CT_CCS) {
			w->ccs_seen = 1;
		} else if (type != TLS_CT_ALERT) {
			/* After the ChangeCipherSpec (TLS 1.2's encrypted
			 * Finished, TLS 1.3's in an application-data record),
			 * or TLS 1.3 without one: the client's Finished. */
			w->finished = 1;
			w->finished_ns = ts;
		}
		return;
	}
	if (type != TLS_CT_APPDATA)
		return;
	if (w->tail - w->head >= TLS_QUEUE) {
		__sync_fetch_and_add(&tls_queue_full, 1);
		return;
	}
	struct tt_tls_rec *r = &w->q[w->tail & (TLS_QUEUE - 1)];
	r->ts = ts;
	r->len = len;
	w->tail++;
}

/* One record of the read (bpf_loop callback): 1 stops the walk. */
static long walk_step(__u64 i, struct tt_walk_ctx *c)
{
	struct tt_tls_walk *w = c->w;
	__u8 h[5] = {};
	__u32 off = c->off;

	if (off >= c->avail)
		return 1;
	__u32 have = w->hdr_have;
	__u64 ts;
	if (!have && off + 5 <= c->avail) {
		if (bpf_probe_read_user(h, 5, (void *)(c->src + off)))
			goto lost;
		ts = byte_arrival(c->st, c->seq + off);
		off += 5;
	} else {
		ts = have ? w->partial_ts : byte_arrival(c->st, c->seq + off);
		for (int j = 0; j < 5; j++) {
			if (j < have && j < 5) {
				h[j] = w->hdr[j];
				continue;
			}
			if (off >= c->avail) {
				/* The header goes on in the next read. */
				for (int k = 0; k < 5; k++)
					w->hdr[k] = h[k];
				w->hdr_have = j;
				w->partial_ts = ts;
				c->off = off;
				return 1;
			}
			if (bpf_probe_read_user(&h[j], 1, (void *)(c->src + off)))
				goto lost;
			off++;
		}
		w->hdr_have = 0;
	}
	__u32 len = ((__u32)h[3] << 8) | h[4];
	if (h[0] < TLS_CT_CCS || h[0] > TLS_CT_APPDATA || h[1] != 3 || len > TLS_MAX_RECORD)
		goto lost;
	tls_record(w, h[0], len, ts);
	__u32 body = c->avail - off < len ? c->avail - off : len;
	off += body;
	w->need = len - body;
	c->off = off;
	return 0;
lost:
	w->lost = 1;
	__sync_fetch_and_add(&tls_walk_lost, 1);
	return 1;
}

/* A traced socket read `ret` bytes into the user buffer `buf` (flat, or an
 * iovec array when `iovcnt`): walk its TLS records, starting a walk when
 * the read opens with a ClientHello. */
static __noinline int tls_walk_read(struct sock *sk, struct sock_state *st, __u64 buf, __u32 iovcnt, __u32 ret)
{
	__u64 key = (__u64)sk;
	__u64 src = buf;
	__u32 avail = ret;

	if (!sk || !st)
		return 0;
	if (iovcnt) {
		struct iovec v = {};
		if (bpf_probe_read_user(&v, sizeof(v), (void *)buf))
			return 0;
		src = (__u64)v.iov_base;
		if (v.iov_len < avail)
			avail = v.iov_len;
	}
	struct tt_tls_walk *w = bpf_map_lookup_elem(&tls_walks, &key);
	if (!w) {
		__u8 h[6] = {};
		if (ret < 6 || bpf_probe_read_user(h, sizeof(h), (void *)src))
			return 0;
		if (h[0] != TLS_CT_HANDSHAKE || h[1] != 3 || h[5] != 1)
			return 0; /* not a ClientHello: not a TLS server socket */
		bpf_map_update_elem(&tls_walks, &key, &tls_walk_zero, BPF_ANY);
		w = bpf_map_lookup_elem(&tls_walks, &key);
		if (!w)
			return 0;
	}
	if (w->lost)
		return 0;
	__u32 end = BPF_CORE_READ((struct tcp_sock *)sk, copied_seq);
	struct tt_walk_ctx c = { .w = w, .st = st, .src = src, .avail = avail, .seq = end - ret };
	if (w->need) {
		__u32 take = w->need < avail ? w->need : avail;
		w->need -= take;
		c.off = take;
	}
	bpf_loop(TLS_WALK_MAX, walk_step, &c, 0);
	if (!w->lost && (c.off < avail && !w->hdr_have)) {
		w->lost = 1;
		__sync_fetch_and_add(&tls_walk_lost, 1);
	} else if (!w->lost && avail < ret) {
		w->lost = 1; /* the rest sits in iovecs the walk does not read */
		__sync_fetch_and_add(&tls_walk_lost, 1);
	}
	return 0;
}

/* An SSL read returned `len` plaintext bytes: the arrival of the record
 * they start in (0 if none is queued), the records they used up taken. */
static __always_inline __u64 tls_take(struct tt_tls_walk *w, __u64 len)
{
	if (w->head == w->tail)
		return 0;
	__u64 ts = w->q[w->head & (TLS_QUEUE - 1)].ts;
	__u64 left = len;
	for (int k = 0; k < 8; k++) {
		if (w->head == w->tail || !left)
			break;
		__u32 rlen = w->q[w->head & (TLS_QUEUE - 1)].len;
		__u64 est = w->front_left ? w->front_left : (rlen > TLS_OVERHEAD ? rlen - TLS_OVERHEAD : 0);
		if (left + TLS_SLACK >= est) {
			left = left > est ? left - est : 0;
			w->head++;
			w->front_left = 0;
		} else {
			w->front_left = est - left;
			left = 0;
		}
	}
	return ts;
}

static __always_inline void tls_walk_forget(__u64 key)
{
	bpf_map_delete_elem(&tls_walks, &key);
}

#endif /* TOKENTRACE_INGRESS_MARKS_BPF_H */
