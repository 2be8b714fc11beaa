/*
 * cryosleep-init: PID 1 of a Cryosleep sandbox.
 *
 *   cryosleep-init --spawn [--mount-ns] [--net-ns --wait-fd FD] -n NPROC [-b RANK_BASE] -l LOG_DIR
 *                  [-u UID -g GID -G GID,...|-] -- PROGRAM [ARGS...]
 *
 * With --spawn the program unshares a new PID namespace, forks the init into it and prints the init's
 * host PID on stdout before exiting, so that the init is re-parented to the caller (which must be a
 * child subreaper, PR_SET_CHILD_SUBREAPER). A restored sandbox reaches the caller the same way (CRIU
 * restores it detached), so the agent supervises fresh and restored sandboxes alike.
 *
 * With --net-ns the sandbox also gets a network namespace of its own (only a downed loopback in it). The
 * caller then configures it from outside (moves a veth end in by the init's PID, sets its job address) and
 * says it is done by writing one byte to the pipe whose read end is FD (--wait-fd); the init starts no
 * worker before that byte. If the pipe closes without it (the caller failed or died), the init exits 127.
 *
 * The init calls setsid() (CRIU refuses a tree whose session leader is outside its PID namespace),
 * starts NPROC workers with LOCAL_RANK=i, RANK=RANK_BASE+i (and torchrun's ROLE_RANK; every "{rank}" in
 * CRYOSLEEP_NCCL_CTL and TORCHELASTIC_ERROR_FILE becomes the worker's RANK, so that each has its own NCCL
 * control file and error file), stdin on /dev/null
 * and stdout/stderr appended to LOG_DIR/rank-<RANK>.log, forwards SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2
 * to them (queued with a mark that the workers' SIGTERM shield lets through: with CRYOSLEEP_TERM_SHIELD=1, a
 * SIGTERM that was not queued with it, a scheduler's to the whole tree, is not forwarded; native/nccl/interceptor/
 * shield.c), reaps every process (orphans included), and writes each worker's exit status to
 * LOG_DIR/rank-<RANK>.exit. When a worker fails the others are sent SIGTERM, then SIGKILL after
 * CRYOSLEEP_KILL_GRACE_S seconds (default 10), like torchrun. It exits with the first failing worker's code
 * (128+signal for a signal), or 0 when all succeeded.
 *
 * With -u/-g/-G each worker runs as that uid, gid and supplementary groups ("-": none), so without any
 * capability; the init stays root (it signals and reaps them). Its log is opened before the switch.
 *
 * It holds no file open while it waits, so a snapshot sees only the workers' own files.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <grp.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 1024

static pid_t workers[MAX_WORKERS];
static int worker_rank[MAX_WORKERS];
static int nworkers;
static volatile sig_atomic_t pending_signal;
static volatile sig_atomic_t alarm_fired;

#define MAX_GROUPS 256
static int as_user; /* -u given: the workers run as worker_uid, worker_gid, worker_groups */
static uid_t worker_uid;
static gid_t worker_gid;
static gid_t worker_groups[MAX_GROUPS];
static int nworker_groups;

#define CS_SIGNAL_MARK 0x43525953 /* "CRYS": a signal the agent means (also in the interceptor's shield.c) */
static int term_shield; /* CRYOSLEEP_TERM_SHIELD=1: a SIGTERM not queued with the mark is not forwarded */

static void on_signal(int sig, siginfo_t *si, void *uc) {
	(void)uc;
	if (sig == SIGTERM && term_shield && !(si->si_code == SI_QUEUE && si->si_value.sival_int == CS_SIGNAL_MARK))
		return; /* a scheduler's SIGTERM to the whole tree: the agent has it too, and decides */
	pending_signal = sig;
}
static void on_alarm(int sig) { (void)sig; alarm_fired = 1; }

static void die(const char *what) {
	fprintf(stderr, "cryosleep-init: %s: %s\n", what, strerror(errno));
	_exit(127);
}

static void usage(void) {
	fprintf(stderr, "usage: cryosleep-init [--spawn [--mount-ns] [--net-ns --wait-fd FD]] -n NPROC [-b RANK_BASE] "
			"-l LOG_DIR [-u UID -g GID -G GID,...|-] -- PROGRAM [ARGS...]\n");
	exit(2);
}

static void write_exit_file(const char *log_dir, int rank, int status) {
	char path[4096], text[64];
	int fd, len;

	snprintf(path, sizeof(path), "%s/rank-%d.exit", log_dir, rank);
	if (WIFEXITED(status))
		len = snprintf(text, sizeof(text), "exit %d\n", WEXITSTATUS(status));
	else
		len = snprintf(text, sizeof(text), "signal %d\n", WTERMSIG(status));
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	if (write(fd, text, (size_t)len) != len)
		fprintf(stderr, "cryosleep-init: short write to %s\n", path);
	close(fd);
}

