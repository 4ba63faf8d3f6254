/*
 * One rank of a gradwire job, in C: set up through gradwire's rendezvous, all-reduce a float
 * array and check the exact sum, broadcast from rank 0, barrier, then DLCP's send of one
 * tensor from rank 0 to rank 1 with a priority function that tags segments by gradient
 * magnitude. Exits non-zero with gradwire's message on any error.
 *
 * Build (after scripts/capi.sh, which prints the PKG_CONFIG_PATH to use):
 *   gcc allreduce.c $(pkg-config --cflags --libs gradwire) -o allreduce         (shared)
 *   gcc allreduce.c $(pkg-config --cflags --libs gradwire-static) -o allreduce  (static)
 * A shared build finds libgradwire_c.so through LD_LIBRARY_PATH or an rpath
 * (-Wl,-rpath,$(pkg-config --variable=libdir gradwire)); the Makefile adds the rpath.
 *
 * Run one process per rank, like torchrun: arguments or environment
 *   allreduce [RANK WORLD_SIZE MASTER_ADDR:MASTER_PORT [LOCAL_IP]]
 *   RANK=0 WORLD_SIZE=3 MASTER_ADDR=198.18.0.1 MASTER_PORT=29500 allreduce
 * LOCAL_IP (or GW_LOCAL_IP) is this rank's address; by default the one the kernel routes to
 * the master from. Rank 0 serves the rendezvous at the master address, so it must be rank
 * 0's own address.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gradwire.h>

#define ELEMS 10000
#define P2P_ELEMS 50000

static int rank_id = -1;

/* Prints what failed and gradwire's message, and exits: every error ends the rank. */
static void check(int rc, const char *what) {
    if (rc == GW_OK)
        return;
    int peer = gw_last_error_peer();
    fprintf(stderr, "rank %d: %s failed: %s (%s)", rank_id, what, gw_last_error_message(),
            gw_error_name(rc));
    if (peer >= 0)
        fprintf(stderr, " [peer rank %d]", peer);
    fprintf(stderr, "\n");
    exit(1);
}

static void fail(const char *msg) {
    fprintf(stderr, "rank %d: %s\n", rank_id, msg);
    exit(1);
}

static long parse_int(const char *s, const char *name) {
    char *end = NULL;
    long v = s ? strtol(s, &end, 10) : -1;
    if (!s || *s == '\0' || *end != '\0' || v < 0) {
        fprintf(stderr, "%s must be a non-negative integer (got %s)\n", name, s ? s : "nothing");
        exit(2);
    }
    return v;
}

/* The local address the kernel would use to reach host:port (no packet is sent: connecting a
 * UDP socket only picks the route). */
static int local_ip_towards(const char *host, const char *port, char *out, size_t cap) {
    struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
    if (inet_pton(AF_INET, host, &dst.sin_addr) != 1)
        return -1;
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in me;
    socklen_t len = sizeof me;
    int ok = connect(fd, (struct sockaddr *)&dst, sizeof dst) == 0 &&
             getsockname(fd, (struct sockaddr *)&me, &len) == 0 &&
             inet_ntop(AF_INET, &me.sin_addr, out, (socklen_t)cap) != NULL;
    close(fd);
    return ok ? 0 : -1;
}

/* rank r's element i: small integers, so every sum is exact in float. */
static float input(int r, int i) { return (float)((r + 1) * ((i % 13) + 1)); }

/* The priority function's context: how many segments it tagged, and how many as urgent.
 * Called from gradwire's sending threads, possibly at once: atomics. */
struct prio_stats {
    atomic_uint calls;
    atomic_uint urgent;
};

/* DLCP's gradient-aware tagging: segments whose mean |g| is large carry the most information
 * and go in a high-priority class (DSCP 46, not ECN-capable); small ones go in a low class
 * and ECN-capable, so a congested switch marks or drops them first. */
