/* Constants of mpi.h that rsmpi does not export. Their values differ between MPI libraries
 * (MPI_IN_PLACE is (void*)1 in Open MPI and (void*)-1 in MPICH), so they are read from the
 * header the program is built against instead of being written in Rust. */
#include <mpi.h>
#include <string.h>

void *hpc_train_mpi_in_place(void) { return MPI_IN_PLACE; }

/* The value of the integer or boolean control variable `name` of the MPI tool interface, read
 * after MPI_Init: 0 and *value set, 1 when the library has no such variable, -1 when the tool
 * interface or the read fails, or the variable is of another type. Open MPI 4.1's
 * MPIX_Query_cuda_support() is a constant of its build; whether CUDA support is on in this run
 * is its boolean control variable mpi_cuda_support (opal_cuda_support), true by default in a
 * CUDA build and cleared during MPI_Init when libcuda cannot be loaded or by --mca
 * mpi_cuda_support 0. Open MPI types its booleans MPI_C_BOOL (one byte). */
int hpc_train_int_cvar(const char *name, int *value) {
    int level, provided, index, count, status = -1;
    MPI_Datatype datatype;
    MPI_T_cvar_handle handle;
    union { int as_int; _Bool as_bool; unsigned char bytes[16]; } read;
    /* At the thread level MPI_Init gave: Open MPI 4.1's MPI_T_init_thread sets the library's
     * thread level to the one it is asked for, and MPI_Query_thread then answers that (asked
     * for MPI_THREAD_SINGLE, a run initialised with MPI_THREAD_MULTIPLE read Single after). */
    if (MPI_Query_thread(&level) != MPI_SUCCESS) return -1;
    if (MPI_T_init_thread(level, &provided) != MPI_SUCCESS) return -1;
    if (MPI_T_cvar_get_index(name, &index) != MPI_SUCCESS) {
        status = 1;
        goto done;
    }
    if (MPI_T_cvar_get_info(index, NULL, NULL, NULL, &datatype, NULL, NULL, NULL, NULL, NULL) != MPI_SUCCESS) goto done;
    if (datatype != MPI_INT && datatype != MPI_C_BOOL) goto done;
    if (MPI_T_cvar_handle_alloc(index, NULL, &handle, &count) != MPI_SUCCESS) goto done;
    memset(&read, 0, sizeof read);
    if (count == 1 && MPI_T_cvar_read(handle, &read) == MPI_SUCCESS) {
        *value = datatype == MPI_INT ? read.as_int : (int)read.as_bool;
        status = 0;
    }
    MPI_T_cvar_handle_free(&handle);
done:
    MPI_T_finalize();
    return status;
}
