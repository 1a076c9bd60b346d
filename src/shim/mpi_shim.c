/* Constants of mpi.h that rsmpi does not export. Their values differ between MPI libraries
 * (MPI_IN_PLACE is (void*)1 in Open MPI and (void*)-1 in MPICH), so they are read from the
 * header the program is built against instead of being written in Rust. */
#include <mpi.h>

void *hpc_train_mpi_in_place(void) { return MPI_IN_PLACE; }
