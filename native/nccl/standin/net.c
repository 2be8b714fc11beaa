/* Stand-in NCCL: TCP plumbing. A unique id names a short-lived rendezvous listener (started by
 * ncclGetUniqueId, closed once every rank has joined) that hands each rank the listening address
 * of every other rank; ranks then connect into a full mesh and close their listening sockets, so
 * a live communicator holds exactly one established connection per peer and nothing else. */
#define _GNU_SOURCE
#include "sn.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SN_WIRE_MAGIC 0x534e5744u  /* every message header, join and hello */

struct sn_id {                     /* the 128 bytes of an ncclUniqueId */
  char magic[8];
  uint64_t tag;
  struct sn_addr root;
};

struct sn_join_msg { uint32_t magic; int32_t rank, nranks; uint32_t pad; uint64_t tag; struct sn_addr addr; };
struct sn_hello { uint32_t magic; int32_t rank; uint64_t tag; };

_Static_assert(sizeof(struct sn_id) <= NCCL_UNIQUE_ID_BYTES, "unique id too large");

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int ms_left(double deadline) {
  double left = deadline - now_s();
  if (left <= 0) return 0;
  return left > 1000.0 ? 1000000 : (int)(left * 1000.0) + 1;
}

uint64_t sn_random64(void) {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) v = (uint64_t)now_s() * 6364136223846793005ull ^ (uint64_t)getpid();
  return v;
}

/* The address of the first interface named by NCCL_SOCKET_IFNAME (a prefix, as in NCCL; entries
 * starting with ^ exclude and are skipped here), or the loopback address. */
struct in_addr sn_local_ip(void) {
  struct in_addr ip = {htonl(INADDR_LOOPBACK)};
  const char* env = getenv("NCCL_SOCKET_IFNAME");
  struct ifaddrs *ifs, *i;
  if (!env || !*env || getifaddrs(&ifs) != 0) return ip;
  char spec[256];
  snprintf(spec, sizeof spec, "%s", env);
  for (char *save = NULL, *tok = strtok_r(spec, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (*tok == '^') continue;
    int exact = *tok == '=';
    if (exact) tok++;
    for (i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      if (exact ? strcmp(i->ifa_name, tok) != 0 : strncmp(i->ifa_name, tok, strlen(tok)) != 0) continue;
      ip = ((struct sockaddr_in*)i->ifa_addr)->sin_addr;
      freeifaddrs(ifs);
      return ip;
    }
  }
  freeifaddrs(ifs);
  return ip;
}

int sn_listen(struct in_addr ip, struct sn_addr* bound) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr = ip, .sin_port = 0};
  socklen_t len = sizeof sa;
  int one = 1;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, (struct sockaddr*)&sa, sizeof sa) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, (struct sockaddr*)&sa, &len) != 0) {
    close(fd);
    return -1;
  }
  bound->ip = sa.sin_addr.s_addr;
  bound->port = sa.sin_port;
  bound->pad = 0;
  return fd;
}

static const char* addr_str(const struct sn_addr* a, char* buf, size_t n) {
  char ip[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a->ip, ip, sizeof ip);
  snprintf(buf, n, "%s:%u", ip, ntohs(a->port));
  return buf;
}

/* Blocking I/O on a blocking socket, bounded by an absolute deadline. 0 on success. */
static int io_all(int fd, void* buf, size_t len, int write, double deadline) {
  char* p = buf;
  while (len > 0) {
    struct pollfd pfd = {.fd = fd, .events = write ? POLLOUT : POLLIN};
    int rc = poll(&pfd, 1, ms_left(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return rc == 0 ? ETIMEDOUT : errno;
    ssize_t n = write ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return errno;
    if (n == 0) return ECONNRESET;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int connect_retry(const struct sn_addr* a, double deadline) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr = {a->ip}, .sin_port = a->port};
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr*)&sa, sizeof sa) == 0) return fd;
    int e = errno;
    close(fd);
    if (now_s() > deadline || (e != ECONNREFUSED && e != ETIMEDOUT && e != EINTR && e != EAGAIN)) {
      errno = e;
      return -1;
    }
    struct timespec nap = {0, 20 * 1000 * 1000};
    nanosleep(&nap, NULL);
  }
}

