/* SPDX-License-Identifier: Apache-2.0 */
/*
 * gradwire XDP classifier: the one header shared by the BPF program
 * (gradwire.bpf.c) and the Rust loader (src/lib.rs).
 *
 * Every map key and value is a struct or scalar defined here. The Rust side
 * does not hand-copy these layouts: build.rs generates Rust structs from the
 * BTF that clang emits for this header (libbpf-cargo's skeleton `types`), and
 * the loader fills map values through `offset_of!` on those structs, so a
 * field added or moved here is picked up (or fails to compile) in Rust.
 *
 * Constants (capacities, counter indices) are enumerators written one per line
 * as `GW_NAME = value,`: build.rs turns every such line into a Rust `const`
 * (clang emits no BTF for enums that no declaration uses), and the loader
 * checks the capacities against the maps' max_entries when it loads the
 * object.
 *
 * Only fixed-width __u8/__u16/__u32/__u64 fields, laid out without implicit
 * padding, so that the layout is the same for the BPF target and the host.
 */
#ifndef GRADWIRE_BPF_H
#define GRADWIRE_BPF_H

#include <linux/types.h>

enum gw_limits {
	/* UDP destination ports that mark a packet as gradwire traffic. */
	GW_MAX_PORTS = 8,
	/* XSKMAP slots: one AF_XDP socket per receive queue. */
	GW_MAX_QUEUES = 64,
	/* DSCP codepoints (6 bits). */
	GW_NUM_DSCP = 64,
	/* (DSCP, ECN) pairs: index = dscp * 4 + ecn, i.e. the IPv4 TOS /
	 * IPv6 traffic-class byte itself. */
	GW_NUM_CLASSES = 256,
	/* Allowlisted peer source addresses. */
	GW_ALLOWLIST_MAX = 4096,
	/* Length of the gradwire transport header that follows UDP. */
	GW_HDR_LEN = 32,
	/* gw_addr_key.family values. */
	GW_FAMILY_IPV4 = 4,
	GW_FAMILY_IPV6 = 6,
	/* gw_fault_prob value meaning "drop every packet". */
	GW_FAULT_ALWAYS = 0xFFFFFFFF,
};

/* Index into the `globals` PERCPU_ARRAY. Invariant (per CPU, hence in sum):
 *   GRADWIRE = DROP_TRUNCATED + DROP_NOT_ALLOWED + DROP_FAULT
 *            + REDIRECTED + TO_KERNEL
 * and every packet the program sees is exactly one of GRADWIRE, PASSED and
 * SWITCHED. */
enum gw_counter_index {
	/* UDP to a configured port (whatever happened next). */
	GW_CNT_GRADWIRE = 0,
	/* gradwire, handed to the AF_XDP socket of its queue (XDP_REDIRECT). */
	GW_CNT_REDIRECTED = 1,
	/* gradwire, but no socket registered for the queue: XDP_PASS, the
	 * kernel UDP stack gets it. */
	GW_CNT_TO_KERNEL = 2,
	/* not gradwire (or classifier disabled): XDP_PASS untouched. */
	GW_CNT_PASSED = 3,
	/* gradwire with inconsistent/short lengths: XDP_DROP. */
	GW_CNT_DROP_TRUNCATED = 4,
	/* gradwire from a source not in the allowlist: XDP_DROP. */
	GW_CNT_DROP_NOT_ALLOWED = 5,
	/* gradwire dropped by fault injection: XDP_DROP. */
	GW_CNT_DROP_FAULT = 6,
	/* switch-port mode: any frame, handed to the AF_XDP socket of its
	 * queue (or XDP_PASS when the queue has none). */
	GW_CNT_SWITCHED = 7,
	GW_CNT_MAX = 8,
};

/* `config` ARRAY map, one entry (key 0). */
struct gw_config {
	/* 0: the program passes everything (counted as PASSED). */
	__u32 enabled;
	/* 1: gradwire packets whose source is not in `allowlist` are dropped. */
	__u32 allowlist_enabled;
	/* 1: switch-port mode for the emulated switch (fabric/): every frame,
	 * whatever its protocol, goes to the AF_XDP socket of its queue, counted
	 * SWITCHED and nothing else; no classification, allowlist or faults. */
	__u32 switch_port;
	/* Host byte order; 0 = unused slot. */
	__u16 ports[GW_MAX_PORTS];
};

/* `allowlist` HASH map key (value: gw_allow_value). All bytes are
 * significant for hashing: IPv4 addresses use addr[0..4] and leave
 * addr[4..16] zero. */
struct gw_addr_key {
	__u32 family; /* GW_FAMILY_IPV4 or GW_FAMILY_IPV6 */
	__u8 addr[16]; /* network byte order */
};

struct gw_allow_value {
	__u32 reserved; /* presence of the key is what matters */
};

/* `fault` ARRAY map, GW_NUM_DSCP entries indexed by DSCP: drop probability
 * scaled to 2^32: 0 = never, GW_FAULT_ALWAYS = always, otherwise p / 2^32. */
struct gw_fault_prob {
	__u32 prob;
};

/* Value of the `classes` (GW_NUM_CLASSES) and `globals` (GW_CNT_MAX)
 * PERCPU_ARRAY maps. bytes = frame length seen by XDP (L2 header to the end
 * of the frame, no FCS). */
struct gw_counter {
	__u64 packets;
	__u64 bytes;
};

#endif /* GRADWIRE_BPF_H */
