/* SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0 */
/*
 * Layout of gw_dctcp's maps, shared by src/bpf/dctcp.bpf.c and the Rust loader
 * (src/tcp_cc.rs). build.rs turns every `GW_DCTCP_X = value,` line below into a
 * Rust constant, so the indices are defined once.
 */
#ifndef GW_DCTCP_H
#define GW_DCTCP_H

#include <linux/types.h>

/* Name of the congestion control (TCP_CA_NAME_MAX is 16 with the NUL). */
#define GW_DCTCP_NAME "gw_dctcp"

/* DCTCP.Alpha as a fixed-point fraction: 1.0 is 1 << GW_DCTCP_ALPHA_SHIFT. */
enum {
	GW_DCTCP_ALPHA_SHIFT = 16,
	GW_DCTCP_ALPHA_ONE = 0x10000,
	/* Estimation gain g = 1 / (1 << GW_DCTCP_G_SHIFT) = 1/16 (RFC 8257 §4). */
	GW_DCTCP_G_SHIFT = 4,
};

/* Counters, per socket (sk storage) and summed over all sockets (per-CPU array). */
enum {
	/* Sockets that started using gw_dctcp (init). */
	GW_DCTCP_SOCKETS = 0,
	/* Bytes newly acknowledged (SND.UNA advances), DCTCP.BytesAcked summed. */
	GW_DCTCP_ACKED_BYTES = 1,
	/* Of those, acknowledged by an ACK with ECE set: DCTCP.BytesMarked summed. */
	GW_DCTCP_MARKED_BYTES = 2,
	/* Observation windows closed (DCTCP.Alpha updates). */
	GW_DCTCP_WINDOWS = 3,
	/* Windows with a marked byte (M > 0). */
	GW_DCTCP_MARKED_WINDOWS = 4,
	/* Window reductions computed (ssthresh), on ECE or on loss. */
	GW_DCTCP_REDUCTIONS = 5,
	/* Entries into fast recovery or RTO loss recovery (conventional halving). */
	GW_DCTCP_LOSS_EPISODES = 6,
	/* Receiver: CE state changes of arriving segments (DCTCP.CE flips). */
	GW_DCTCP_CE_FLIPS = 7,
	/* Receiver: immediate ACKs sent for the segments before a flip. */
	GW_DCTCP_FLIP_ACKS = 8,
	GW_DCTCP_NUM_COUNTERS = 9,
};

/* Value of the per-socket storage. */
struct gw_dctcp_sock_stats {
	__u64 count[GW_DCTCP_NUM_COUNTERS];
	/* DCTCP.Alpha now, a fraction of GW_DCTCP_ALPHA_ONE. */
	__u32 alpha;
	/* The socket's tcp_sock.ecn_flags at the last ACK (bit 0: ECN in use). */
	__u32 ecn_flags;
};

#endif
