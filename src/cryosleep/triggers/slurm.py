"""Slurm: after a stop snapshot of a batch job, ask Slurm to requeue it, so that the same batch script resumes it.

Under Slurm the agent is the batch script's process (``exec cryosleep run ...``) and sees ``SLURM_JOB_ID``. Once
a stop has ended the job suspended (its snapshot verified where it is stored), :func:`decide` chooses, from the
trigger and the job as ``scontrol show job`` describes it:

    SIGUSR1, a cloud notice   requeue (``scontrol requeue JOBID``): the job was warned (``--signal=B:USR1@N`` before
                              its time limit, or at a preemption with ``PreemptParameters=send_user_signal``) or its
                              machine is going; the requeued run of the same script restores the snapshot
    SIGTERM                   no requeue: Slurm is ending the job itself: ``scancel`` (the user wants it gone: it
                              stays suspended in its snapshot, and a new ``sbatch`` of the script resumes it), or a
                              preemption or ``scontrol requeue`` that requeues it anyway
    not requeueable           no requeue (``--no-requeue``, ``JobRequeue=0``, not a batch job): the job ends
                              suspended; resubmitting the script resumes it

Every choice goes to the job's decision log (trigger ``slurm``) with its reasons, and its outcome after it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

REQUEUE = "requeue"
NO_REQUEUE = "no-requeue"
SCONTROL_TIMEOUT_S = 30.0


@dataclass
class SlurmJob:
    """What the agent knows of the Slurm job it runs in."""

    job_id: str
    batch: bool | None = None
    """BatchFlag: the job runs a batch script (None: unknown)."""
    requeue: bool | None = None
    """Requeue: the job may be requeued (sbatch --requeue, or JobRequeue=1 without --no-requeue; None: unknown)."""
    state: str = ""
    restarts: int = 0
    error: str = ""
    """Why ``scontrol show job`` could not say (empty when it did)."""


@dataclass
class Choice:
    action: str
    reasons: list[str] = field(default_factory=list)


def job_id(env: dict[str, str] | None = None) -> str | None:
    """The Slurm job this process runs in, if any."""
    env = dict(os.environ) if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol show job -o ID``'s one line as a dict."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(?:^|\s)([A-Za-z_:/]+)=(.*?)(?=\s[A-Za-z_:/]+=|$)",
                                                         text.strip())}


def describe(jid: str) -> SlurmJob:
    """The job as slurmctld knows it now."""
    exe = shutil.which("scontrol")
    if exe is None:
        return SlurmJob(jid, error="scontrol is not on PATH")
    try:
        res = subprocess.run([exe, "show", "job", "-o", jid], capture_output=True, text=True,
                             timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return SlurmJob(jid, error=f"scontrol show job {jid}: {e}")
    if res.returncode != 0:
        return SlurmJob(jid, error=f"scontrol show job {jid}: {res.stderr.strip() or f'exit {res.returncode}'}")
    f = parse_show_job(res.stdout)
    try:
        restarts = int(f.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    return SlurmJob(jid, batch=f.get("BatchFlag") == "1" if "BatchFlag" in f else None,
                    requeue=f.get("Requeue") == "1" if "Requeue" in f else None, state=f.get("JobState", ""),
                    restarts=restarts)


def decide(trigger: str, job: SlurmJob) -> Choice:
    """Requeue the job that a stop snapshot just suspended, or not, and why (pure)."""
    if trigger == "sigterm":
        return Choice(NO_REQUEUE, [
            "SIGTERM: Slurm is ending the job itself (scancel: it stays suspended, and a new sbatch of the same "
            "script resumes it; a preemption or scontrol requeue requeues it without Cryosleep)"])
    if job.error:
        return Choice(NO_REQUEUE, [f"cannot tell whether job {job.job_id} may be requeued ({job.error}); it ends "
                                   "suspended: resubmit the same script to resume it"])
    if job.batch is False:
        return Choice(NO_REQUEUE, [f"job {job.job_id} is not a batch job (salloc/srun): Slurm cannot requeue it; "
                                   "run the same command again to resume it"])
    if job.requeue is False:
        return Choice(NO_REQUEUE, [f"job {job.job_id} may not be requeued (sbatch --no-requeue, or JobRequeue=0 "
                                   "without --requeue); it ends suspended: resubmit the same script to resume it"])
    return Choice(REQUEUE, [f"{trigger}: a warning before Slurm ends the job (the time limit, a preemption) or a "
                            f"machine going; job {job.job_id} is requeueable: the requeued run of the same script "
                            "resumes the snapshot"])


def requeue(jid: str) -> tuple[bool, str]:
    """``scontrol requeue JOBID``: (done, what scontrol said)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return False, "scontrol is not on PATH"
    try:
        res = subprocess.run([exe, "requeue", jid], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                             check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"scontrol requeue {jid}: {e}"
    if res.returncode != 0:
        return False, f"scontrol requeue {jid}: {res.stderr.strip() or f'exit {res.returncode}'}"
    return True, f"scontrol requeue {jid}: done"


def to_json(job: SlurmJob) -> dict[str, Any]:
    return {"job_id": job.job_id, "batch": job.batch, "requeue": job.requeue, "state": job.state,
            "restarts": job.restarts, **({"error": job.error} if job.error else {})}
