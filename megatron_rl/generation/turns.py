"""Multi-turn hand-over: a row whose turn ended gets the environment's reply as context and goes on, or ends.

A turn ends at a stop or after ``max_turn_tokens``; ``turn_ended`` (or a fed prompt's ``turns``) returns the reply's
tokens, None to end the row, or a ``Future`` of either, while the other rows go on decoding. The reply's tokens
join the row as context (``policy_mask`` 0), fed at its next step onto its own blocks (no prefill of the
conversation again). A ``Future`` reply joins its row ``reply_steps`` steps after the turn ended (the engine waits
for it there if it is not ready), so the step it joins, the rows of every step's batch and the log-probs computed
there do not depend on the environment's timing, and runs repeat bit for bit; ``reply_steps`` 0 takes each reply at
the first step it is ready. Every TP and PP rank hands the same turns over in the same order, at the part's next
``schedule``, which every rank reaches at the same point of its walk (under PP the last stage learns a choice a
step before the others), so the caller makes each environment call once per replica and shares its outcome over
the replica's ranks (rollout/multi_turn.py ``model_parallel_share``). A row awaiting a ``Future`` holds its blocks
and is neither fed nor sampled; a part whose rows all wait blocks until one replies; at tp or pp > 1 the ranks
agree at each step which replies came (``SettleReplies``).

Test: ``.venv/bin/python -m pytest tests/test_multi_turn.py -q``
"""

from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future
from typing import Callable, Optional

from megatron_rl.generation.sequence import Sequence

TurnEnded = Callable[[int, list, str], "Optional[list] | Future"]
"""``turn_ended(row index, the turn's tokens, "stop" or "length")`` when a row's turn ends: the tokens to append
(the environment's reply, rendered, ending where the policy goes on) or None to end the row; or a
``concurrent.futures.Future`` of either (the row waits, holding its blocks; its tokens do not depend on when the
reply comes: a row's draws are its own); at tp or pp > 1 only with a ``SettleReplies``."""

SettleReplies = Callable[[list, bool], None]
"""``settle_replies(futures, wait)``: the replies awaited (the waiting rows' futures, in one order on every rank of
the replica) made done on every rank or on none, so that all take the same ones at the same step; with ``wait``,
at least one. Needed for ``Future`` replies at tp or pp > 1 (rollout/multi_turn.py ``StepThreads.settle``)."""


class TurnHandover:
    """The turns of one engine part's rows: ``turn_over`` after a row's turn ended, ``take_replies`` before each
    step. ``end(row)`` ends a row (the scheduler's ``finish``)."""

    def __init__(self, turn_ended: Optional[TurnEnded], *, settle_replies: Optional[SettleReplies],
                 replies_may_wait: bool, reply_steps: int, end: Callable[[Sequence], None]) -> None:
        self.turn_ended, self.settle_replies, self.replies_may_wait, self.end = (
            turn_ended, settle_replies, replies_may_wait, end)
        self.reply_steps = reply_steps
        """A ``Future`` reply joins its row this many steps after the turn ended, waited for then if it is not
        ready (0: at the first step it is ready, which depends on the environment's thread timing)."""
        self.steps = 0
        """Steps scheduled so far (``turn_over`` runs once at each)."""
        self.ended: list = []
        """Rows whose turn ended at the last step, handed over at the next ``schedule`` (under PP the last stage
        learns a choice a step before the others: handing over then keeps every rank's environment calls at the
        same point of the walk)."""

    def turns_of(self, row: Sequence) -> Optional[Callable]:
        """Who takes the row's ended turns: its fed prompt's ``turns``, else the call's ``turn_ended``."""
        fed = row.fed_prompt
        return fed.turns if fed is not None and fed.turns is not None else self.turn_ended

    def turn_over(self) -> None:
        """The environment answers every row whose turn ended at the last step."""
        self.steps += 1
        for row in self.ended:
            fed = row.fed_prompt
            place = row.index if fed is None or fed.turns is None else row.request - fed.first_request
            reply = self.turns_of(row)(place, row.tokens[row.turn_start:], row.turn_finish)
            if not isinstance(reply, Future):
                self._reply_came(row, reply)
            elif not self.replies_may_wait:
                raise NotImplementedError("a multi-turn reply made while rows decode (a Future) at tp or pp > 1 "
                                          "needs settle_replies: the ranks of a replica must take each reply at the "
                                          "same step")
            else:
                row.reply, row.reply_due = reply, self.steps + self.reply_steps
        self.ended = []

    def take_replies(self, running: list, wait: bool = False) -> None:
        """The replies that join their rows now (``wait``: every row left awaits one, so one must come): those due
        at this step, waited for (the earliest due, when ``wait`` and none is), or with ``reply_steps`` 0 those
        that came. Under ``settle_replies`` the replica's ranks agree which came."""
        waiting = [row for row in running if row.reply is not None]
        if not waiting:
            return
        if self.reply_steps:
            due = [row for row in waiting if row.reply_due <= self.steps]
            if wait and not due:
                first = min(row.reply_due for row in waiting)
                due = [row for row in waiting if row.reply_due == first]
            self._wait_for_all([row.reply for row in due])
            waiting = due
        elif self.settle_replies is not None:
            self.settle_replies([row.reply for row in waiting], wait)
        elif wait:
            futures.wait([row.reply for row in waiting], return_when=futures.FIRST_COMPLETED)
        for row in waiting:
            if row.reply.done():
                reply, row.reply = row.reply.result(), None
                self._reply_came(row, reply)

    def _wait_for_all(self, replies: list) -> None:
        if self.settle_replies is None:
            futures.wait(replies)
            return
        while pending := [reply for reply in replies if not reply.done()]:  # done alike on every rank
            self.settle_replies(pending, True)

    def _reply_came(self, row: Sequence, reply: Optional[list]) -> None:
        """The reply joins the row, which goes on; None (or nothing) ends it as its turn ended."""
        row.finish = row.turn_finish
        if reply:
            row.append_reply(reply)
        if row.finish is not None:
            self.end(row)
