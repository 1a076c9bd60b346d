/* MPI_Init, then at once the first message (an all-reduce), as hpc-train's start-up does: the
 * smallest program that meets a rank still inside MPI_Init when MPI_Init's last fence is no
 * barrier. */
#include <mpi.h>

int main(int argc, char **argv) {
    int provided, one = 1, sum = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    int size;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Finalize();
    return sum == size ? 0 : 1;
}
