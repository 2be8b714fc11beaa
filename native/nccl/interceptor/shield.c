/* The SIGTERM shield: a worker ignores a SIGTERM that is not its sandbox's own.
 *
 * A scheduler that ends a job signals every process it tracks, not only the one it started: Slurm's scancel,
 * time limit, requeue and preemption send SIGTERM to the whole step (proctrack/linuxproc by parentage,
 * proctrack/cgroup by cgroup), then SIGKILL after KillWait. When the agent owns SIGTERM (`cryosleep run --grace`),
 * that SIGTERM is its cue for a stop snapshot, and the workers must live until the snapshot has them. The agent
 * then sets CRYOSLEEP_TERM_SHIELD=1 for the workers; at load, this library installs a SIGTERM handler (only where
 * the disposition is still the default: a program's own handler, installed later, replaces it) that lets through
 * only a SIGTERM queued with the sandbox's mark (sigqueue with CS_SIGNAL_MARK: cryosleep-init forwarding what the
 * agent decided, e.g. after a failed stop snapshot), which then ends the worker as the default action would; any
 * other SIGTERM is dropped. SIGKILL, and every other signal, is untouched. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#define CS_SIGNAL_MARK 0x43525953 /* "CRYS", also in cryosleep-init and cryosleep.agent.proctree */

static void on_term(int sig, siginfo_t *si, void *uc) {
  (void)uc;
  if (si->si_code == SI_QUEUE && si->si_value.sival_int == CS_SIGNAL_MARK) {
    signal(sig, SIG_DFL); /* delivered again as the handler returns: the default action */
    raise(sig);
  }
}

__attribute__((constructor)) static void cs_shield_init(void) {
  const char *v = getenv("CRYOSLEEP_TERM_SHIELD");
  struct sigaction old, sa;

  if (!v || strcmp(v, "1") != 0)
    return;
  if (sigaction(SIGTERM, NULL, &old) != 0 || (!(old.sa_flags & SA_SIGINFO) && old.sa_handler != SIG_DFL))
    return;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_term;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
}