/* Replaces every "{rank}" in the variable `name` by `rank` (each worker gets its own NCCL control file). */
static void expand_rank(const char *name, const char *rank) {
	const char *val = getenv(name), *at;
	char out[4096];
	size_t n = 0;

	if (!val || !strstr(val, "{rank}"))
		return;
	while ((at = strstr(val, "{rank}")) != NULL && n < sizeof(out)) {
		n += (size_t)snprintf(out + n, sizeof(out) - n, "%.*s%s", (int)(at - val), val, rank);
		val = at + 6;
	}
	if (n < sizeof(out))
		n += (size_t)snprintf(out + n, sizeof(out) - n, "%s", val);
	if (n >= sizeof(out)) {
		fprintf(stderr, "cryosleep-init: %s is too long\n", name);
		_exit(127);
	}
	setenv(name, out, 1);
}

static pid_t start_worker(int local_rank, int rank, const char *log_dir, char **argv) {
	char path[4096], buf[32];
	pid_t pid = fork();

	if (pid < 0)
		die("fork");
	if (pid > 0)
		return pid;

	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	for (int s = 1; s < NSIG; s++)
		signal(s, SIG_DFL);

	snprintf(buf, sizeof(buf), "%d", local_rank);
	setenv("LOCAL_RANK", buf, 1);
	snprintf(buf, sizeof(buf), "%d", rank);
	setenv("RANK", buf, 1);
	setenv("ROLE_RANK", buf, 1);
	expand_rank("CRYOSLEEP_NCCL_CTL", buf);
	expand_rank("TORCHELASTIC_ERROR_FILE", buf);

	int null = open("/dev/null", O_RDONLY);
	snprintf(path, sizeof(path), "%s/rank-%d.log", log_dir, rank);
	int log = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
	if (null < 0 || log < 0)
		die(path);
	if (dup2(null, 0) < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0)
		die("dup2");
	close(null);
	close(log);
	if (as_user) { /* groups first: after setuid nothing more can be changed */
		if (setgroups((size_t)nworker_groups, worker_groups) < 0 || setgid(worker_gid) < 0 ||
		    setuid(worker_uid) < 0)
			die("switching the worker to its user");
		if (setuid(0) == 0) { /* a worker that could become root again would have kept its privileges */
			fprintf(stderr, "cryosleep-init: the worker could regain root after setuid(%u)\n", worker_uid);
			_exit(127);
		}
	}
	execvp(argv[0], argv);
	fprintf(stderr, "cryosleep-init: cannot run %s: %s\n", argv[0], strerror(errno));
	_exit(127);
}

/* Queued with the mark, so that a worker's SIGTERM shield lets it through (the init's signals are meant). */
static void signal_workers(int sig) {
	union sigval mark = {.sival_int = CS_SIGNAL_MARK};

	for (int i = 0; i < nworkers; i++)
		if (workers[i] > 0 && (sig == SIGKILL ? kill(workers[i], sig) : sigqueue(workers[i], sig, mark)) < 0)
			kill(workers[i], sig);
}

static int run_init(int nproc, int rank_base, const char *log_dir, char **argv) {
	int result = 0, failed = 0, alive;
	struct timespec kill_at = {0, 0};
	const char *grace_env = getenv("CRYOSLEEP_KILL_GRACE_S");
	int grace = grace_env ? atoi(grace_env) : 10;

	if (setsid() < 0 && getpid() != getsid(0))
		die("setsid");
	prctl(PR_SET_NAME, "cryosleep-init", 0, 0, 0);

	const char *shield = getenv("CRYOSLEEP_TERM_SHIELD");
	term_shield = shield && !strcmp(shield, "1");

	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = on_signal;
	sa.sa_flags = SA_SIGINFO;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);

	nworkers = nproc;
	for (int i = 0; i < nproc; i++) {
		worker_rank[i] = rank_base + i;
		workers[i] = start_worker(i, rank_base + i, log_dir, argv);
	}

	alive = nproc;
	while (alive > 0) {
		int status;
		pid_t pid = waitpid(-1, &status, 0);

		if (pending_signal) {
			int sig = pending_signal;
			pending_signal = 0;
			signal_workers(sig);
		}
		if (pid < 0) {
			if (errno == EINTR) {
				if (alarm_fired && kill_at.tv_sec) {
					alarm_fired = 0;
					struct timespec now;
					clock_gettime(CLOCK_MONOTONIC, &now);
					if (now.tv_sec >= kill_at.tv_sec)
						signal_workers(SIGKILL);
					else
						alarm(1);
				}
				continue;
			}
			if (errno == ECHILD)
				break;
			die("waitpid");
		}
		for (int i = 0; i < nworkers; i++) {
			if (workers[i] != pid)
				continue;
			workers[i] = 0;
			alive--;
			write_exit_file(log_dir, worker_rank[i], status);
			int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
			if (code != 0 && !failed) {
				failed = 1;
				result = code;
				signal_workers(SIGTERM);
				clock_gettime(CLOCK_MONOTONIC, &kill_at);
				kill_at.tv_sec += grace;
				struct sigaction al;
				memset(&al, 0, sizeof(al));
				al.sa_handler = on_alarm;
				sigaction(SIGALRM, &al, NULL);
				alarm(1);
			}
		}
	}
	return result;
}

