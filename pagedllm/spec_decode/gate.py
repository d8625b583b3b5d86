"""Back-off by cost: drafting pauses while the engine's decode steps are faster without it.

The rejection back-off (``backoff_after_rejections``) pauses a request whose drafts keep failing. It cannot see a
draft that is accepted yet does not pay: on a CPU a draft model's own passes (a 0.5B drafting for a 1.5B reads a
136M-weight head per drafted token) and the target's k + 1 verification rows can cost more than the tokens they
save. So the runner times its decode steps, each of them either drafting (it verified drafts) or plain (it neither
verified nor proposed any), and this gate compares the two rates: tokens emitted per request per second, each an
exponentially weighted average (the plain mean of its first 1 / alpha steps, so that one lucky first step, all
drafts accepted, does not outweigh the losing ones after it), drafting's begun afresh after every pause (what paid
before a pause says little about the text after it). While drafting is the slower, it pauses, then drafts ``probe``
steps to measure it again. A pause is long enough that its probe costs at most ``budget`` of it (the probe's tokens,
``probe`` times the tokens a drafting step emits, each at the plain rate's loss, and a draft model's catch-up on the
tokens of the pause), and twice the last one while drafting keeps losing, up to ``max_pause`` steps: drafting at
0.3x costs under 4 % over a long answer, a draft near break-even little more. When drafting pays again (a copy-heavy
stretch of the answer) the pauses end; and a request that arrives at an idle engine (:meth:`restart`), its text
being new, is judged by its first drafting step alone.

Until drafting has been measured once, the gate measures: ``probe`` drafting steps, then ``probe`` plain ones.
Steps with a prompt chunk in them, and the steps that only propose, are not counted. Greedy outputs do not
depend on the gate (drafts never change the tokens), sampled ones follow the target's distribution either way.
"""

from __future__ import annotations

import math
import time


class CostGate:
    def __init__(
        self, probe: int = 4, max_pause: int = 512, budget: float = 0.02, alpha: float = 0.25, clock=time.perf_counter
    ):
        self.probe, self.max_pause, self.budget, self.alpha, self.clock = probe, max_pause, budget, alpha, clock
        self.rate: dict[bool, float | None] = {True: None, False: None}  # drafting? -> tokens / request / s
        self.samples = {True: 0, False: 0}  # steps in each rate since it was last reset
        self.measured = False  # a drafting step has been timed
        self.per_step = 1.0  # tokens a drafting step emits per request (weighted average)
        self.fresh = 0  # drafting steps measured since the last pause
        self.pause = 0  # the last pause's length, in steps
        self.left = 0  # steps left in the current pause
        self.paused_steps = 0  # all steps the gate has kept drafts out of (tests read it)
        self.catchup = 0.0  # seconds a draft model's catch-up after a pause adds to its step (weighted average)

    def allow(self) -> bool:
        """Whether the coming step may draft: asked once per step that would."""
        if self.left:
            self.left -= 1
            self.paused_steps += 1
            return False
        spec, plain = self.rate[True], self.rate[False]
        if self.fresh < self.probe or spec is None:
            return True
        if plain is None:  # drafting has been measured, plain decoding not yet: measure it
            self._pause(self.probe)
            self.rate[True] = spec  # nothing to measure afresh: it was measured just now
        elif spec < plain:
            # a probe of `probe` drafting steps emits probe * per_step tokens, each plain / spec - 1 plain
            # steps' time slower than plain decoding would: the pause makes that `budget` of it
            # (and the catch-up of a draft model that sat out the pause, in plain steps' time)
            worth = math.ceil((self.probe * self.per_step * (plain / spec - 1) + self.catchup * plain) / self.budget)
            self._pause(min(max(self.probe, 2 * self.pause, worth), self.max_pause))
        else:
            self.pause = 0
            return True
        self.left -= 1
        self.paused_steps += 1
        return False

    def restart(self) -> None:
        """A request at an idle engine. Its text is new: where drafting has been timed before, its first
        drafting step alone decides; the plain rate is kept."""
        self.left = self.pause = 0
        self.rate[True] = None
        self.fresh = self.probe - 1 if self.measured else 0

    def _pause(self, steps: int) -> None:
        self.pause = self.left = steps
        self.fresh = 0
        self.rate[True] = None  # measured afresh after the pause

    def record_catchup(self, seconds: float) -> None:
        """A plain step in which a draft model caught up after a pause and proposed: its time beyond a plain
        step's is part of what each probe costs."""
        plain = self.rate[False]
        if plain is not None and seconds > 0:
            extra = max(seconds - 1 / plain, 0.0)
            self.catchup = extra if not self.catchup else self.catchup + self.alpha * (extra - self.catchup)

    def record(self, drafting: bool, tokens_per_request: float, seconds: float) -> None:
        """A decode step's outcome: whether it drafted, tokens emitted per request, its time."""
        if seconds <= 0:
            return
        rate = tokens_per_request / seconds
        old = self.rate[drafting]
        if drafting:
            self.fresh += 1
            self.measured = True
            self.per_step += self.alpha * (tokens_per_request - self.per_step)
        # the plain mean of a rate's first 1 / alpha steps, then the weighted average: an average begun at one
        # lucky step (all drafts accepted) would take many losing steps to fall below the plain rate
        self.samples[drafting] = 1 if old is None else self.samples[drafting] + 1
        weight = max(self.alpha, 1 / self.samples[drafting])
        self.rate[drafting] = rate if old is None else old + weight * (rate - old)
