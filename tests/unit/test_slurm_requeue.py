"""triggers/slurm.py: whether a suspended Slurm batch job is requeued, and how `scontrol show job` is read."""

from __future__ import annotations

from cryosleep.triggers import slurm

SHOW = ("JobId=42 JobName=train UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 JobState=RUNNING "
        "Reason=None Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 ExitCode=0:0 Command=/home/u/train.sbatch "
        "WorkDir=/home/u StdOut=/home/u/out 42.txt")


def test_show_job_is_read_key_by_key() -> None:
    f = slurm.parse_show_job(SHOW)
    assert f["JobId"] == "42" and f["Requeue"] == "1" and f["Restarts"] == "2" and f["BatchFlag"] == "1"
    assert f["GroupId"] == "root(0)" and f["MCS_label"] == "N/A"
    assert f["StdOut"] == "/home/u/out 42.txt"  # a value with a space runs to the next Key=


def test_a_warned_requeueable_batch_job_is_requeued() -> None:
    job = slurm.SlurmJob("42", batch=True, requeue=True)
    for trigger in ("sigusr1", "notice:aws"):
        c = slurm.decide(trigger, job)
        assert c.action == slurm.REQUEUE and "42" in c.reasons[0]


def test_sigterm_is_never_requeued_by_cryosleep() -> None:
    c = slurm.decide("sigterm", slurm.SlurmJob("42", batch=True, requeue=True))
    assert c.action == slurm.NO_REQUEUE and "scancel" in c.reasons[0]


def test_a_job_that_may_not_be_requeued_ends_suspended() -> None:
    for job, why in ((slurm.SlurmJob("42", batch=True, requeue=False), "--no-requeue"),
                     (slurm.SlurmJob("42", batch=False, requeue=True), "not a batch job"),
                     (slurm.SlurmJob("42", error="scontrol is not on PATH"), "scontrol is not on PATH")):
        c = slurm.decide("sigusr1", job)
        assert c.action == slurm.NO_REQUEUE and why in c.reasons[0], c


def test_the_job_id_comes_from_slurms_environment() -> None:
    assert slurm.job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert slurm.job_id({"SLURM_JOBID": "8"}) == "8"
    assert slurm.job_id({}) is None
