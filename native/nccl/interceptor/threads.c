/* Which threads of the process ran: each thread's CPU clock (exact, unlike /proc's tick-updated counters) and
 * whether it is runnable right now ('R' in /proc/self/task/<tid>/stat). The fast path's OFFLOAD (devmem.c) copies
 * device memory only while every thread that is not held at a gate, nor exempt, stays idle. */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cs.h"

static uint64_t thr_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int thr_exempt(int tid, int self) {
  if (tid == self || cs_is_held_tid(tid)) return 1;
  char path[64], name[32] = "";
  snprintf(path, sizeof path, "/proc/self/task/%d/comm", tid);
  FILE* f = fopen(path, "re");
  if (f) {
    if (!fgets(name, sizeof name, f)) name[0] = 0;
    name[strcspn(name, "\n")] = 0;
    fclose(f);
  }
  /* the CUDA driver's own threads, PyTorch's NCCL watchdog and heartbeat (they only poll events), and NCCL's
   * RAS thread (it outlives the communicators, which quiesce destroyed, and waits in poll with a timeout; a
   * monitoring thread that submits no GPU work: on an H200 it ran during each of three 24 GiB copies). NCCL
   * names its threads when NCCL_SET_THREAD_NAME=1, which `cryosleep run --fast-path` sets. */
  return strncmp(name, "cuda", 4) == 0 || strncmp(name, "pt_nccl_", 8) == 0 || strcmp(name, "NCCL RAS") == 0;
}

static int thr_runnable(int tid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/self/task/%d/stat", tid);
  FILE* f = fopen(path, "re");
  if (!f) return 0;
  size_t k = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[k] = 0;
  const char* close_paren = strrchr(buf, ')'); /* the state follows the name, which may hold anything */
  return close_paren && close_paren[1] == ' ' && close_paren[2] == 'R';
}

int cs_thr_sample(struct cs_thr* out, int self) {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  struct dirent* e;
  while ((e = readdir(d)) && n < CS_THREADS) {
    int tid = atoi(e->d_name);
    if (tid <= 0 || thr_exempt(tid, self)) continue;
    struct timespec ts;
    clockid_t clk = (clockid_t)((~(unsigned)tid << 3) | 6); /* the thread's CPU clock (CPUCLOCK_SCHED, per thread) */
    if (clock_gettime(clk, &ts) != 0) continue;                /* gone */
    out[n++] = (struct cs_thr){tid, thr_runnable(tid), (unsigned long long)ts.tv_sec * 1000000000ull +
                                                          (unsigned long long)ts.tv_nsec};
  }
  closedir(d);
  return n;
}

/* A thread of `after` that ran since `before` (or is new), or 0; `*ran_ns` its CPU time in between (-1: new). */
int cs_thr_ran(const struct cs_thr* before, int nb, const struct cs_thr* after, int na, long long* ran_ns) {
  for (int i = 0; i < na; i++) {
    int j = 0;
    while (j < nb && before[j].tid != after[i].tid) j++;
    if (j == nb || after[i].ns != before[j].ns || after[i].runnable) {
      if (ran_ns) *ran_ns = j == nb ? -1 : (long long)(after[i].ns - before[j].ns);
      return after[i].tid;
    }
  }
  return 0;
}

/* "name, state S, in syscall 7, wchan do_poll, 12 us of CPU WHEN": what a refusal says of the thread that ran, so
 * that it can be recognized (NCCL's threads are named when NCCL_SET_THREAD_NAME=1, which `cryosleep run` sets
 * with the fast path). */
void cs_thr_desc(int tid, long long ran_ns, const char* when, char* out, size_t n) {
  char path[64], name[32] = "", stat[512] = "", sc[64] = "", wchan[64] = "";
  const char* files[] = {"comm", "stat", "syscall", "wchan"};
  char* bufs[] = {name, stat, sc, wchan};
  size_t sizes[] = {sizeof name, sizeof stat, sizeof sc, sizeof wchan};
  for (int i = 0; i < 4; i++) {
    snprintf(path, sizeof path, "/proc/self/task/%d/%s", tid, files[i]);
    FILE* f = fopen(path, "re");
    if (!f) continue;
    size_t k = fread(bufs[i], 1, sizes[i] - 1, f);
    bufs[i][k] = 0;
    bufs[i][strcspn(bufs[i], "\n")] = 0;
    fclose(f);
  }
  const char* cp = strrchr(stat, ')');
  char state = cp && cp[1] == ' ' ? cp[2] : '?';
  sc[strcspn(sc, " ")] = 0; /* the syscall's number (or "running"); its arguments are not needed */
  int k = snprintf(out, n, "%s, state %c, in syscall %s, wchan %s", name, state, sc[0] ? sc : "?",
                   wchan[0] ? wchan : "?");
  if (k > 0 && (size_t)k < n) {
    if (ran_ns >= 0)
      snprintf(out + k, n - (size_t)k, ", %lld us of CPU %s", ran_ns / 1000, when);
    else
      snprintf(out + k, n - (size_t)k, ", started %s", when);
  }
}

/* Waits until every thread that is not held or exempt shows no CPU time for a few ms (within 1 s). Leaves
 * the sample taken at that moment in `a`. */
int cs_thr_wait_quiet(struct cs_thr* a, int* na, struct cs_thr* b, int self, char* err, size_t n) {
  uint64_t t0 = thr_now_ns();
  for (;;) {
    *na = cs_thr_sample(a, self);
    struct timespec ts = {0, 3000000};
    nanosleep(&ts, NULL);
    int nb = cs_thr_sample(b, self);
    if (*na < 0 || nb < 0) return snprintf(err, n, "OFFLOAD: /proc/self/task unreadable"), -1;
    long long ran_ns = 0;
    int tid = cs_thr_ran(a, *na, b, nb, &ran_ns);
    if (!tid) {
      memcpy(a, b, (size_t)nb * sizeof *b);
      *na = nb;
      return 0;
    }
    if (thr_now_ns() - t0 > 1000000000ull) {
      char desc[192];
      cs_thr_desc(tid, ran_ns, "in 3 ms", desc, sizeof desc);
      return snprintf(err, n, "OFFLOAD: thread %d (%s) kept running while the job was held: it may issue GPU "
                      "work the interceptor does not see", tid, desc), -1;
    }
  }
}

