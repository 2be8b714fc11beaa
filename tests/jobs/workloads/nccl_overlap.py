"""Two overlapping communicators and more: the world (from an id), its split by parity and its split by
halves; within a step every rank issues its collectives in its own order (each communicator on its own
stream, as PyTorch gives each process group one), then synchronizes. Needs 4 ranks. See ncclstep.py."""

from ncclstep import FLOAT64, Job, buffer, init_values, mix, zeros

N = 32
STREAMS = {"world": 0x200, "parity": 0x201, "half": 0x202}


def main() -> None:
    job = Job()
    comms = {"world": job.comm("world")}
    parity = job.split(comms["world"], job.rank % 2, job.rank)
    half = job.split(comms["world"], job.rank // 2, -job.rank)
    assert parity is not None and half is not None
    comms.update(parity=parity, half=half)
    order = [["parity", "world", "half"], ["world", "half", "parity"], ["half", "parity", "world"],
             ["world", "parity", "half"]][job.rank % 4]
    x = buffer(FLOAT64, init_values(job.rank, N))
    out = {name: zeros(FLOAT64, N) for name in comms}
    for step in range(job.args.steps):
        job.before_step(step)
        for name in order:
            if name == "half":
                out[name][:] = x[:]
                job.broadcast(out[name], step % 2, comms[name], STREAMS[name])
            else:
                job.allreduce(x, out[name], comms[name], STREAMS[name])
        job.sync(*STREAMS.values())
        mix(x, out["world"], 0.001)
        mix(x, out["parity"], 0.01)
        mix(x, out["half"], 0.1)
        job.report(step, x)
    job.finish(half, parity, comms["world"])


if __name__ == "__main__":
    main()
