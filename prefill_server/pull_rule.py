"""Whether a prefill server reads a decode server's cached prefix or computes it: read only when it pays.

Before it asks a decode server for N tokens' K/V (decode-to-prefill reuse,
kvlink/prefix_read.py), a prefill server weighs two estimates::

    read    = READ_OVERHEAD_S + bytes / read bandwidth      (learned from its own completed reads)
    compute = N / prefill throughput                         (learned from its own engine's prefill steps)

and asks only when ``compute >= margin * read``. Both figures are
exponentially weighted averages (weight ``ALPHA`` for each new sample):

* The read's fixed part (an HTTP round trip and a turn of the decode server's
  engine thread, which copies the tokens between two of its steps) is a
  constant; what a read took beyond it, over its bytes, is one bandwidth
  sample (a read faster than the constant counts as one whose bytes took a
  tenth of its time), so an estimate never falls below the constant. Before any
  read the bandwidth is ``PRIOR_BYTES_PER_S``, about what an unloaded CPU
  host moved (docs/kv-tiers.md): optimistic enough that the first read is
  asked for where computing is not trivial, and then learned.
* The compute side is the engine's own prompt tokens over the seconds of its
  steps that computed them (``EngineCounters``: prompt tokens, prefill and
  mixed step seconds), sampled as the difference since the last decision: the
  throughput this server has on its cores now, contention included. It is
  linear in N (attention's growth with position is not modelled); until the
  engine computed a prompt there is no figure and the read is asked for.

A read that is not asked for is not observed, so a bandwidth learned under a
passing load could keep reads off for good: every ``PROBE_EVERY``-th decision
in a row that would skip reads anyway, and its time is learned.
"""

from __future__ import annotations

from dataclasses import dataclass

READ_OVERHEAD_S = 0.005  # one read's fixed cost, whatever its size
PRIOR_BYTES_PER_S = 200e6  # the read bandwidth before any read was observed
ALPHA = 0.3  # an EWMA's weight for each new sample
PROBE_EVERY = 16  # after this many skips in a row, the next candidate read is asked for anyway


def ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + ALPHA * (sample - old)


@dataclass
class PullRule:
    """The read-versus-compute estimates of one prefill server, and its decisions (event loop only).

    ``margin``: a read is asked for when computing its tokens is estimated to take at least ``margin``
    times as long as reading them; 0 asks for every read (``transfer.pull_prefix_margin``)."""

    margin: float = 1.0
    bytes_per_s: float = PRIOR_BYTES_PER_S
    tokens_per_s: float | None = None  # prefill throughput; None until the engine computed a prompt
    skipped: int = 0  # decisions in a row that skipped the read
    _seen: tuple[int, float] = (0, 0.0)  # the engine's (prompt tokens, their step seconds) at the last look

    def read_seconds(self, nbytes: int) -> float:
        """The estimated time of one read of ``nbytes``."""
        return READ_OVERHEAD_S + nbytes / self.bytes_per_s

    def compute_seconds(self, tokens: int) -> float | None:
        """The estimated time to compute ``tokens`` prompt tokens here; None before any was computed."""
        return None if self.tokens_per_s is None else tokens / self.tokens_per_s

    def worth_reading(self, tokens: int, nbytes: int) -> bool:
        """Whether to read ``tokens`` tokens (``nbytes``) rather than compute them; counts the skips."""
        compute = self.compute_seconds(tokens)
        if compute is None or compute >= self.margin * self.read_seconds(nbytes) or self.skipped + 1 >= PROBE_EVERY:
            self.skipped = 0
            return True
        self.skipped += 1
        return False

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` completed (checked) in ``seconds``: a bandwidth sample."""
        if nbytes > 0:
            self.bytes_per_s = ewma(self.bytes_per_s, nbytes / max(seconds - READ_OVERHEAD_S, seconds / 10, 1e-6))

    def observe_engine(self, prompt_tokens: int, prompt_seconds: float) -> None:
        """The engine's running totals (prompt tokens computed, seconds of the steps that computed them): a
        throughput sample from what they grew by since the last call, when they grew."""
        tokens, seconds = prompt_tokens - self._seen[0], prompt_seconds - self._seen[1]
        self._seen = (prompt_tokens, prompt_seconds)
        if tokens > 0 and seconds > 0:
            self.tokens_per_s = ewma(self.tokens_per_s, tokens / seconds)
