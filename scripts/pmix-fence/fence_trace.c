/* LD_PRELOAD shim: logs when this process enters each PMIx fence and when the fence releases it,
 * one line per event with the wall clock, into $FENCE_TRACE_DIR/<job>.<step>. Every process of the
 * emulated cluster shares one kernel clock, so the lines of all ranks can be ordered. Used by
 * scripts/measure-pmix-fence.sh to check whether a fence is a barrier (no rank released before the
 * last rank entered). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pmix.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void fence_trace_note(const char *what, int fence) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    const char *dir = getenv("FENCE_TRACE_DIR");
    char path[512], line[256];
    snprintf(path, sizeof path, "%s/%s.%s", dir ? dir : "/tmp", getenv("SLURM_JOB_ID"), getenv("SLURM_STEP_ID"));
    int n = snprintf(line, sizeof line, "%ld.%06ld %s %s %d\n", (long)now.tv_sec, now.tv_nsec / 1000,
                     getenv("SLURM_PROCID"), what, fence);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        (void)!write(fd, line, (size_t)n); /* one write: lines of ranks do not interleave */
        close(fd);
    }
}

struct pending { pmix_op_cbfunc_t callback; void *data; int fence; };

static void released(pmix_status_t status, void *cbdata) {
    struct pending *p = cbdata;
    fence_trace_note("released", p->fence);
    p->callback(status, p->data);
    free(p);
}

typedef pmix_status_t (*fence_nb_fn)(const pmix_proc_t[], size_t, const pmix_info_t[], size_t, pmix_op_cbfunc_t, void *);

pmix_status_t PMIx_Fence_nb(const pmix_proc_t procs[], size_t nprocs, const pmix_info_t info[], size_t ninfo,
                            pmix_op_cbfunc_t cbfunc, void *cbdata) {
    static fence_nb_fn real;
    static int fences;
    if (!real) real = (fence_nb_fn)dlsym(RTLD_NEXT, "PMIx_Fence_nb");
    if (!cbfunc) return real(procs, nprocs, info, ninfo, cbfunc, cbdata); /* nothing to wrap */
    struct pending *p = malloc(sizeof *p);
    p->callback = cbfunc;
    p->data = cbdata;
    p->fence = ++fences;
    fence_trace_note("enter", p->fence);
    return real(procs, nprocs, info, ninfo, released, p);
}
