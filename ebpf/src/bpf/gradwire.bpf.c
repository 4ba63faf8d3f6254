// SPDX-License-Identifier: Apache-2.0
/*
 * gradwire XDP classifier.
 *
 * Finds gradwire packets (UDP to one of the configured destination ports,
 * over IPv4 or IPv6, with at most one 802.1Q/802.1ad tag), drops malformed
 * ones, counts them per (DSCP, ECN), applies the optional allowlist and fault
 * injection, and redirects the rest to the AF_XDP socket of their receive
 * queue. Everything else goes to the kernel untouched (XDP_PASS), so ssh,
 * ARP and the TCP control channel keep working with the program attached.
 *
 * In switch-port mode (config.switch_port, used by the emulated switch) every
 * frame goes to the queue's AF_XDP socket, counted SWITCHED, and nothing
 * below applies.
 *
 * Order of decisions for a gradwire packet (see README.md):
 *   1. count GRADWIRE
 *   2. length checks          -> XDP_DROP, DROP_TRUNCATED (not in `classes`)
 *   3. count `classes`[tos]   (what arrived on the wire, well-formed)
 *   4. allowlist              -> XDP_DROP, DROP_NOT_ALLOWED
 *   5. fault injection        -> XDP_DROP, DROP_FAULT
 *   6. bpf_redirect_map       -> XDP_REDIRECT, REDIRECTED
 *                                or XDP_PASS, TO_KERNEL (no socket on queue)
 *
 * Lengths are compared as integers (offsets from the frame start and the
 * frame length from bpf_xdp_get_buff_len()) rather than by subtracting packet
 * pointers, and a UDP header behind IPv4 options is read with
 * bpf_xdp_load_bytes() rather than through a pointer at a variable offset:
 * the verifier allows both pointer operations only with CAP_PERFMON, and the
 * program must load with just CAP_BPF + CAP_NET_ADMIN. Both helpers need
 * Linux 5.18 or newer.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "gradwire.h"

/* Not in the uapi headers (include/net/ip.h, include/linux/if_vlan.h). */
#define GW_IP_MF 0x2000
#define GW_IP_OFFSET 0x1FFF

struct gw_vlan_hdr {
	__be16 tci;
	__be16 encapsulated_proto;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gw_config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, GW_MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, GW_ALLOWLIST_MAX);
	__type(key, struct gw_addr_key);
	__type(value, struct gw_allow_value);
} allowlist SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, GW_NUM_DSCP);
	__type(key, __u32);
	__type(value, struct gw_fault_prob);
} fault SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, GW_NUM_CLASSES);
	__type(key, __u32);
	__type(value, struct gw_counter);
} classes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, GW_CNT_MAX);
	__type(key, __u32);
	__type(value, struct gw_counter);
} globals SEC(".maps");

static __always_inline void count(void *map, __u32 idx, __u64 bytes)
{
	struct gw_counter *c = bpf_map_lookup_elem(map, &idx);

	/* Per-CPU values: plain adds, no atomics needed. */
	if (c) {
		c->packets += 1;
		c->bytes += bytes;
	}
}

static __always_inline int port_match(const struct gw_config *cfg, __u16 port)
{
	/* port 0 never matches: it marks unused slots. */
	if (port == 0)
		return 0;
#pragma unroll
	for (int i = 0; i < GW_MAX_PORTS; i++) {
		if (cfg->ports[i] == port)
			return 1;
	}
	return 0;
}