static gw_tag tag_by_magnitude(void *ctx, const gw_segment_info *seg) {
    struct prio_stats *st = ctx;
    double sum = 0.0;
    size_t n = seg->len / sizeof(float);
    for (size_t k = 0; k < n; k++) {
        float x;
        memcpy(&x, seg->payload + k * sizeof(float), sizeof x); /* payload is unaligned */
        sum += x < 0.0f ? -(double)x : (double)x;
    }
    int urgent = n > 0 && sum / (double)n >= 1.0;
    atomic_fetch_add(&st->calls, 1);
    if (urgent)
        atomic_fetch_add(&st->urgent, 1);
    gw_tag t = {.dscp = urgent ? 46 : 10, .ect = !urgent};
    return t;
}

int main(int argc, char **argv) {
    const char *rank_s, *world_s, *master_host, *master_port, *local = NULL;
    char master[300], master_buf[300], ip[INET6_ADDRSTRLEN];
    if (argc >= 4) {
        rank_s = argv[1];
        world_s = argv[2];
        if (snprintf(master_buf, sizeof master_buf, "%s", argv[3]) >= (int)sizeof master_buf) {
            fprintf(stderr, "master %s: too long\n", argv[3]);
            return 2;
        }
        char *colon = strrchr(master_buf, ':');
        if (!colon) {
            fprintf(stderr, "master %s: write IP:port\n", argv[3]);
            return 2;
        }
        *colon = '\0';
        master_host = master_buf;
        master_port = colon + 1;
        if (argc >= 5)
            local = argv[4];
    } else if (argc == 1) {
        rank_s = getenv("RANK");
        world_s = getenv("WORLD_SIZE");
        master_host = getenv("MASTER_ADDR");
        master_port = getenv("MASTER_PORT");
        local = getenv("GW_LOCAL_IP");
        if (!master_host || !master_port) {
            fprintf(stderr, "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or pass "
                            "RANK WORLD_SIZE MASTER_ADDR:PORT [LOCAL_IP]\n");
            return 2;
        }
    } else {
        fprintf(stderr, "usage: %s [RANK WORLD_SIZE MASTER_ADDR:PORT [LOCAL_IP]]\n", argv[0]);
        return 2;
    }
    long rank = parse_int(rank_s, "RANK"), world = parse_int(world_s, "WORLD_SIZE");
    rank_id = (int)rank;
    if (world < 2 || rank >= world)
        fail("needs WORLD_SIZE >= 2 and RANK < WORLD_SIZE");
    if (snprintf(master, sizeof master, "%s:%s", master_host, master_port) >= (int)sizeof master)
        fail("the master address is too long");
    if (local) {
        if (snprintf(ip, sizeof ip, "%s", local) >= (int)sizeof ip)
            fail("LOCAL_IP is too long for an IP address");
    } else if (local_ip_towards(master_host, master_port, ip, sizeof ip) != 0) {
        fail("cannot find this rank's address towards the master: set GW_LOCAL_IP");
    }
    printf("rank %ld: gradwire %s, world %ld, address %s, master %s\n", rank, gw_version(),
           world, ip, master);

    gw_config cfg = gw_config_default((uint32_t)rank, (uint32_t)world, ip);
    cfg.timeout_ms = 20000;
    gw_session *s = NULL;
    check(gw_session_rendezvous(&cfg, master, &s), "rendezvous");

    /* All-reduce: reliable (loss bound 0), so the sum is exact. */
    float *g = malloc(ELEMS * sizeof *g);
    if (!g)
        fail("out of memory");
    for (int i = 0; i < ELEMS; i++)
        g[i] = input((int)rank, i);
    gw_reduce_report rr;
    check(gw_all_reduce(s, g, ELEMS, GW_DTYPE_F32, GW_OP_SUM, NULL, &rr), "all-reduce");
    for (int i = 0; i < ELEMS; i++) {
        float want = 0.0f;
        for (int r = 0; r < world; r++)
            want += input(r, i);
        if (g[i] != want) {
            fprintf(stderr, "rank %ld: all-reduce element %d is %g, want %g\n", rank, i, g[i],
                    want);
            return 1;
        }
    }
    size_t nblocks = 0, nranks = 0;
    check(gw_last_block_delivered(s, NULL, 0, &nblocks), "block fractions");
    double *blocks = calloc(nblocks ? nblocks : 1, sizeof *blocks);
    double ranks[64];
    if (!blocks)
        fail("out of memory");
    check(gw_last_block_delivered(s, blocks, nblocks, &nblocks), "block fractions");
    check(gw_last_rank_delivered(s, ranks, 64, &nranks), "rank fractions");
    double min_block = 1.0;
    for (size_t b = 0; b < nblocks; b++)
        min_block = blocks[b] < min_block ? blocks[b] : min_block;
    printf("rank %ld: all-reduce ok: %zu elements exact, %zu blocks, delivered fraction %.3f, "
           "lowest block %.3f, rank 0's contribution reached %.3f of blocks\n",
           rank, rr.elems, rr.blocks, rr.delivered_fraction, min_block, ranks[0]);
    free(blocks);

    /* Broadcast from rank 0. */
    for (int i = 0; i < ELEMS; i++)
        g[i] = rank == 0 ? (float)i * 0.5f : -1.0f;
    gw_broadcast_report br;
    check(gw_broadcast(s, 0, g, ELEMS, GW_DTYPE_F32, NULL, &br), "broadcast");
    for (int i = 0; i < ELEMS; i++)
        if (g[i] != (float)i * 0.5f) {
            fprintf(stderr, "rank %ld: broadcast element %d is %g\n", rank, i, g[i]);
            return 1;
        }
    printf("rank %ld: broadcast ok: %zu/%zu blocks\n", rank, br.received_blocks, br.blocks);
    free(g);

    check(gw_barrier(s), "barrier");
    printf("rank %ld: barrier ok\n", rank);

    /* DLCP send/recv of one tensor, rank 0 -> rank 1: the first half large gradients, the
     * second half small ones. */
    gw_p2p_options po = gw_p2p_options_default();
    po.tensor = 7;
    po.layer = 2;      /* counted from the input: layer 0 is the most urgent */
    po.num_layers = 4; /* with layer, the DSCP of DLCP's default tagging (no priority fn) */
    po.loss_bound = 0.0;
    if (rank <= 1) {
        float *t = malloc(P2P_ELEMS * sizeof *t);
        if (!t)
            fail("out of memory");
        if (rank == 0) {
            for (int i = 0; i < P2P_ELEMS; i++)
                t[i] = i < P2P_ELEMS / 2 ? 4.0f + (float)(i % 5) : 0.01f * (float)(i % 5);
            struct prio_stats st;
            atomic_init(&st.calls, 0);
            atomic_init(&st.urgent, 0);
            gw_send_report sr;
            check(gw_send(s, 1, t, P2P_ELEMS, GW_DTYPE_F32, &po, tag_by_magnitude, &st, &sr),
                  "send");
            unsigned calls = atomic_load(&st.calls), urgent = atomic_load(&st.urgent);
            if (calls < sr.segments || urgent == 0 || urgent == calls)
                fail("the priority function did not tag both kinds of segment");
            printf("rank 0: send ok: %u segments, %u tagged urgent (DSCP 46), %u low "
                   "(DSCP 10, ECT)\n",
                   sr.segments, urgent, calls - urgent);
        } else {
            memset(t, 0, P2P_ELEMS * sizeof *t);
            gw_recv_report rv;
            check(gw_recv(s, 0, t, P2P_ELEMS, GW_DTYPE_F32, &po, &rv), "recv");
            for (int i = 0; i < P2P_ELEMS; i++) {
                float want = i < P2P_ELEMS / 2 ? 4.0f + (float)(i % 5) : 0.01f * (float)(i % 5);
                if (t[i] != want) {
                    fprintf(stderr, "rank 1: received element %d is %g, want %g\n", i, t[i],
                            want);
                    return 1;
                }
            }
            /* The byte ranges that did not arrive (zero-filled): none with loss bound 0. */
            size_t nmissing = 0;
            check(gw_last_recv_missing(s, NULL, NULL, 0, &nmissing), "missing ranges");
            printf("rank 1: recv ok: delivered fraction %.3f (%u/%u segments, %zu byte ranges "
                   "missing)\n",
                   rv.delivered_fraction, rv.received_segments, rv.segments, nmissing);
        }
        free(t);
    }

    /* Nobody leaves while a peer may still need its links. */
    check(gw_barrier(s), "final barrier");
    gw_session_free(s);
    printf("rank %ld: done\n", rank);
    return 0;
}
