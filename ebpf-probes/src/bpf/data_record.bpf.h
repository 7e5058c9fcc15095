/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Emitting one data record (struct tt_data_event + payload), shared by the
 * syscall and OpenSSL data paths of sock.bpf.c.
 *
 * Direct (kernels with bpf_probe_read_user_dynptr, 6.16+): the record is
 * reserved in the ring buffer at its exact size (header + the bytes to
 * capture, known before the copy: min(capture_bytes, bytes moved)), the
 * header is filled in place and the payload is read from user memory
 * straight into the record: one copy. The iovec walk stops at the bytes
 * the syscall really moved; its first IOV_INLINE iovecs are read in one
 * piece (from the kernel's copy of the array where the send's start kept
 * it) and copied inline, the rest in a bpf_loop. The verifier sees no
 * payload offsets (the dynptr checks them at run time), so the walk costs
 * it a few dozen instructions per iovec instead of hundreds.
 *
 * Staged (older kernels): the record is built in the per-CPU `scratch`
 * slot and copied into the ring buffer by bpf_ringbuf_output (two copies),
 * with masked offsets for the verifier. The branch not taken is dead code
 * the verifier never walks.
 *
 * Use: data_begin() returns the header to fill (NULL: nothing reserved,
 * return), then exactly one of data_flat() / data_iov() copies the payload
 * and sends the record.
 */
#ifndef TOKENTRACE_DATA_RECORD_BPF_H
#define TOKENTRACE_DATA_RECORD_BPF_H

extern int bpf_probe_read_user_dynptr(struct bpf_dynptr *dptr, __u32 off, __u32 size,
				      const void *unsafe_ptr__ign) __weak __ksym;

#define DATA_HDR ((__u32)sizeof(struct tt_data_event))

/* Where a record is being built: in the ring buffer (dp) or staged (s). */
struct data_out {
	struct bpf_dynptr dp;
	struct data_scratch *s;
};

static __always_inline bool data_direct(void)
{
	return bpf_ksym_exists(bpf_probe_read_user_dynptr);
}

/* The payload is data[0 .. captured), in order (a gathering walk says
 * otherwise once it has placed its pieces). */
static __always_inline void no_gather(struct tt_data_event *e)
{
	e->gather_segs = 0;
	e->gather_tail = 0;
	e->_pad2 = 0;
	__builtin_memset(e->gather_off, 0, sizeof(e->gather_off));
	__builtin_memset(e->gather_len, 0, sizeof(e->gather_len));
}

/* A record with room for `limit` (<= capture_bytes) payload bytes. */
static __always_inline struct tt_data_event *data_begin(struct data_out *o, __u32 limit)
{
	if (data_direct()) {
		if (limit > MAX_CAPTURE)
			limit = MAX_CAPTURE;
		if (bpf_ringbuf_reserve_dynptr(&events, DATA_HDR + limit, 0, &o->dp)) {
			bpf_ringbuf_discard_dynptr(&o->dp, 0);
			__sync_fetch_and_add(&ringbuf_drops, 1);
			return NULL;
		}
		struct tt_data_event *e = bpf_dynptr_data(&o->dp, 0, sizeof(*e));
		if (!e) {
			bpf_ringbuf_discard_dynptr(&o->dp, 0);
			return NULL;
		}
		no_gather(e);
		return e;
	}
	__u32 cpu = bpf_get_smp_processor_id();
	o->s = bpf_map_lookup_elem(&scratch, &cpu);
	if (!o->s) {
		__sync_fetch_and_add(&scratch_misses, 1);
		return NULL;
	}
	no_gather(&o->s->ev);
	return &o->s->ev;
}

/* Staged: sends the record with its first `captured` payload bytes. */
static __always_inline int submit_staged(struct data_scratch *s, __u32 captured)
{
	if (captured > MAX_CAPTURE)
		captured = MAX_CAPTURE;
	captured = verifier_mask(captured, LEN_MASK);
	s->ev.captured = captured;
	__u64 size = sizeof(struct tt_data_event) + captured;
	/* Not written yet: the unread count is without it. */
	__u64 unread = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) + ring_room(size);
	if (bpf_ringbuf_output(&events, s, size, wakeup_for(unread, size)))
		__sync_fetch_and_add(&ringbuf_drops, 1);
	return 0;
}

/* Direct: the record goes with `captured` payload bytes. A copy that
 * faulted part way leaves the rest of the reserved payload unwritten; the
 * reader takes `captured` bytes. */
static __always_inline int submit_direct(struct data_out *o, struct tt_data_event *e, __u32 captured)
{
	e->captured = captured;
	/* Reserved with room for `captured` bytes unless a copy faulted. */
	bpf_ringbuf_submit_dynptr(&o->dp, wakeup_flags(DATA_HDR + captured));
	return 0;
}

