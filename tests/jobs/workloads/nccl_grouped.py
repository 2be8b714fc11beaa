"""Grouped operations: per step a ring exchange (send right, receive left) in one group, an all-to-all
made of sends and receives to every peer in one group, and a group of collectives on the world and on a
split of it. See ncclstep.py."""

from ncclstep import FLOAT64, Job, buffer, init_values, mix, zeros

N = 16
STREAM = 0x400


def main() -> None:
    job = Job()
    world = job.comm("world")
    n, r = job.nranks, job.rank
    pair = job.split(world, r // 2, r)
    assert pair is not None
    x = buffer(FLOAT64, init_values(r, N))
    left = zeros(FLOAT64, N)
    inbox = [zeros(FLOAT64, N) for _ in range(n)]
    a, b = zeros(FLOAT64, N), zeros(FLOAT64, N)
    for step in range(job.args.steps):
        job.before_step(step)
        with job.group():
            job.send(x, (r + 1) % n, world, STREAM)
            job.recv(left, (r - 1) % n, world, STREAM)
        job.sync(STREAM)
        with job.group():
            for p in range(n):
                if p != r:
                    job.send(x, p, world, STREAM)
                    job.recv(inbox[p], p, world, STREAM)
        job.sync(STREAM)
        with job.group():
            job.allreduce(left, a, world, STREAM)
            job.allreduce(x, b, pair, STREAM)
        job.sync(STREAM)
        mix(x, left, 0.25)
        for p in range(n):
            if p != r:
                mix(x, inbox[p], 0.01 * (p + 1))
        mix(x, a, 0.001)
        mix(x, b, 0.002)
        job.report(step, x)
    job.finish(pair, world)


if __name__ == "__main__":
    main()
