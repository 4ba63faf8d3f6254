/*
 * gradwire in an MPI program: the ranks mpirun starts exchange gradwire endpoints with
 * MPI_Allgather (gw_session_init), then all-reduce the same buffers with gradwire and with
 * MPI_Allreduce, check both results element by element, and rank 0 prints the times.
 *
 * Build (after scripts/capi.sh, which prints the PKG_CONFIG_PATH to use):
 *   mpicc -O2 mpi_allreduce.c $(pkg-config --cflags --libs gradwire-static) -o mpi_allreduce
 * Run (one host; as root Open MPI also wants --allow-run-as-root):
 *   mpirun -np 4 ./mpi_allreduce [--ip ADDR] [--mtu BYTES] [--min BYTES] [--max BYTES]
 *                                [--iters N] [--algo auto|ring|direct]
 * --ip (or GW_LOCAL_IP) is this rank's address for gradwire's socket (default 127.0.0.1, which
 * serves a one-host job; across hosts give each rank its own address, e.g. through a
 * wrapper that reads it from the interface MPI uses). --mtu is the network's MTU (default
 * 1500; 9000 with jumbo frames; a one-host job on loopback may use up to 65535, as MPI's TCP
 * does there).
 *
 * Sizes go from --min to --max bytes of float32 (x4 each step). Each size is timed --iters
 * times, alternating the two libraries; one measurement is the slowest rank's time from a
 * common barrier, and the printed figure is the median over iterations. The inputs are
 * small integers, so both sums must be exact: any difference is an error (exit 1).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include <gradwire.h>

static int rank_id = -1;

static void check(int rc, const char *what) {
    if (rc == GW_OK)
        return;
    int peer = gw_last_error_peer();
    fprintf(stderr, "rank %d: %s failed: %s (%s)", rank_id, what, gw_last_error_message(),
            gw_error_name(rc));
    if (peer >= 0)
        fprintf(stderr, " [peer rank %d]", peer);
    fprintf(stderr, "\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* gw_allgather_fn over an MPI communicator. */
static int mpi_allgather(void *ctx, const uint8_t *mine, size_t len, uint8_t *all) {
    MPI_Comm comm = *(MPI_Comm *)ctx;
    if (len > (size_t)0x7fffffff)
        return -1;
    return MPI_Allgather(mine, (int)len, MPI_BYTE, all, (int)len, MPI_BYTE, comm) == MPI_SUCCESS
               ? 0
               : -1;
}

static long parse_size(const char *s, const char *name) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *s == '\0' || v <= 0) {
        fprintf(stderr, "%s: %s is not a positive number\n", name, s);
        exit(2);
    }
    if (*end == 'K' || *end == 'k')
        v <<= 10, end++;
    else if (*end == 'M' || *end == 'm')
        v <<= 20, end++;
    if (*end != '\0') {
        fprintf(stderr, "%s: %s is not a size (e.g. 65536, 64K, 16M)\n", name, s);
        exit(2);
    }
    return v;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* rank r's element i: small integers, so every sum is exact in float. */
static float input(int r, size_t i) { return (float)((r + 1) * (int)((i % 7) + 1)); }

static void fill(float *buf, size_t n, int r) {
    for (size_t i = 0; i < n; i++)
        buf[i] = input(r, i);
}

