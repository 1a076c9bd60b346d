/* The plain MPI_Allreduce as its users call it, measured the way `hpc-train bench` measures its
 * strategies, for scripts/compare-mpi-allreduce.sh: in place (MPI_IN_PLACE), float32, MPI_SUM,
 * one buffer per size; before every iteration the buffer is refilled (untimed) and the ranks
 * meet in a barrier; an iteration's time is the slowest rank's; each size reports the median
 * of the timed iterations after the warm-up ones, with nccl-tests' bandwidths
 * (algbw = bytes / time, busbw = algbw x 2(n-1)/n) and the elements that differ from the
 * closed-form sum (the same small-integer input as hpc-train's, exact in any order).
 *
 *   mpicc -O2 -o mpi-allreduce-bench scripts/mpi-allreduce-bench.c
 *   mpirun -n 2 ./mpi-allreduce-bench MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP
 *
 * Output rows have the columns of hpc-train bench's table, with "mpi-c" as the strategy. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

/* hpc-train's bench input (src/bench.rs exact_value): 1 + (i + rank) % 3. */
static float value(int rank, size_t i) { return (float)(1 + (i + (size_t)rank) % 3); }

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc != 6) {
        if (rank == 0) fprintf(stderr, "usage: %s MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t min_bytes = strtoull(argv[1], NULL, 10), max_bytes = strtoull(argv[2], NULL, 10);
    size_t factor = strtoull(argv[3], NULL, 10);
    int iters = atoi(argv[4]), warmup = atoi(argv[5]);
    if (min_bytes < 4 || max_bytes < min_bytes || factor < 2 || iters < 1 || warmup < 0) {
        if (rank == 0) fprintf(stderr, "%s: bad sizes or counts\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t max_count = max_bytes / sizeof(float);
    float *pristine = malloc(max_count * sizeof(float)), *buf = malloc(max_count * sizeof(float));
    double *times = malloc(iters * sizeof(double));
    if (!pristine || !buf || !times) {
        fprintf(stderr, "rank %d: out of memory for %zu bytes\n", rank, max_bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < max_count; i++) pristine[i] = value(rank, i);
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len;
    MPI_Get_library_version(version, &len);
    char *newline = strchr(version, '\n');
    if (newline) *newline = '\0';
    if (rank == 0) {
        printf("# mpi-allreduce-bench: %d rank(s), %s, float32 in place, median of %d iterations after %d warm-up\n", size, version, iters, warmup);
        printf("# %12s %12s %8s %10s %7s %11s %9s %9s %7s\n", "size", "count", "type", "strategy", "tensors", "time", "algbw", "busbw", "#wrong");
        printf("# %12s %12s %8s %10s %7s %11s %9s %9s %7s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "");
    }
    double bus_factor = size > 1 ? 2.0 * (size - 1) / size : 0.0;
    long long total_wrong = 0;
    for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
        size_t count = bytes / sizeof(float);
        for (int it = 0; it < warmup + iters; it++) {
            memcpy(buf, pristine, count * sizeof(float));
            MPI_Barrier(MPI_COMM_WORLD);
            double start = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double mine = MPI_Wtime() - start, slowest;
            MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (it >= warmup) times[it - warmup] = slowest;
        }
        long long wrong_mine = 0, wrong;
        for (size_t i = 0; i < count; i++) {
            float expected = 0;
            for (int r = 0; r < size; r++) expected += value(r, i);
            if (buf[i] != expected) wrong_mine++;
        }
        MPI_Allreduce(&wrong_mine, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
        total_wrong += wrong;
        double time = median(times, iters);
        double algbw = bytes / time / 1e9;
        if (rank == 0)
            printf("  %12zu %12zu %8s %10s %7d %11.2f %9.3f %9.3f %7lld\n", bytes, count, "float", "mpi-c", 1, time * 1e6, algbw, algbw * bus_factor, wrong);
        fflush(stdout);
        if (bytes > max_bytes / factor) break;
    }
    free(pristine);
    free(buf);
    free(times);
    MPI_Finalize();
    return total_wrong > 0 ? 1 : 0;
}
