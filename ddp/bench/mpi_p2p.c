/* Peer baseline: Open MPI MPI_Send/MPI_Recv ping-pong between 2 ranks.
 *
 *   mpicc -O2 -o /tmp/mpi_p2p ddp/bench/mpi_p2p.c
 *   mpirun --allow-run-as-root --oversubscribe --mca pml ucx -np 2 /tmp/mpi_p2p
 *
 * Prints, as //ddp:p2p_bench does, one line per size (8 B to 16 MiB, x8):
 * bytes one_way_us GBps, one-way = half the mean round trip. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int peer = 1 - rank;
  for (long bytes = 8; bytes <= (16L << 20); bytes *= 8) {
    float* buffer = calloc((size_t)bytes / 4, sizeof(float));
    long iters = 200000000L / bytes;
    if (iters < 3) iters = 3;
    if (iters > 2000) iters = 2000;
    double start = 0;
    for (long i = -5; i < iters; ++i) {
      if (i == 0) start = MPI_Wtime();
      if (rank == 0) {
        MPI_Send(buffer, (int)(bytes / 4), MPI_FLOAT, peer, 1, MPI_COMM_WORLD);
        MPI_Recv(buffer, (int)(bytes / 4), MPI_FLOAT, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(buffer, (int)(bytes / 4), MPI_FLOAT, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buffer, (int)(bytes / 4), MPI_FLOAT, peer, 1, MPI_COMM_WORLD);
      }
    }
    const double one_way = (MPI_Wtime() - start) / (double)iters / 2;
    if (rank == 0) printf("%ld %.2f %.3f\n", bytes, one_way * 1e6, (double)bytes / one_way / 1e9);
    fflush(stdout);
    free(buffer);
  }
  MPI_Finalize();
  return 0;
}
