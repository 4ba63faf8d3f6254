// SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0
/*
 * gw_dctcp: Data Center TCP (RFC 8257) as a BPF struct_ops TCP congestion
 * control, written from the RFC for gradwire's baselines (this kernel has no
 * tcp_dctcp module). Registered by src/tcp_cc.rs; sockets select it with
 * setsockopt(TCP_CONGESTION, "gw_dctcp").
 *
 * Sender (RFC 8257 §3.3), on every ACK (in_ack_event):
 *   BytesAcked += newly acked bytes; BytesMarked += them too if ECE is set;
 *   once SND.UNA passes WindowEnd (about one RTT):
 *     M = BytesMarked / BytesAcked, Alpha = (1 - g) * Alpha + g * M,
 *     WindowEnd = SND.NXT, counters reset.
 *   On ECE the kernel enters CWR (once per window of data, RFC 3168) and asks
 *   ssthresh, which answers cwnd * (1 - Alpha / 2).
 * Window growth (§3.4): standard slow start and congestion avoidance, the
 *   kernel's tcp_reno_cong_avoid (a kfunc).
 * Loss (§3.5): like conventional TCP. ssthresh cannot tell ECE from loss, so
 *   set_state, called when the socket enters fast recovery or RTO recovery
 *   right after ssthresh, replaces the Alpha-based value by half the window.
 * Receiver (§3.2): ECE is set on an ACK iff the last segment received was
 *   CE-marked (the kernel's RFC 3168 receiver would latch ECE until CWR). On a
 *   change of that state a delayed ACK still owed for the earlier segments is
 *   sent at once with the old state, so the sender counts marks exactly.
 *
 * TCP_CONG_NEEDS_ECN makes every socket using it request ECN on connect
 * whatever net.ipv4.tcp_ecn says, send ECT on all packets (pure ACKs and
 * retransmissions included, as §3.1 wants) and report the receiver events.
 *
 * Kernel types are declared below with only the fields used and
 * preserve_access_index: libbpf relocates every field access against the
 * running kernel's BTF at load time, so the build needs no vmlinux.h.
 *
 * License: struct_ops programs and the kfuncs they call load only with a
 * GPL-compatible license string, so this file (alone in the project) is
 * dual-licensed and declares "GPL" to the kernel.
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "dctcp.h"

/* include/net/tcp.h, include/net/inet_connection_sock.h: stable values. */
#define TCP_CONG_NEEDS_ECN 0x2
#define TCP_ECN_OK 0x1 /* RFC 3168 ECN negotiated */
#define TCP_ECN_DEMAND_CWR 0x4 /* set ECE on outgoing ACKs */
#define ICSK_ACK_TIMER 0x2 /* a delayed ACK is scheduled */
#define CA_ACK_ECE 0x4
#define CA_EVENT_ECN_NO_CE 4
#define CA_EVENT_ECN_IS_CE 5
#define TCP_CA_RECOVERY 3
#define TCP_CA_LOSS 4

/* Only pointed to; a complete (empty) type, because libbpf checks the kfunc's
 * prototype against the kernel's and a forward declaration does not match. */
struct sock {
} __attribute__((preserve_access_index));

struct inet_connection_sock {
	struct {
		__u8 pending;
	} icsk_ack;
	__u64 icsk_ca_priv[13];
} __attribute__((preserve_access_index));

struct tcp_sock {
	__u32 snd_cwnd;
	__u32 snd_ssthresh;
	__u32 snd_una;
	__u32 snd_nxt;
	__u32 rcv_nxt;
	__u8 ecn_flags;
} __attribute__((preserve_access_index));

/* Matched by name against the kernel's struct by libbpf. */
struct tcp_congestion_ops {
	__u32 (*ssthresh)(struct sock *sk);
	void (*cong_avoid)(struct sock *sk, __u32 ack, __u32 acked);
	void (*set_state)(struct sock *sk, __u8 new_state);
	void (*cwnd_event)(struct sock *sk, int ev);
	void (*in_ack_event)(struct sock *sk, __u32 flags);
	__u32 (*undo_cwnd)(struct sock *sk);
	void (*init)(struct sock *sk);
	__u32 flags;
	char name[16];
};

extern void tcp_reno_cong_avoid(struct sock *sk, __u32 ack, __u32 acked) __ksym;

/* Per-connection state, in the socket's icsk_ca_priv (104 bytes). */
struct gw_dctcp {
	__u32 alpha; /* DCTCP.Alpha, a fraction of GW_DCTCP_ALPHA_ONE */
	__u32 window_end; /* DCTCP.WindowEnd */
	__u32 bytes_acked; /* DCTCP.BytesAcked of this window */
	__u32 bytes_marked; /* DCTCP.BytesMarked of this window */
	__u32 prior_snd_una; /* SND.UNA at the previous ACK */
	__u32 loss_cwnd; /* cwnd when the last reduction was computed */
	__u32 prior_rcv_nxt; /* receiver: RCV.NXT before the latest segment */
	__u32 ce; /* receiver: DCTCP.CE */
};