int main(int argc, char **argv) {
	int spawn = 0, mount_ns = 0, net_ns = 0, wait_fd = -1, nproc = -1, rank_base = 0, i;
	const char *log_dir = NULL;

	for (i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--spawn"))
			spawn = 1;
		else if (!strcmp(argv[i], "--mount-ns"))
			mount_ns = 1;
		else if (!strcmp(argv[i], "--net-ns"))
			net_ns = 1;
		else if (!strcmp(argv[i], "--wait-fd") && i + 1 < argc)
			wait_fd = atoi(argv[++i]);
		else if (!strcmp(argv[i], "-n") && i + 1 < argc)
			nproc = atoi(argv[++i]);
		else if (!strcmp(argv[i], "-b") && i + 1 < argc)
			rank_base = atoi(argv[++i]);
		else if (!strcmp(argv[i], "-l") && i + 1 < argc)
			log_dir = argv[++i];
		else if (!strcmp(argv[i], "-u") && i + 1 < argc) {
			as_user = 1;
			worker_uid = (uid_t)strtoul(argv[++i], NULL, 10);
		} else if (!strcmp(argv[i], "-g") && i + 1 < argc)
			worker_gid = (gid_t)strtoul(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "-G") && i + 1 < argc) {
			char *list = argv[++i], *end;
			while (strcmp(list, "-") && *list && nworker_groups < MAX_GROUPS) {
				worker_groups[nworker_groups++] = (gid_t)strtoul(list, &end, 10);
				if (end == list || (*end && *end != ','))
					usage();
				list = *end ? end + 1 : end;
			}
		}
		else if (!strcmp(argv[i], "--")) {
			i++;
			break;
		} else
			usage();
	}
	if (nproc < 1 || nproc > MAX_WORKERS || !log_dir || i >= argc)
		usage();
	if ((net_ns && (!spawn || wait_fd < 0)) || (!net_ns && wait_fd >= 0))
		usage();

	if (spawn) {
		if (unshare(CLONE_NEWPID | (mount_ns ? CLONE_NEWNS : 0) | (net_ns ? CLONE_NEWNET : 0)) < 0)
			die("unshare(CLONE_NEWPID)");
		pid_t pid = fork();
		if (pid < 0)
			die("fork");
		if (pid > 0) {
			printf("%d\n", pid);
			fflush(stdout);
			_exit(0);
		}
		if (mount_ns) {
			/*
			 * A /proc of our own PID namespace: the CUDA driver reads /proc/self/task/<tid>/comm with
			 * the tid it sees, which only the namespace's own /proc has. Mounts stay private so that
			 * nothing propagates back to the host.
			 */
			if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
				die("make / private");
			if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
				die("mount /proc");
		}
		/* In the new namespace: stdout was the spawner's pipe; nothing of it is kept (the caller reads
		 * it to its end, so it must be closed before waiting for the caller below). */
		int null = open("/dev/null", O_RDWR);
		if (null < 0)
			die("/dev/null");
		dup2(null, 0);
		dup2(null, 1);
		dup2(null, 2);
		if (null > 2)
			close(null);
		if (wait_fd >= 0) {
			/* The caller is configuring our network namespace: wait for its one byte. */
			char go;
			ssize_t got;
			do
				got = read(wait_fd, &go, 1);
			while (got < 0 && errno == EINTR);
			if (got != 1)
				_exit(127);
		}
		/* Nothing opened outside the namespace is kept: CRIU could not place its mount. */
		for (int fd = 3; fd < 1024; fd++)
			close(fd);
		if (mount_ns) {
			/*
			 * Execute ourselves again, so that even our own binary is mapped through the new mount
			 * namespace (CRIU cannot place a mapping whose mount lives outside the dumped tree).
			 */
			char **args = calloc((size_t)argc + 1, sizeof(char *));
			int n = 0;
			if (!args)
				die("calloc");
			args[n++] = argv[0];
			for (int k = 1; k < argc; k++) {
				if (k >= i) { /* the program and its arguments, as they are */
					args[n++] = argv[k];
					continue;
				}
				if (!strcmp(argv[k], "--wait-fd")) {
					k++; /* and its value */
					continue;
				}
				if (strcmp(argv[k], "--spawn") && strcmp(argv[k], "--mount-ns") && strcmp(argv[k], "--net-ns"))
					args[n++] = argv[k];
			}
			/* By path, not through the /proc/self/exe magic link, which would keep the host's mount. */
			char self[4096];
			ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
			if (len <= 0)
				die("readlink /proc/self/exe");
			self[len] = 0;
			execv(self, args);
			die("re-exec in the sandbox");
		}
	}
	return run_init(nproc, rank_base, log_dir, &argv[i]);
}