/* ---- rendezvous ------------------------------------------------------------------------------ */

struct sn_root { int lfd; uint64_t tag; };

static void* root_main(void* arg) {
  struct sn_root root = *(struct sn_root*)arg;
  free(arg);
  double deadline = now_s() + sn_timeout_s();
  int nranks = -1, joined = 0;
  int* fds = NULL;
  struct sn_addr* addrs = NULL;
  while (nranks < 0 || joined < nranks) {
    struct pollfd pfd = {.fd = root.lfd, .events = POLLIN};
    int rc = poll(&pfd, 1, ms_left(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) break;
    int fd = accept4(root.lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    struct sn_join_msg m;
    double short_deadline = now_s() + 10.0 < deadline ? now_s() + 10.0 : deadline;
    if (io_all(fd, &m, sizeof m, 0, short_deadline) != 0 || m.magic != SN_WIRE_MAGIC || m.tag != root.tag ||
        m.nranks <= 0 || (nranks > 0 && m.nranks != nranks) || m.rank < 0 || m.rank >= m.nranks) {
      close(fd);
      continue;
    }
    if (nranks < 0) {
      nranks = m.nranks;
      fds = malloc(sizeof(int) * (size_t)nranks);
      addrs = calloc((size_t)nranks, sizeof *addrs);
      if (!fds || !addrs) break;
      for (int r = 0; r < nranks; r++) fds[r] = -1;
    }
    if (fds[m.rank] >= 0) {  /* the same rank twice: keep the first */
      close(fd);
      continue;
    }
    fds[m.rank] = fd;
    addrs[m.rank] = m.addr;
    joined++;
  }
  for (int r = 0; r < nranks && fds; r++) {
    if (fds[r] < 0) continue;
    if (joined == nranks) io_all(fds[r], addrs, sizeof *addrs * (size_t)nranks, 1, deadline);
    close(fds[r]);  /* a rank that gets EOF instead of the table knows the rendezvous failed */
  }
  close(root.lfd);
  free(fds);
  free(addrs);
  return NULL;
}

ncclResult_t sn_make_id(ncclUniqueId* id) {
  struct sn_id sid;
  memset(id, 0, sizeof *id);
  memset(&sid, 0, sizeof sid);
  memcpy(sid.magic, SN_ID_MAGIC, sizeof sid.magic);
  sid.tag = sn_random64();
  struct sn_root* root = malloc(sizeof *root);
  if (!root) return sn_fail(ncclSystemError, "out of memory");
  root->tag = sid.tag;
  root->lfd = sn_listen(sn_local_ip(), &sid.root);
  if (root->lfd < 0) {
    free(root);
    return sn_fail(ncclSystemError, "cannot open the rendezvous listener: %s", strerror(errno));
  }
  pthread_t th;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&th, &attr, root_main, root);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    close(root->lfd);
    free(root);
    return sn_fail(ncclSystemError, "cannot start the rendezvous thread: %s", strerror(rc));
  }
  memcpy(id->internal, &sid, sizeof sid);
  return ncclSuccess;
}

