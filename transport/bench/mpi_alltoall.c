/* Peer baseline for the all-to-all comparison: Open MPI's MPI_Alltoall on
 * float32 blocks. Usage: mpi_alltoall BYTES... (each rank's whole send
 * buffer, size() blocks). Rank 0 prints "bytes time_us" per size: the
 * slowest rank's mean time per call. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (int a = 1; a < argc; ++a) {
    long bytes = atol(argv[a]);
    long block = bytes / 4 / n;
    if (block < 1) block = 1;
    float* send = malloc(block * n * sizeof(float));
    float* recv = malloc(block * n * sizeof(float));
    for (long i = 0; i < block * n; ++i) send[i] = (float)(i % 100);
    double per_call = 2e8 / (double)(block * n * 4);
    int iters = per_call < 3 ? 3 : per_call > 200 ? 200 : (int)per_call;
    for (int i = 0; i < 2; ++i) MPI_Alltoall(send, block, MPI_FLOAT, recv, block, MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i) MPI_Alltoall(send, block, MPI_FLOAT, recv, block, MPI_FLOAT, MPI_COMM_WORLD);
    double dt = (MPI_Wtime() - t0) / iters, slowest;
    MPI_Reduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("%ld %.2f\n", block * n * 4, slowest * 1e6);
    fflush(stdout);
    free(send);
    free(recv);
  }
  MPI_Finalize();
  return 0;
}