_Static_assert(sizeof(struct gw_dctcp) <= 13 * sizeof(__u64), "fits icsk_ca_priv");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct gw_dctcp_sock_stats);
} gw_dctcp_socks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, GW_DCTCP_NUM_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} gw_dctcp_totals SEC(".maps");

static __always_inline struct tcp_sock *tcp_of(struct sock *sk)
{
	/* The kernel hands every struct_ops TCP CC a tcp_sock. */
	return (struct tcp_sock *)sk;
}

static __always_inline struct gw_dctcp *ca_of(struct sock *sk)
{
	return (struct gw_dctcp *)((struct inet_connection_sock *)sk)->icsk_ca_priv;
}

static __always_inline struct gw_dctcp_sock_stats *stats_of(struct sock *sk)
{
	return bpf_sk_storage_get(&gw_dctcp_socks, sk, NULL, 0);
}

static __always_inline void count(struct gw_dctcp_sock_stats *st, __u32 idx, __u64 n)
{
	__u64 *total = bpf_map_lookup_elem(&gw_dctcp_totals, &idx);

	if (total)
		__sync_fetch_and_add(total, n);
	if (st && idx < GW_DCTCP_NUM_COUNTERS)
		st->count[idx] += n;
}

static __always_inline int after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

SEC("struct_ops/gw_dctcp_init")
void BPF_PROG(gw_dctcp_init, struct sock *sk)
{
	struct tcp_sock *tp = tcp_of(sk);
	struct gw_dctcp *ca = ca_of(sk);
	struct gw_dctcp_sock_stats *st;

	/* The initial Alpha is the implementation's choice (RFC 8257 §4): 1 is
	 * the conservative one, a full halving on the first ECE. */
	ca->alpha = GW_DCTCP_ALPHA_ONE;
	ca->window_end = tp->snd_nxt;
	ca->bytes_acked = 0;
	ca->bytes_marked = 0;
	ca->prior_snd_una = tp->snd_una;
	ca->loss_cwnd = 0;
	ca->prior_rcv_nxt = tp->rcv_nxt;
	ca->ce = 0;

	st = bpf_sk_storage_get(&gw_dctcp_socks, sk, NULL, BPF_SK_STORAGE_GET_F_CREATE);
	if (st) {
		st->alpha = ca->alpha;
		st->ecn_flags = tp->ecn_flags;
	}
	count(st, GW_DCTCP_SOCKETS, 1);
}

/* RFC 8257 §3.3: per-ACK accounting and the per-window Alpha update. */
SEC("struct_ops/gw_dctcp_in_ack_event")
void BPF_PROG(gw_dctcp_in_ack_event, struct sock *sk, __u32 flags)
{
	struct tcp_sock *tp = tcp_of(sk);
	struct gw_dctcp *ca = ca_of(sk);
	struct gw_dctcp_sock_stats *st = stats_of(sk);
	__u32 snd_una = tp->snd_una;
	__u32 acked = snd_una - ca->prior_snd_una;
	__u64 m;

	/* An old or reordered ACK acknowledges nothing new. */
	if (!after(snd_una, ca->prior_snd_una))
		acked = 0;
	else
		ca->prior_snd_una = snd_una;

	ca->bytes_acked += acked;
	count(st, GW_DCTCP_ACKED_BYTES, acked);
	if (flags & CA_ACK_ECE) {
		ca->bytes_marked += acked;
		count(st, GW_DCTCP_MARKED_BYTES, acked);
	}
	if (st)
		st->ecn_flags = tp->ecn_flags;

	if (!after(snd_una, ca->window_end))
		return;

	/* End of the observation window. M as a fraction of ALPHA_ONE. */
	m = 0;
	if (ca->bytes_acked)
		m = ((__u64)ca->bytes_marked << GW_DCTCP_ALPHA_SHIFT) / ca->bytes_acked;
	ca->alpha = ca->alpha - (ca->alpha >> GW_DCTCP_G_SHIFT) +
		    (__u32)(m >> GW_DCTCP_G_SHIFT);
	if (ca->alpha > GW_DCTCP_ALPHA_ONE)
		ca->alpha = GW_DCTCP_ALPHA_ONE;
	ca->window_end = tp->snd_nxt;
	count(st, GW_DCTCP_WINDOWS, 1);
	if (ca->bytes_marked)
		count(st, GW_DCTCP_MARKED_WINDOWS, 1);
	ca->bytes_acked = 0;
	ca->bytes_marked = 0;
	if (st)
		st->alpha = ca->alpha;
}

