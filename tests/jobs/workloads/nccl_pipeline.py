"""Pipeline stages: rank s receives each micro-batch's activations from s-1 (ungrouped ncclRecv, then a
synchronize to use them), transforms them and sends them on to s+1; then the gradients go back the other
way; at the end of the step the stages allreduce a loss. See ncclstep.py."""

from ncclstep import FLOAT64, Job, buffer, init_values, zeros

N = 24
MICRO = 3
STREAM = 0x300


def main() -> None:
    job = Job()
    world = job.comm("world")
    s, last = job.rank, job.nranks - 1
    weights = buffer(FLOAT64, init_values(s, N, salt=5))
    acts = [zeros(FLOAT64, N) for _ in range(MICRO)]
    grads = [zeros(FLOAT64, N) for _ in range(MICRO)]
    loss = zeros(FLOAT64, 1)
    total = zeros(FLOAT64, 1)
    for step in range(job.args.steps):
        job.before_step(step)
        for m in range(MICRO):  # forward
            if s == 0:
                for i in range(N):
                    acts[m][i] = (step * 0.5 + m + i * 0.25) % 7.0
            else:
                job.recv(acts[m], s - 1, world, STREAM)
                job.sync(STREAM)
            for i in range(N):
                acts[m][i] = (acts[m][i] * 0.5 + weights[i]) % 100.0
            if s < last:
                job.send(acts[m], s + 1, world, STREAM)
        for m in reversed(range(MICRO)):  # backward
            if s == last:
                for i in range(N):
                    grads[m][i] = acts[m][i] * 0.01
            else:
                job.recv(grads[m], s + 1, world, STREAM)
                job.sync(STREAM)
            for i in range(N):
                weights[i] = (weights[i] - 0.1 * grads[m][i]) % 100.0
                grads[m][i] = grads[m][i] * 0.5 + weights[i] * 0.001
            if s > 0:
                job.send(grads[m], s - 1, world, STREAM)
        job.sync(STREAM)
        loss[0] = sum(weights) % 1000.0
        job.allreduce(loss, total, world, STREAM)
        job.sync(STREAM)
        job.report(step, weights, total)
    job.finish(world)


if __name__ == "__main__":
    main()
