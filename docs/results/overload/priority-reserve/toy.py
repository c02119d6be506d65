"""A toy of the priority scenario's fleet: does keeping a replica free of batch work bound interactive TTFT?

Four replicas, each a first-come-first-served prefill server taking S seconds a request; interactive
requests at 5 a second (Poisson), each sent to the replica whose queued work ends first; batch requests
without end, one started on a replica the moment it looks free (``err``: how much of a prefill early the
router's view says so). ``keep``: replicas left free of batch work (as ``flow_reserve_replicas``).
Prints interactive TTFT p50 and p90 over one prefill, and batch requests started a second.

    python docs/results/overload/priority-reserve/toy.py
"""

import random


def run(keep: int, err: float, seed: int = 0, seconds: float = 3000.0, rate: float = 5.0, s: float = 0.33,
        n: int = 4) -> tuple[float, float, float]:
    rng = random.Random(seed)
    free = [0.0] * n  # when each replica's queued work ends
    t, dt, ttft, batch = 0.0, 0.005, [], 0
    arrival = rng.expovariate(rate)
    while t < seconds:
        for r in range(n):
            looks_free = [x for x in range(n) if free[x] - err * s <= t + 1e-9]  # free at this very tick
            if r in looks_free and len(looks_free) > keep:
                free[r] = max(free[r], t) + s
                batch += 1
        while arrival <= t:
            r = min(range(n), key=lambda x: free[x])
            free[r] = max(free[r], arrival) + s
            ttft.append(free[r] - arrival)
            arrival += rng.expovariate(rate)
        t += dt
    ttft.sort()
    return ttft[len(ttft) // 2] / s, ttft[int(len(ttft) * 0.9)] / s, batch / seconds


if __name__ == "__main__":
    for keep in (0, 1, 2):
        for err in (0.0, 0.5):
            p50, p90, batch = run(keep, err)
            print(f"keep {keep} err {err}: interactive p50 {p50:.2f} p90 {p90:.2f} x a prefill; batch {batch:.2f}/s")
