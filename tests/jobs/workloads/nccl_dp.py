"""Data parallel: every step each rank makes "gradients" from its parameters, allreduces them over the world
in three buckets (enqueued, then one synchronize, as DDP does), and applies them. See ncclstep.py."""

from ncclstep import FLOAT64, Job, buffer, init_values, mix, zeros

N = 48
STREAM = 0x100


def main() -> None:
    job = Job()
    world = job.comm("world")
    extra = job.extra_comms(world)
    params = buffer(FLOAT64, init_values(job.rank, 3 * N))
    grads = [zeros(FLOAT64, N) for _ in range(3)]
    summed = [zeros(FLOAT64, N) for _ in range(3)]
    for step in range(job.args.steps):
        job.before_step(step)
        for b in range(3):
            for i in range(N):
                grads[b][i] = (params[b * N + i] * (job.rank + 1) + step) % 13.0
            job.allreduce(grads[b], summed[b], world, STREAM)
        job.sync(STREAM)
        for b in range(3):
            for i in range(N):
                params[b * N + i] = (params[b * N + i] - 0.01 * summed[b][i] / job.nranks) % 1000.0
        mix(params, params, 0.5)
        job.report(step, params)
    job.finish(*reversed(extra), world)


if __name__ == "__main__":
    main()