ncclResult_t sn_join(struct ncclComm* c, const ncclUniqueId* id) {
  struct sn_id sid;
  char where[64];
  memcpy(&sid, id->internal, sizeof sid);
  if (memcmp(sid.magic, SN_ID_MAGIC, sizeof sid.magic) != 0)
    return sn_fail(ncclInvalidArgument, "not a stand-in unique id");
  double deadline = now_s() + sn_timeout_s();
  struct sn_join_msg m = {.magic = SN_WIRE_MAGIC, .rank = c->rank, .nranks = c->nranks, .tag = sid.tag};
  int lfd = sn_listen(c->ip, &m.addr);
  if (lfd < 0) return sn_fail(ncclSystemError, "cannot listen: %s", strerror(errno));
  int fd = connect_retry(&sid.root, deadline);
  if (fd < 0) {
    close(lfd);
    return sn_fail(ncclRemoteError, "cannot reach the rendezvous at %s: %s",
                   addr_str(&sid.root, where, sizeof where), strerror(errno));
  }
  struct sn_addr* addrs = calloc((size_t)c->nranks, sizeof *addrs);
  int e = addrs ? io_all(fd, &m, sizeof m, 1, deadline) : ENOMEM;
  if (e == 0) e = io_all(fd, addrs, sizeof *addrs * (size_t)c->nranks, 0, deadline);
  close(fd);
  if (e != 0) {
    close(lfd);
    free(addrs);
    return sn_fail(ncclRemoteError, "rendezvous at %s failed (rank %d of %d): %s",
                   addr_str(&sid.root, where, sizeof where), c->rank, c->nranks, strerror(e));
  }
  c->tag = sid.tag;
  ncclResult_t r = sn_mesh(c, addrs, lfd);
  close(lfd);
  free(addrs);
  return r;
}

/* Rank i connects to every rank below it and accepts every rank above it; the kernel's listen
 * backlog makes the order irrelevant. Each connection starts with a hello naming rank and tag. */