SEC("xdp")
int gradwire_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 frame_len = bpf_xdp_get_buff_len(ctx);
	struct gw_addr_key src;
	struct gw_config *cfg;
	struct udphdr *udp;
	struct udphdr udph; /* copy: the IPv4-options path reads it with a helper */
	__u32 zero = 0;
	__u64 l3_off = sizeof(struct ethhdr);
	__u64 udp_off;
	__u32 ip_payload; /* bytes the IP header says follow it */
	__u32 udp_len;
	int ip_bad = 0; /* IP length fields contradict the frame */
	__u8 tos;
	__be16 proto;
	void *l3;

	cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg || !cfg->enabled)
		goto pass;

	if (cfg->switch_port) {
		/* An emulated switch forwards everything (ARP, TCP, gradwire);
		 * it parses and counts in user space. */
		long sw = bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);

		count(&globals, GW_CNT_SWITCHED, frame_len);
		return sw;
	}

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		goto pass;
	proto = eth->h_proto;
	l3 = eth + 1;

	if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD)) {
		struct gw_vlan_hdr *vh = l3;

		if ((void *)(vh + 1) > data_end)
			goto pass;
		proto = vh->encapsulated_proto;
		l3 = vh + 1;
		l3_off += sizeof(struct gw_vlan_hdr);
		/* A second tag (QinQ) falls through to "not IP" below. */
	}

	__builtin_memset(&src, 0, sizeof(src));

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;
		__u32 hlen, tot_len;

		if ((void *)(ip + 1) > data_end)
			goto pass;
		/* Malformed IP is the kernel's to drop and count. */
		if (ip->version != 4 || ip->ihl < 5)
			goto pass;
		if (ip->protocol != IPPROTO_UDP)
			goto pass;
		/* Any fragment: the port is unknown or the datagram incomplete;
		 * gradwire never sends fragments, the kernel reassembles. */
		if (ip->frag_off & bpf_htons(GW_IP_MF | GW_IP_OFFSET))
			goto pass;
		hlen = ip->ihl * 4;
		udp_off = l3_off + hlen;
		if (hlen == sizeof(struct iphdr)) {
			udp = (void *)(ip + 1);
			if ((void *)(udp + 1) > data_end)
				goto pass;
			udph = *udp;
		} else if (bpf_xdp_load_bytes(ctx, udp_off, &udph, sizeof(udph))) {
			/* IPv4 options: the UDP header is at a variable offset.
			 * Packet pointer + variable offset needs CAP_PERFMON
			 * in the verifier, a helper copy does not. Fails when
			 * the frame ends before the UDP header. */
			goto pass;
		}
		tot_len = bpf_ntohs(ip->tot_len);
		if (tot_len < hlen + sizeof(struct udphdr) || tot_len > frame_len - l3_off) {
			ip_bad = 1;
			ip_payload = 0;
		} else {
			ip_payload = tot_len - hlen;
		}
		tos = ip->tos;
		src.family = GW_FAMILY_IPV4;
		__builtin_memcpy(src.addr, &ip->saddr, 4);
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;
		__u32 plen;

		if ((void *)(ip6 + 1) > data_end)
			goto pass;
		if (ip6->version != 6)
			goto pass;
		/* Extension headers (and jumbograms, which need one): kernel. */
		if (ip6->nexthdr != IPPROTO_UDP)
			goto pass;
		udp = (void *)(ip6 + 1);
		if ((void *)(udp + 1) > data_end)
			goto pass;
		udph = *udp;
		udp_off = l3_off + sizeof(struct ipv6hdr);
		plen = bpf_ntohs(ip6->payload_len);
		if (plen < sizeof(struct udphdr) ||
		    plen > frame_len - l3_off - sizeof(struct ipv6hdr)) {
			ip_bad = 1;
			ip_payload = 0;
		} else {
			ip_payload = plen;
		}
		tos = (ip6->priority << 4) | (ip6->flow_lbl[0] >> 4);
		src.family = GW_FAMILY_IPV6;
		__builtin_memcpy(src.addr, &ip6->saddr, 16);
	} else {
		goto pass;
	}

	if (!port_match(cfg, bpf_ntohs(udph.dest)))
		goto pass;

	/* From here on the packet is gradwire. */
	count(&globals, GW_CNT_GRADWIRE, frame_len);

	udp_len = bpf_ntohs(udph.len);
	if (ip_bad || udp_len < sizeof(struct udphdr) + GW_HDR_LEN || udp_len > ip_payload ||
	    udp_len > frame_len - udp_off) {
		count(&globals, GW_CNT_DROP_TRUNCATED, frame_len);
		return XDP_DROP;
	}

	/* tos is the DS field: dscp << 2 | ecn, i.e. the class index. Counted
	 * before allowlist and fault injection: the table shows what arrived. */
	count(&classes, tos, frame_len);

	if (cfg->allowlist_enabled && !bpf_map_lookup_elem(&allowlist, &src)) {
		count(&globals, GW_CNT_DROP_NOT_ALLOWED, frame_len);
		return XDP_DROP;
	}

	__u32 dscp = tos >> 2;
	struct gw_fault_prob *fp = bpf_map_lookup_elem(&fault, &dscp);

	if (fp && fp->prob &&
	    (fp->prob == GW_FAULT_ALWAYS || bpf_get_prandom_u32() < fp->prob)) {
		count(&globals, GW_CNT_DROP_FAULT, frame_len);
		return XDP_DROP;
	}

	/* Without a socket in the queue's slot the helper returns the fallback
	 * (XDP_PASS): the kernel UDP path still works with the program loaded. */
	long act = bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);

	count(&globals, act == XDP_REDIRECT ? GW_CNT_REDIRECTED : GW_CNT_TO_KERNEL, frame_len);
	return act;

pass:
	count(&globals, GW_CNT_PASSED, frame_len);
	return XDP_PASS;
}

/* No GPL-only helpers are used, so the project's license applies. */
char LICENSE[] SEC("license") = "Apache-2.0";
