/* Which MPI library mpi.h belongs to. build.rs runs only the C preprocessor over this file (it is
 * never compiled) and reads the two marked lines: the family (Open MPI, or MPICH and the libraries
 * built on it and sharing its ABI: MVAPICH2, Intel MPI, Cray MPICH), the library's name and version
 * as its header spells them, and the MPI standard version. Derivatives are tested before MPICH
 * itself, since their headers define MPICH_VERSION too. */
#include <mpi.h>

#if defined(OMPI_MAJOR_VERSION)
hpc_train_mpi_identity openmpi "Open MPI" OMPI_MAJOR_VERSION OMPI_MINOR_VERSION OMPI_RELEASE_VERSION
#elif defined(MVAPICH2_VERSION)
hpc_train_mpi_identity mpich "MVAPICH2" MVAPICH2_VERSION
#elif defined(MVAPICH_VERSION)
hpc_train_mpi_identity mpich "MVAPICH" MVAPICH_VERSION
#elif defined(I_MPI_VERSION)
hpc_train_mpi_identity mpich "Intel MPI" I_MPI_VERSION
#elif defined(MPICH_VERSION)
hpc_train_mpi_identity mpich "MPICH" MPICH_VERSION
#else
hpc_train_mpi_identity unknown "an MPI library"
#endif
hpc_train_mpi_standard MPI_VERSION MPI_SUBVERSION