ncclResult_t sn_mesh(struct ncclComm* c, const struct sn_addr* addrs, int lfd) {
  double deadline = now_s() + sn_timeout_s();
  char where[64];
  int one = 1;
  c->fds = malloc(sizeof(int) * (size_t)c->nranks);
  if (!c->fds) return sn_fail(ncclSystemError, "out of memory");
  for (int r = 0; r < c->nranks; r++) c->fds[r] = -1;
  for (int r = 0; r < c->rank; r++) {
    struct sn_hello h = {.magic = SN_WIRE_MAGIC, .rank = c->rank, .tag = c->tag};
    int fd = connect_retry(&addrs[r], deadline);
    if (fd < 0 || io_all(fd, &h, sizeof h, 1, deadline) != 0) {
      int e = errno;
      if (fd >= 0) close(fd);
      return sn_fail(ncclRemoteError, "rank %d cannot connect to rank %d at %s: %s", c->rank, r,
                     addr_str(&addrs[r], where, sizeof where), strerror(e));
    }
    c->fds[r] = fd;
  }
  for (int missing = c->nranks - 1 - c->rank; missing > 0;) {
    struct pollfd pfd = {.fd = lfd, .events = POLLIN};
    int rc = poll(&pfd, 1, ms_left(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return sn_fail(ncclRemoteError, "rank %d: %d higher ranks never connected", c->rank, missing);
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    struct sn_hello h;
    if (io_all(fd, &h, sizeof h, 0, deadline) != 0 || h.magic != SN_WIRE_MAGIC || h.tag != c->tag ||
        h.rank <= c->rank || h.rank >= c->nranks || c->fds[h.rank] >= 0) {
      close(fd);
      continue;
    }
    c->fds[h.rank] = fd;
    missing--;
  }
  for (int r = 0; r < c->nranks; r++) {
    if (c->fds[r] < 0) continue;
    setsockopt(c->fds[r], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(c->fds[r], F_SETFL, fcntl(c->fds[r], F_GETFL) | O_NONBLOCK);
  }
  return ncclSuccess;
}

/* ---- data movement --------------------------------------------------------------------------- */

static int next_xfer(const struct sn_xfer* x, int n, int from, int peer, int send) {
  for (int i = from; i < n; i++)
    if (x[i].peer == peer && x[i].send == send) return i;
  return -1;
}

/* Moves bytes of x (a send or a receive) until it is complete or the socket would block.
 * Returns 1 when complete, 0 when blocked, -(ncclResult_t) on error (text set). */
static int pump(struct ncclComm* c, struct sn_xfer* x) {
  const size_t H = sizeof x->hdr;
  for (;;) {
    if (x->done == H && !x->send) {  /* header in: check it matches what this rank expects */
      uint32_t magic;
      uint64_t len;
      memcpy(&magic, x->hdr, 4);
      memcpy(&len, x->hdr + 8, 8);
      if (magic != SN_WIRE_MAGIC || len != x->len) {
        sn_fail(ncclInvalidUsage, "rank %d: peer %d sent %llu bytes where %zu were expected (mismatched calls)",
                c->rank, x->peer, (unsigned long long)len, x->len);
        return -(int)ncclInvalidUsage;
      }
    }
    if (x->done == H + x->len) return 1;
    char* p = x->done < H ? (char*)x->hdr + x->done : x->buf + (x->done - H);
    size_t want = x->done < H ? H - x->done : H + x->len - x->done;
    ssize_t n = x->send ? send(c->fds[x->peer], p, want, MSG_NOSIGNAL | MSG_DONTWAIT)
                        : recv(c->fds[x->peer], p, want, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      sn_fail(ncclRemoteError, "rank %d: connection to peer %d lost (%s)", c->rank, x->peer,
              n == 0 ? "closed by the peer" : strerror(errno));
      return -(int)ncclRemoteError;
    }
    x->done += (size_t)n;
  }
}

ncclResult_t sn_xfer_run(struct ncclComm* c, struct sn_xfer* x, int n) {
  int np = c->nranks;
  int* cur = malloc(sizeof(int) * 2 * (size_t)np);  /* cur[2p+send]: current message per peer+direction */
  struct pollfd* pfd = malloc(sizeof *pfd * (size_t)np);
  ncclResult_t r = ncclSuccess;
  if (!cur || !pfd) {
    free(cur);
    free(pfd);
    return sn_fail(ncclSystemError, "out of memory");
  }
  for (int i = 0; i < n; i++) {
    x[i].done = 0;
    if (x[i].send) {
      uint32_t magic = SN_WIRE_MAGIC;
      uint64_t len = x[i].len;
      memset(x[i].hdr, 0, sizeof x[i].hdr);
      memcpy(x[i].hdr, &magic, 4);
      memcpy(x[i].hdr + 8, &len, 8);
    }
  }
  for (int p = 0; p < np; p++)
    for (int s = 0; s < 2; s++) cur[2 * p + s] = next_xfer(x, n, 0, p, s);
  double timeout = sn_timeout_s(), last = now_s();
  for (;;) {
    int active = 0, moved = 0;
    for (int p = 0; p < np; p++) {
      pfd[p].fd = -1;
      pfd[p].events = 0;
      pfd[p].revents = 0;
      if (cur[2 * p] >= 0) pfd[p].events |= POLLIN;
      if (cur[2 * p + 1] >= 0) pfd[p].events |= POLLOUT;
      if (pfd[p].events) {
        pfd[p].fd = c->fds[p];
        active++;
      }
    }
    if (!active) break;
    int rc = poll(pfd, (nfds_t)np, 100);
    if (rc < 0 && errno != EINTR) {
      r = sn_fail(ncclSystemError, "poll: %s", strerror(errno));
      break;
    }
    if (__atomic_load_n(&c->aborting, __ATOMIC_ACQUIRE)) {
      r = sn_fail(ncclRemoteError, "communicator aborted");
      break;
    }
    for (int p = 0; p < np && r == ncclSuccess; p++) {
      if (!pfd[p].revents) continue;
      for (int s = 1; s >= 0; s--) {  /* sends first: a peer may be waiting for our bytes */
        int* ci = &cur[2 * p + s];
        while (*ci >= 0) {
          size_t before = x[*ci].done;
          int st = pump(c, &x[*ci]);
          if (x[*ci].done != before) moved = 1;
          if (st < 0) {
            r = (ncclResult_t)-st;
            break;
          }
          if (st == 0) break;
          *ci = next_xfer(x, n, *ci + 1, p, s);
        }
        if (r != ncclSuccess) break;
      }
    }
    if (r != ncclSuccess) break;
    if (moved) {
      last = now_s();
    } else if (now_s() - last > timeout) {
      r = sn_fail(ncclRemoteError, "rank %d: no progress for %.0f s (STANDIN_NCCL_TIMEOUT_S)", c->rank, timeout);
      break;
    }
  }
  free(cur);
  free(pfd);
  return r;
}