/* New slow-start threshold on ECE (CWR) or loss: cwnd * (1 - Alpha / 2). */
SEC("struct_ops/gw_dctcp_ssthresh")
__u32 BPF_PROG(gw_dctcp_ssthresh, struct sock *sk)
{
	struct tcp_sock *tp = tcp_of(sk);
	struct gw_dctcp *ca = ca_of(sk);
	__u32 cwnd = tp->snd_cwnd;
	__u32 cut = (__u32)(((__u64)cwnd * ca->alpha) >> (GW_DCTCP_ALPHA_SHIFT + 1));

	ca->loss_cwnd = cwnd;
	count(stats_of(sk), GW_DCTCP_REDUCTIONS, 1);
	return cwnd - cut > 2 ? cwnd - cut : 2;
}

/* RFC 8257 §3.5: a loss (fast recovery or RTO) halves the window like
 * conventional TCP, replacing the Alpha-based threshold just computed. */
SEC("struct_ops/gw_dctcp_set_state")
void BPF_PROG(gw_dctcp_set_state, struct sock *sk, __u8 new_state)
{
	struct tcp_sock *tp = tcp_of(sk);
	struct gw_dctcp *ca = ca_of(sk);
	__u32 half;

	if (new_state != TCP_CA_RECOVERY && new_state != TCP_CA_LOSS)
		return;
	if (!ca->loss_cwnd)
		return;
	half = ca->loss_cwnd >> 1;
	tp->snd_ssthresh = half > 2 ? half : 2;
	count(stats_of(sk), GW_DCTCP_LOSS_EPISODES, 1);
}

/* RFC 8257 §3.2, for every data segment the socket receives. */
static __always_inline void ce_state(struct sock *sk, __u32 ce)
{
	struct tcp_sock *tp = tcp_of(sk);
	struct gw_dctcp *ca = ca_of(sk);
	struct inet_connection_sock *icsk = (struct inet_connection_sock *)sk;

	if (ca->ce != ce) {
		struct gw_dctcp_sock_stats *st = stats_of(sk);

		/* A delayed ACK is still owed for the segments before this one:
		 * send it now, while ECE still says what they carried. */
		if (icsk->icsk_ack.pending & ICSK_ACK_TIMER) {
			bpf_tcp_send_ack(tp, ca->prior_rcv_nxt);
			count(st, GW_DCTCP_FLIP_ACKS, 1);
		}
		ca->ce = ce;
		count(st, GW_DCTCP_CE_FLIPS, 1);
	}
	/* Every following ACK echoes this segment's state. Written on every
	 * segment: the kernel clears DEMAND_CWR when a CWR arrives. */
	if (ce)
		tp->ecn_flags |= TCP_ECN_DEMAND_CWR;
	else
		tp->ecn_flags &= ~TCP_ECN_DEMAND_CWR;
	ca->prior_rcv_nxt = tp->rcv_nxt;
}

SEC("struct_ops/gw_dctcp_cwnd_event")
void BPF_PROG(gw_dctcp_cwnd_event, struct sock *sk, int ev)
{
	if (ev == CA_EVENT_ECN_IS_CE)
		ce_state(sk, 1);
	else if (ev == CA_EVENT_ECN_NO_CE)
		ce_state(sk, 0);
}

/* A reduction found spurious (e.g. by DSACK) is undone. */
SEC("struct_ops/gw_dctcp_undo_cwnd")
__u32 BPF_PROG(gw_dctcp_undo_cwnd, struct sock *sk)
{
	struct tcp_sock *tp = tcp_of(sk);
	struct gw_dctcp *ca = ca_of(sk);

	return tp->snd_cwnd > ca->loss_cwnd ? tp->snd_cwnd : ca->loss_cwnd;
}

SEC("struct_ops/gw_dctcp_cong_avoid")
void BPF_PROG(gw_dctcp_cong_avoid, struct sock *sk, __u32 ack, __u32 acked)
{
	tcp_reno_cong_avoid(sk, ack, acked);
}

/* Registration belongs to the bpf_link (".struct_ops.link"): closing it, also
 * by the process dying, unregisters the congestion control. */
SEC(".struct_ops.link")
struct tcp_congestion_ops gw_dctcp = {
	.init = (void *)gw_dctcp_init,
	.in_ack_event = (void *)gw_dctcp_in_ack_event,
	.ssthresh = (void *)gw_dctcp_ssthresh,
	.set_state = (void *)gw_dctcp_set_state,
	.cwnd_event = (void *)gw_dctcp_cwnd_event,
	.undo_cwnd = (void *)gw_dctcp_undo_cwnd,
	.cong_avoid = (void *)gw_dctcp_cong_avoid,
	.flags = TCP_CONG_NEEDS_ECN,
	.name = GW_DCTCP_NAME,
};

char LICENSE[] SEC("license") = "GPL";