static __always_inline __u32 copy_flat(__u8 *dst, __u64 src, __u32 n)
{
	if (n > MAX_CAPTURE)
		n = MAX_CAPTURE;
	n = verifier_mask(n, LEN_MASK);
	if (bpf_probe_read_user(dst, n, (void *)src))
		return 0;
	return n;
}

static __always_inline __u32 copy_iov(__u8 *dst, __u64 iov_ptr, __u32 iovcnt, __u32 limit)
{
	const struct iovec *iov = (const struct iovec *)iov_ptr;
	__u32 off = 0;

	for (int i = 0; i < MAX_IOV; i++) {
		struct iovec v = {};

		if (i >= iovcnt || off >= limit)
			break;
		if (bpf_probe_read_user(&v, sizeof(v), &iov[i]))
			break;
		__u32 n = v.iov_len;
		if (n > limit - off)
			n = limit - off;
		if (n > MAX_CAPTURE)
			n = MAX_CAPTURE;
		n = verifier_mask(n, LEN_MASK);
		/* off < limit <= MAX_CAPTURE here, so the mask keeps it. */
		if (bpf_probe_read_user(dst + verifier_mask(off, OFF_MASK), n, v.iov_base))
			break;
		/* off + n <= limit <= MAX_CAPTURE: the mask changes nothing, but
		 * it gives every iteration the same range for `off`, so the
		 * verifier prunes instead of walking each path of each iteration
		 * (without it MAX_IOV 64 exceeds the 1M-instruction limit). */
		off = verifier_mask(off + n, LEN_MASK);
	}
	return off;
}

/* The flat buffer `src`: `limit` bytes, as data_begin was given. */
static __always_inline int data_flat(struct data_out *o, struct tt_data_event *e, __u64 src, __u32 limit)
{
	if (data_direct()) {
		__u32 captured = limit;
		if (limit && bpf_probe_read_user_dynptr(&o->dp, DATA_HDR, limit, (void *)src))
			captured = 0;
		return submit_direct(o, e, captured);
	}
	return submit_staged(o->s, copy_flat(o->s->payload, src, limit));
}

/* Iovecs the direct walk copies inline, without bpf_loop: a response
 * chunk is a few iovecs (node's writev: size line, CRLF, event, CRLF), and
 * a bpf_loop call, its callback per iovec and the walk's context on the
 * stack cost more than the copies' own setup (perf of the node flood: a
 * third of on_send_length's own time went to the walk). They are also the
 * pieces a record can gather (TT_GATHER_SEGS). */
#define IOV_INLINE TT_GATHER_SEGS

/* Where the iovec array is: user memory (the syscall's own argument), or
 * the kernel's copy of it (`kernel_iov`: the send's msghdr, taken by
 * on_sendmsg_locked), read by plain loads instead of one more user copy. */
struct iov_src {
	__u64 ptr;
	bool kernel;
};

/* The iovec `i` of `src` (false: unreadable). */
static __always_inline bool iov_at(struct iov_src src, __u32 i, struct iovec *v)
{
	const struct iovec *iov = (const struct iovec *)src.ptr + i;

	if (src.kernel) {
		if (!direct_reads())
			return false;
		const struct iovec *k = bpf_core_cast(iov, struct iovec);
		v->iov_base = k->iov_base;
		v->iov_len = k->iov_len;
		return true;
	}
	return !bpf_probe_read_user(v, sizeof(*v), iov);
}

/* The walk past the inline iovecs, one bpf_loop step per iovec (the
 * verifier checks the callback's body once, not once per iovec and per
 * path of the program that reaches it; an inline walk of them all added
 * ~90 ms of verification at start). `off` counts payload bytes (against
 * `limit`), `at` is where the next ones go in data[] (behind `off` by what
 * the inline pieces gathered). */
struct iov_walk {
	struct data_out *o;
	struct iov_src src;
	__u32 limit;
	__u32 off;
	__u32 at;
};

static long iov_step(__u64 i, struct iov_walk *w)
{
	struct iovec v;

	if (w->off >= w->limit || !iov_at(w->src, IOV_INLINE + i, &v))
		return 1;
	__u32 n = w->limit - w->off;
	if (v.iov_len < n)
		n = v.iov_len;
	if (bpf_probe_read_user_dynptr(&w->o->dp, DATA_HDR + w->at, n, v.iov_base))
		return 1;
	w->off += n;
	w->at += n;
	return 0;
}

/* The inline pieces of a direct walk: the first IOV_INLINE iovecs of
 * `batch`, each cut to the bytes left of `limit`. A user copy costs far
 * more to set up than to move a few bytes (two thirds of on_send_length
 * under the node flood), so pieces that start inside or right where an
 * earlier window of user memory ends join it, and each window is read
 * once: node's size line and event share one buffer and its two CRLFs are
 * one static, so 4 copies become 2. The windows are kept in batch[]
 * itself (window w is opened by piece i >= w, after that piece was read).
 * Where no piece joined another, data[] is the payload in order, as
 * without gathering. Returns the bytes placed in data[]; `*off` the
 * payload bytes they stand for. */
