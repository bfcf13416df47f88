"""engine/contention.py: a smaller thread team while the process waits for cores, the cores given back
when they free, probes that back off while a neighbour stays. A scripted clock and run-queue wait."""

from __future__ import annotations

from engine.contention import ThreadGovernor, runqueue_wait_s


class Machine:
    """``contended``: each thread of the team waits this share of wall time for a core."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wait = 0.0
        self.contended = 0.0
        self.threads: list[int] = []

    def run(self, governor: ThreadGovernor, seconds: float, step_s: float = 0.05) -> None:
        for _ in range(round(seconds / step_s)):
            self.now += step_s
            self.wait += self.contended * step_s * governor.threads
            governor.after_step()


def governed(machine: Machine, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(
        threads, machine.threads.append, waits=lambda: machine.wait, clock=lambda: machine.now, probe_s=5.0
    )


def test_alone_on_its_cores_the_team_keeps_its_size():
    m = Machine()
    g = governed(m)
    m.run(g, 60)
    assert (g.threads, m.threads, g.drops, g.probes) == (2, [], 0, 0)


def test_a_neighbour_takes_a_thread_off_and_its_leaving_gives_it_back():
    m = Machine()
    g = governed(m)
    m.contended = 0.4
    m.run(g, 1.0)
    assert g.threads == 1 and m.threads == [1]
    m.contended = 0.0  # the team of one runs free; the neighbour has gone
    m.run(g, 6.0)
    assert g.threads == 2 and m.threads == [1, 2] and g.probes == 1


def test_probes_while_the_neighbour_stays_wait_longer_each_time():
    m = Machine()
    g = governed(m)
    m.contended = 0.4
    m.run(g, 1.0)  # down to one thread
    probes_at = []
    for _ in range(2000):
        m.now += 0.05
        m.wait += (0.4 if g.threads > 1 else 0.0) * 0.05 * g.threads  # one thread runs beside it unhurt
        before = g.threads
        g.after_step()
        if g.threads > before:
            probes_at.append(m.now)
    gaps = [b - a for a, b in zip(probes_at, probes_at[1:])]
    assert len(probes_at) >= 4 and all(later > earlier * 1.5 for earlier, later in zip(gaps, gaps[1:]))
    assert g.threads == 1  # each probe found the neighbour and gave the thread up again


def test_the_kernel_counts_this_process_run_queue_wait():
    first = runqueue_wait_s()
    assert first >= 0.0 and runqueue_wait_s() >= first
