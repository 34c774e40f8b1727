/* Peer baseline for the rooted-collective comparison: Open MPI's
 * MPI_Reduce (sum), MPI_Gather or MPI_Scatter on float32, root 0, out of
 * place. Usage: mpi_rooted reduce|gather|scatter BYTES...; BYTES is the
 * reduce's vector, or the root's whole gather/scatter buffer (size()
 * blocks). Rank 0 prints "bytes time_us" per size: the slowest rank's mean
 * time per call. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void Call(const char* what, float* send, float* recv, long count, long block) {
  if (strcmp(what, "reduce") == 0) {
    MPI_Reduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
  } else if (strcmp(what, "gather") == 0) {
    MPI_Gather(send, (int)block, MPI_FLOAT, recv, (int)block, MPI_FLOAT, 0, MPI_COMM_WORLD);
  } else {
    MPI_Scatter(send, (int)block, MPI_FLOAT, recv, (int)block, MPI_FLOAT, 0, MPI_COMM_WORLD);
  }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 2 || (strcmp(argv[1], "reduce") && strcmp(argv[1], "gather") &&
                   strcmp(argv[1], "scatter"))) {
    if (rank == 0) fprintf(stderr, "usage: mpi_rooted reduce|gather|scatter BYTES...\n");
    MPI_Finalize();
    return 2;
  }
  const char* what = argv[1];
  const int reduce = strcmp(what, "reduce") == 0;
  for (int a = 2; a < argc; ++a) {
    long bytes = atol(argv[a]);
    long block = bytes / 4 / n;
    if (block < 1) block = 1;
    long count = reduce ? bytes / 4 : block * n; /* the root's buffer */
    float* send = malloc(count * sizeof(float));
    float* recv = malloc(count * sizeof(float));
    for (long i = 0; i < count; ++i) send[i] = (float)(i % 100);
    double per_call = 2e8 / (double)(count * 4);
    int iters = per_call < 3 ? 3 : per_call > 200 ? 200 : (int)per_call;
    for (int i = 0; i < 2; ++i) Call(what, send, recv, count, block);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i) Call(what, send, recv, count, block);
    double dt = (MPI_Wtime() - t0) / iters, slowest;
    MPI_Reduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("%ld %.2f\n", count * 4, slowest * 1e6);
    fflush(stdout);
    free(send);
    free(recv);
  }
  MPI_Finalize();
  return 0;
}