static __always_inline __u32 gather_inline(struct data_out *o, struct tt_data_event *e,
					   struct iovec *batch, __u32 first, __u32 limit, __u32 *off)
{
	__u32 pieces = 0, windows = 0;
	/* 2 bits per piece: its window. */
	__u32 owner = 0;

	for (int i = 0; i < IOV_INLINE; i++) {
		if (i >= first || *off >= limit)
			break;
		__u64 base = (__u64)batch[i].iov_base;
		__u32 n = limit - *off;
		if (batch[i].iov_len < n)
			n = batch[i].iov_len;
		__u32 w = windows, rel = 0;
		for (int j = 0; j < i; j++) {
			__u64 start = (__u64)batch[j].iov_base;
			if (j < windows && base >= start && base - start <= batch[j].iov_len) {
				w = j;
				rel = base - start;
				if (rel + n > batch[j].iov_len)
					batch[j].iov_len = rel + n;
				break;
			}
		}
		if (w == windows) {
			for (int j = 0; j <= i; j++)
				if (j == windows) {
					batch[j].iov_base = (void *)base;
					batch[j].iov_len = n;
				}
			windows++;
		}
		owner |= w << (2 * i);
		e->gather_off[i] = rel;
		e->gather_len[i] = n;
		*off += n;
		pieces = i + 1;
	}
	bool gathered = windows < pieces;
	__u32 at = 0;

	for (int w = 0; w < IOV_INLINE; w++) {
		if (w >= windows)
			break;
		if (bpf_probe_read_user_dynptr(&o->dp, DATA_HDR + at, batch[w].iov_len, batch[w].iov_base)) {
			/* The pieces before this window's first one are whole. */
			if (gathered) {
				__u32 whole = 0;
				while (whole < pieces && ((owner >> (2 * whole)) & 3) < w)
					whole++;
				e->gather_segs = whole;
				e->gather_tail = at;
			}
			*off = limit;
			return at;
		}
		at += batch[w].iov_len;
	}
	if (!gathered)
		return at;
	/* Each piece's offset in its window, plus where the window starts. */
	for (int i = 0; i < IOV_INLINE; i++) {
		if (i >= pieces)
			break;
		__u32 w = (owner >> (2 * i)) & 3;
		for (int j = 0; j < IOV_INLINE; j++)
			if (j < w)
				e->gather_off[i] += batch[j].iov_len;
	}
	e->gather_segs = pieces;
	e->gather_tail = at;
	return at;
}

/* The iovec array `iov_ptr` of `iovcnt` entries (in the kernel's memory
 * when `kernel_iov`), up to `limit` bytes (the bytes moved, capped by
 * capture_bytes). `loop`: the kernel has bpf_loop (5.17+; the agent loads
 * this program's `_compat` twin otherwise, which holds no bpf_loop
 * callback for older kernels to refuse). `kernel_iov` only where the
 * record is direct. */
static __always_inline int data_iov(struct data_out *o, struct tt_data_event *e, __u64 iov_ptr, __u32 iovcnt,
				    __u32 limit, const bool loop, bool kernel_iov)
{
	if (!loop || !data_direct())
		return submit_staged(o->s, copy_iov(o->s->payload, iov_ptr, iovcnt, limit));
	struct iov_src src = { .ptr = iov_ptr, .kernel = kernel_iov };
	__u32 first = iovcnt < IOV_INLINE ? iovcnt : IOV_INLINE;
	__u32 off = 0, at;

	/* Its own scope, so that the walk context below can reuse its stack
	 * (the syscall hooks' exit program has 512 bytes for all its frames
	 * on kernels without private stacks). */
	{
		struct iovec batch[IOV_INLINE] = {};

		/* A helper's copy even from the kernel's array: plain loads
		 * would type the bases as pointers, and the verifier refuses
		 * the window arithmetic on them. */
		long err = kernel_iov ? bpf_probe_read_kernel(batch, first * sizeof(struct iovec), (void *)iov_ptr)
				      : bpf_probe_read_user(batch, first * sizeof(struct iovec), (void *)iov_ptr);
		if (err)
			return submit_direct(o, e, 0);
		at = gather_inline(o, e, batch, first, limit, &off);
	}
	if (iovcnt > IOV_INLINE && off < limit) {
		struct iov_walk w = { .o = o, .src = src, .limit = limit, .off = off, .at = at };
		__u32 rest = (iovcnt < MAX_IOV ? iovcnt : MAX_IOV) - IOV_INLINE;

		bpf_loop(rest, iov_step, &w, 0);
		at = w.at;
	}
	return submit_direct(o, e, at);
}

#endif /* TOKENTRACE_DATA_RECORD_BPF_H */
