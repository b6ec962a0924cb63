// What an 8-byte message costs on this machine after a pause, with no framework at all: two
// processes, a TCP loopback connection (TCP_NODELAY) whose receiver polls with MSG_DONTWAIT or
// blocks in recv(), and a flag in shared memory polled by both. Each pattern is timed in a hot
// loop and after 1 ms and 10 ms of compute (a 96x96 float matmul, as benchmarks/comm.py's
// pause) or of sleep on both processes. benchmarks/pause_floor.py compiles and runs it.
//
// Output: one line per pattern, "transport pause_kind pause_ms median_us p10_us n", the one-way
// time being half the round trip measured by the first process.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { TCP_POLL, TCP_BLOCK, SHM_FLAG, TRANSPORTS };
static const char *kTransport[] = {"tcp-poll", "tcp-block", "shm-flag"};
static const double kPauseS[] = {0, 1e-3, 1e-2};
enum { COMPUTE, SLEEP };
static const char *kKind[] = {"compute", "sleep"};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what) {
  perror(what);
  exit(1);
}

static float ma[96 * 96], mb[96 * 96], mc[96 * 96];

static void compute(double seconds) {
  const double end = now() + seconds;
  while (now() < end)
    for (int i = 0; i < 96; i++)
      for (int k = 0; k < 96; k++)
        for (int j = 0; j < 96; j++) mc[i * 96 + j] += ma[i * 96 + k] * mb[k * 96 + j];
}

static void take_pause(int kind, double seconds) {
  if (seconds == 0) return;
  if (kind == COMPUTE) {
    compute(seconds);
  } else {
    struct timespec t = {0, (long)(seconds * 1e9)};
    nanosleep(&t, NULL);
  }
}

static void receive(int fd, int poll) {
  char b[8];
  size_t got = 0;
  while (got < sizeof b) {
    ssize_t n = recv(fd, b + got, sizeof b - got, poll ? MSG_DONTWAIT : 0);
    if (n > 0) got += n;
    else if (n == 0) die("peer closed");
    else if (poll) __builtin_ia32_pause();
    else die("recv");
  }
}

static void transmit(int fd) {
  char b[8] = {0};
  if (send(fd, b, sizeof b, 0) != (ssize_t)sizeof b) die("send");
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(void) {
  int one = 1, listener = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof addr;
  if (listener < 0 || bind(listener, (void *)&addr, sizeof addr) || listen(listener, 1) ||
      getsockname(listener, (void *)&addr, &len))
    die("listen on loopback");
  _Atomic int *flag = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (flag == MAP_FAILED) die("mmap");
  const pid_t child = fork();
  if (child < 0) die("fork");
  const int echo = child == 0;
  int fd;
  if (echo) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (void *)&addr, sizeof addr)) die("connect");
  } else if ((fd = accept(listener, NULL, NULL)) < 0) {
    die("accept");
  }
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  for (int transport = 0; transport < TRANSPORTS; transport++)
    for (int kind = COMPUTE; kind <= SLEEP; kind++)
      for (int p = 0; p < 3; p++) {
        if (kind == SLEEP && p == 0) continue;  // the hot loop is timed once
        const int n = p == 0 ? 2000 : p == 1 ? 300 : 60;
        double *one_way = malloc(n * sizeof(double));
        atomic_store(flag, 0);
        // both processes start the pattern together: a round trip over the socket
        if (echo) { receive(fd, 0); transmit(fd); } else { transmit(fd); receive(fd, 0); }
        for (int i = 0; i < n; i++) {
          take_pause(kind, kPauseS[p]);
          if (echo) {
            if (transport == SHM_FLAG) {
              while (atomic_load(flag) != 2 * i + 1) __builtin_ia32_pause();
              atomic_store(flag, 2 * i + 2);
            } else {
              receive(fd, transport == TCP_POLL);
              transmit(fd);
            }
          } else {
            const double t0 = now();
            if (transport == SHM_FLAG) {
              atomic_store(flag, 2 * i + 1);
              while (atomic_load(flag) != 2 * i + 2) __builtin_ia32_pause();
            } else {
              transmit(fd);
              receive(fd, transport == TCP_POLL);
            }
            one_way[i] = (now() - t0) / 2;
          }
        }
        if (!echo) {
          qsort(one_way, n, sizeof(double), by_value);
          printf("%s %s %g %.2f %.2f %d\n", kTransport[transport], p ? kKind[kind] : "hot", kPauseS[p] * 1e3,
                 one_way[n / 2] * 1e6, one_way[n / 10] * 1e6, n);
          fflush(stdout);
        }
        free(one_way);
        // the echoing side has left the pattern before the flag is reset for the next one
        if (echo) { transmit(fd); } else { receive(fd, 0); }
      }
  close(fd);
  if (!echo && waitpid(child, NULL, 0) < 0) die("waitpid");
  return 0;
}