/* Whether buf holds the exact sum over `world` ranks. */
static int exact(const float *buf, size_t n, int world) {
    for (size_t i = 0; i < n; i++) {
        float want = 0.0f;
        for (int r = 0; r < world; r++)
            want += input(r, i);
        if (buf[i] != want) {
            fprintf(stderr, "rank %d: element %zu is %g, want %g\n", rank_id, i, buf[i], want);
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm comm = MPI_COMM_WORLD;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &world);
    rank_id = rank;

    const char *ip = getenv("GW_LOCAL_IP");
    long min = 64 << 10, max = 16 << 20, iters = 10, mtu = 0;
    gw_algo algo = GW_ALGO_AUTO;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ip") && i + 1 < argc)
            ip = argv[++i];
        else if (!strcmp(argv[i], "--mtu") && i + 1 < argc)
            mtu = parse_size(argv[++i], "--mtu");
        else if (!strcmp(argv[i], "--min") && i + 1 < argc)
            min = parse_size(argv[++i], "--min");
        else if (!strcmp(argv[i], "--max") && i + 1 < argc)
            max = parse_size(argv[++i], "--max");
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = parse_size(argv[++i], "--iters");
        else if (!strcmp(argv[i], "--algo") && i + 1 < argc) {
            const char *a = argv[++i];
            if (!strcmp(a, "auto"))
                algo = GW_ALGO_AUTO;
            else if (!strcmp(a, "ring"))
                algo = GW_ALGO_RING;
            else if (!strcmp(a, "direct"))
                algo = GW_ALGO_DIRECT;
            else {
                fprintf(stderr, "--algo %s: give auto, ring or direct\n", a);
                return 2;
            }
        }
        else {
            if (rank == 0)
                fprintf(stderr, "usage: %s [--ip ADDR] [--mtu BYTES] [--min BYTES] [--max BYTES] "
                                "[--iters N] [--algo auto|ring|direct]\n",
                        argv[0]);
            MPI_Finalize();
            return 2;
        }
    }
    if (world < 2) {
        if (rank == 0)
            fprintf(stderr, "run at least 2 ranks: mpirun -np 4 %s\n", argv[0]);
        MPI_Finalize();
        return 2;
    }

    gw_config cfg = gw_config_default((uint32_t)rank, (uint32_t)world, ip ? ip : "127.0.0.1");
    cfg.mtu = (uint32_t)mtu;
    gw_session *s = NULL;
    check(gw_session_init(&cfg, mpi_allgather, &comm, &s), "gw_session_init");
    gw_op_options opts = gw_op_options_default();
    opts.algorithm = algo;

    size_t cap = (size_t)max / sizeof(float);
    float *buf = malloc(cap * sizeof(float));
    double *t_mpi = malloc((size_t)iters * sizeof(double));
    double *t_gw = malloc((size_t)iters * sizeof(double));
    if (!buf || !t_mpi || !t_gw) {
        fprintf(stderr, "rank %d: out of memory for %ld bytes\n", rank, max);
        MPI_Abort(comm, 1);
    }
    if (rank == 0)
        printf("%10s %12s %12s %8s\n", "bytes", "MPI ms", "gradwire ms", "ratio");
    int ok = 1;
    for (long bytes = min; bytes <= max; bytes *= 4) {
        size_t n = (size_t)bytes / sizeof(float);
        for (long k = -1; k < iters; k++) { /* k = -1: warm-up, not timed */
            for (int lib = 0; lib < 2; lib++) {
                fill(buf, n, rank);
                MPI_Barrier(comm);
                double t0 = MPI_Wtime();
                if (lib == 0) {
                    MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, comm);
                } else {
                    check(gw_all_reduce(s, buf, n, GW_DTYPE_F32, GW_OP_SUM, &opts, NULL),
                          "gw_all_reduce");
                }
                double dt = MPI_Wtime() - t0, slowest = 0.0;
                MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
                if (!exact(buf, n, world)) {
                    fprintf(stderr, "rank %d: %s result of %ld bytes is wrong\n", rank,
                            lib ? "gradwire" : "MPI", bytes);
                    ok = 0;
                }
                if (k >= 0)
                    (lib ? t_gw : t_mpi)[k] = slowest;
            }
        }
        qsort(t_mpi, (size_t)iters, sizeof(double), cmp_double);
        qsort(t_gw, (size_t)iters, sizeof(double), cmp_double);
        double m = t_mpi[iters / 2] * 1e3, g = t_gw[iters / 2] * 1e3;
        if (rank == 0)
            printf("%10ld %12.3f %12.3f %8.2f\n", bytes, m, g, g / m);
    }
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);
    if (rank == 0)
        printf("%s\n", all_ok ? "results: exact on every rank, both libraries"
                              : "results: WRONG (see the ranks' errors)");
    gw_session_free(s);
    free(buf);
    free(t_mpi);
    free(t_gw);
    MPI_Finalize();
    return all_ok ? 0 : 1;
}
