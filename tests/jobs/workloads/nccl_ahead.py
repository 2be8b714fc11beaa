"""Host threads running many operations ahead: the main thread enqueues a step's 24 allreduces before it
synchronizes once; a second thread per rank, on its own communicator and stream, enqueues 40 broadcasts
per step and synchronizes only then. The two meet at the end of each step. See ncclstep.py."""

import threading

from ncclstep import FLOAT64, Job, buffer, init_values, mix, zeros

N = 8
MAIN, SIDE = 0x500, 0x501
OPS_MAIN, OPS_SIDE = 24, 40


def main() -> None:
    job = Job()
    world = job.comm("world")
    side = job.comm("side")
    x = buffer(FLOAT64, init_values(job.rank, N))
    outs = [zeros(FLOAT64, N) for _ in range(OPS_MAIN)]
    y = buffer(FLOAT64, init_values(job.rank, N, salt=3))
    bufs = [zeros(FLOAT64, N) for _ in range(OPS_SIDE)]
    go = [threading.Semaphore(0), threading.Semaphore(0)]
    steps = job.args.steps

    def side_thread() -> None:
        for step in range(steps):
            go[0].acquire()
            for k in range(OPS_SIDE):
                bufs[k][:] = y[:]
                job.broadcast(bufs[k], (step + k) % job.nranks, side, SIDE)
            job.sync(SIDE)
            for k in range(OPS_SIDE):
                mix(y, bufs[k], 0.001)
            go[1].release()

    th = threading.Thread(target=side_thread)
    th.start()
    for step in range(steps):
        job.before_step(step)
        go[0].release()
        for k in range(OPS_MAIN):
            job.allreduce(x, outs[k], world, MAIN)
        job.sync(MAIN)
        for k in range(OPS_MAIN):
            mix(x, outs[k], 0.0001 * (k + 1))
        go[1].acquire()
        job.report(step, x, y)
    th.join()
    job.finish(side, world)


if __name__ == "__main__":
    main()
