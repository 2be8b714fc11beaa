/* The write tracker: on the agent's request, this process registers its private writable memory with a
 * userfaultfd in the asynchronous write-protect mode and hands the fd over (docs/precopy.md).
 *
 * Why in here: a userfaultfd registers the memory of the process that creates it, so the creation has to run
 * inside each worker; this library is preloaded into every one. Started at load time, only when the agent set
 * CRYOSLEEP_TRACK_DIR (independent of NCCL: a gloo or CPU job makes no NCCL call), and again in every forked
 * child (a DataLoader worker is tracked too). Requests are keyed by this process's PID, so a program a worker
 * execs (which inherits the variable) answers only for itself.
 *
 * The exchange, files in CRYOSLEEP_TRACK_DIR (each written to a temporary name, then renamed):
 *   agent   PID.req    "GEN\n": register now
 *   here    PID.ack    "GEN FD VMAS BYTES ERRNO\n": FD (-1 if none was needed) registers VMAS mappings, BYTES bytes
 *   agent   PID.taken  "GEN\n": it holds the fd now (pidfd_getfd), so this process closes its own
 * A mapping already registered by an earlier round is left as it is (it is tracked by that round's fd); the
 * registration lives while any process holds the fd, so after the exchange this process holds no userfaultfd
 * (which CRIU could not dump) and the agent's fd keeps the tracking alive. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif

#define TRACK_POLL_NS 50000000L /* a request is seen within 50 ms */
#define TAKE_WAIT_POLLS 200     /* the agent has 10 s to take the fd before it is closed (tracking lost) */

static char track_dir[512];
/* The userfaultfd this process holds until the agent takes it (-1: none), under held_lock from its creation to its
 * close: a child forked meanwhile inherits it, and closes it (held_lock keeps the fork out of the moment between the
 * fd's creation and its record here), for CRIU cannot dump a process holding one. */
static int held_fd = -1;
static pthread_mutex_t held_lock = PTHREAD_MUTEX_INITIALIZER;

static void nap(long ns) {
  struct timespec ts = {0, ns};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static int path_of(char* out, size_t n, const char* what) {
  int r = snprintf(out, n, "%s/%d.%s", track_dir, (int)getpid(), what);
  return r > 0 && (size_t)r < n ? 0 : -1;
}

/* The generation in file WHAT ("GEN\n"), or 0 when there is none. */
static unsigned long read_gen(const char* what) {
  char path[600], buf[32];
  if (path_of(path, sizeof(path), what)) return 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  return strtoul(buf, NULL, 10);
}

static void write_file(const char* what, const char* text) {
  char path[600], tmp[640];
  if (path_of(path, sizeof(path), what) || snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) return;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  ssize_t w = write(fd, text, strlen(text));
  close(fd);
  if (w == (ssize_t)strlen(text)) rename(tmp, path);
  else unlink(tmp);
}

/* Closes the fd this process holds, if any. */
static void drop_held(void) {
  pthread_mutex_lock(&held_lock);
  if (held_fd >= 0) close(held_fd);
  held_fd = -1;
  pthread_mutex_unlock(&held_lock);
}

/* Registers every private writable mapping not registered yet; returns the fd (-1: none needed or error). */
static int register_all(unsigned* vmas, unsigned long long* bytes, int* err) {
  *vmas = 0, *bytes = 0, *err = 0;
  pthread_mutex_lock(&held_lock);
  int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  if (uffd < 0) *err = errno;
  held_fd = uffd;
  pthread_mutex_unlock(&held_lock);
  if (uffd < 0) return -1;
  struct uffdio_api api = {.api = UFFD_API, .features = UFFD_FEATURE_WP_ASYNC};
  if (ioctl(uffd, UFFDIO_API, &api) != 0) return *err = errno, drop_held(), -1;
  FILE* maps = fopen("/proc/self/maps", "re");
  if (!maps) return *err = errno, drop_held(), -1;
  char line[1024];
  while (fgets(line, sizeof(line), maps)) {
    unsigned long lo, hi;
    char perms[8] = {0};
    int name_at = 0;
    if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %n", &lo, &hi, perms, &name_at) < 3) continue;
    const char* name = name_at ? line + name_at : "";
    /* private, writable, anonymous (no file; the heap and stacks are anonymous too): what a dump copies */
    if (perms[0] != 'r' || perms[1] != 'w' || perms[3] != 'p') continue;
    if (name[0] && name[0] != '\n' && strncmp(name, "[heap]", 6) != 0 && strncmp(name, "[stack", 6) != 0) continue;
    struct uffdio_register reg = {.range = {.start = lo, .len = hi - lo}, .mode = UFFDIO_REGISTER_MODE_WP};
    if (ioctl(uffd, UFFDIO_REGISTER, &reg) == 0) {
      (*vmas)++;
      *bytes += hi - lo;
    } else if (errno != EBUSY && errno != EINVAL && errno != EPERM) {
      *err = errno; /* EBUSY: registered by an earlier round; EINVAL/EPERM: a mapping that cannot be */
    }
  }
  fclose(maps);
  if (*vmas == 0) return drop_held(), -1;
  return uffd;
}

static void serve(unsigned long gen) {
  unsigned vmas;
  unsigned long long bytes;
  int err;
  int fd = register_all(&vmas, &bytes, &err);
  char ack[128];
  snprintf(ack, sizeof(ack), "%lu %d %u %llu %d\n", gen, fd, vmas, bytes, err);
  write_file("ack", ack);
  if (fd < 0) return;
  for (int i = 0; i < TAKE_WAIT_POLLS && read_gen("taken") < gen; i++) nap(TRACK_POLL_NS);
  drop_held();
}

static void* track_main(void* arg) {
  (void)arg;
  unsigned long done = 0;
  for (;;) {
    unsigned long gen = read_gen("req");
    if (gen > done) {
      serve(gen);
      done = gen;
    }
    nap(TRACK_POLL_NS);
  }
  return NULL;
}

static void fork_prepare(void) { pthread_mutex_lock(&held_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&held_lock); }

/* A forked child: the parent's fd, when it held one, is closed here (the tracking is the parent's; the child's own
 * memory is registered by its own tracker, started anew). */
static void track_start(void);
static void fork_child(void) {
  if (held_fd >= 0) close(held_fd);
  held_fd = -1;
  pthread_mutex_unlock(&held_lock);
  track_start();
}

static void track_start(void) {
  pthread_t th;
  pthread_attr_t attr;
  sigset_t all, old;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 64 * 1024);
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old); /* the application's signal handlers never run here */
  if (pthread_create(&th, &attr, track_main, NULL) == 0) pthread_setname_np(th, "cryosleep-trk");
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
}

__attribute__((constructor)) static void track_init(void) {
  const char* dir = getenv("CRYOSLEEP_TRACK_DIR");
  if (!dir || !dir[0] || strlen(dir) >= sizeof(track_dir)) return;
  strcpy(track_dir, dir);
  pthread_atfork(fork_prepare, fork_parent, fork_child); /* a forked child has no thread but the one that forked */
  track_start();
}
