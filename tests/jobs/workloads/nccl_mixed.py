"""Everything at once, for the randomized cuts: the world (from an id) and its split by parity with the
collectives issued in a rank-dependent order on their own streams, a ring in one group, a chain of
ungrouped sends and receives, and a second thread per rank running ahead on its own communicator.
Needs an even number of ranks. See ncclstep.py."""

import threading

from ncclstep import FLOAT64, Job, buffer, init_values, mix, zeros

N = 16
WORLD, SUB, P2P, SIDE = 0x600, 0x601, 0x602, 0x603
OPS_SIDE = 12


def main() -> None:
    job = Job()
    n, r = job.nranks, job.rank
    world = job.comm("world")
    sub = job.split(world, r % 2, r)
    side = job.comm("side")
    assert sub is not None
    x = buffer(FLOAT64, init_values(r, N))
    y = buffer(FLOAT64, init_values(r, N, salt=9))
    a, b, left, chain = zeros(FLOAT64, N), zeros(FLOAT64, N), zeros(FLOAT64, N), zeros(FLOAT64, N)
    bufs = [zeros(FLOAT64, N) for _ in range(OPS_SIDE)]
    go = [threading.Semaphore(0), threading.Semaphore(0)]
    steps = job.args.steps

    def side_thread() -> None:
        for step in range(steps):
            go[0].acquire()
            for k in range(OPS_SIDE):
                job.allreduce(y, bufs[k], side, SIDE)
            job.sync(SIDE)
            for k in range(OPS_SIDE):
                mix(y, bufs[k], 0.0001 * (k + step % 3))
            go[1].release()

    th = threading.Thread(target=side_thread)
    th.start()
    for step in range(steps):
        job.before_step(step)
        go[0].release()
        if r % 2:
            job.allreduce(x, a, world, WORLD)
            job.allreduce(x, b, sub, SUB)
        else:
            job.allreduce(x, b, sub, SUB)
            job.allreduce(x, a, world, WORLD)
        with job.group():
            job.send(x, (r + 1) % n, world, P2P)
            job.recv(left, (r - 1) % n, world, P2P)
        if r > 0:  # a chain: each rank waits for its left neighbour's value, then passes it on
            job.recv(chain, r - 1, world, P2P)
            job.sync(P2P)
        else:
            chain[:] = x[:]
        mix(chain, x, 0.5)
        if r < n - 1:
            job.send(chain, r + 1, world, P2P)
        job.sync(WORLD, SUB, P2P)
        mix(x, a, 0.001)
        mix(x, b, 0.002)
        mix(x, left, 0.25)
        mix(x, chain, 0.003)
        go[1].acquire()
        job.report(step, x, y)
    th.join()
    job.finish(side, sub, world)


if __name__ == "__main__":
    main()
