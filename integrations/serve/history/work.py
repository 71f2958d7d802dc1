"""The history work after a chat reply: its history form rendered, checked and precomputed.

``precompute_history(state, job, generated_ids, reply)`` runs as a background task once the reply's
last delta has gone out (nobody waits for it): it renders the conversation plus ``reply`` in its
history form on the render thread behind every prompt waiting there (``history.history_after_reply``:
at most two passes over the conversation), reports a departure from the computed tokens in the
metrics and the log, submits the form's uncached blocks as a prefill-only request, and remembers the
form in ``state.histories`` (with the conversation it follows, and how much of it is computed: all
of it once the precompute is done) so that the next turn's hit can be checked against it, when the
next turn continues that conversation (``continues``).

``PendingHistories`` holds that work while it runs. A client may come back faster than it: before a
chat request goes to the engine, ``wait_for(conversation, salt)`` waits for the history work of the
conversations it continues (the same tools, and the earlier request's messages as its first
messages), promoting that work on the render thread ahead of every prompt, so that it waits for at
most one render (the one running) plus its own, and its hit is checked against the form. The engine then holds it
back only for a precompute already running; one that has not started yet it does not wait for
(the request computes those blocks itself, and its short hit says ``not_precomputed``). Other
sessions' work is never waited for.
"""

from __future__ import annotations

import asyncio
import logging

from radixcache.integrations.serve.history.forms import history_after_reply

logger = logging.getLogger("radixcache.serve")


async def precompute_history(state, job, generated_ids, reply: dict) -> None:
    """See the module docstring. ``generated_ids``: the reply's tokens (stop token included)."""
    conversation = job.conversation
    try:
        renderer = state.renderer.with_args(conversation.template_args)
        history = await state.render_later(history_after_reply, renderer, conversation.messages,
                                           conversation.tools, job.prompt_ids, generated_ids, reply)
    except ValueError as exc:  # the template cannot render its own reply: nothing to precompute
        logger.warning("request %s: no history form (%s)", job.request_id, exc)
        return
    if history.divergence is not None:
        state.metrics.observe_divergence(history.divergence.reason)
        logger.debug("request %s: history form departs from the computed tokens at token %d (%s): %s",
                    job.request_id, history.divergence.token_index, history.divergence.reason,
                    history.divergence.detail)
    def remember(computed):
        state.histories.remember(history.token_ids, job.salt, computed, source=conversation)

    if history.blocks_to_compute(state.limits.block_size) == 0:
        remember(None)
        return
    # until the precompute has run, only what was computed before is: a turn back before it
    # computes the rest itself (the engine never holds a request back for background work)
    state.precompute(history.token_ids, job.salt, job.request.keep_s, on_done=lambda: remember(None))
    remember(history.computed)


class PendingHistories:
    """The history work still running, by the conversation and tenant salt it follows.
    ``promote(task)`` is called for the work a client starts waiting on (the render thread's
    ``promote``: its rendering then goes ahead of every prompt)."""

    def __init__(self, promote=None):
        self._work: dict = {}  # task -> (conversation, salt)
        self._promote = promote

    def __len__(self) -> int:
        return len(self._work)

    def add(self, task: asyncio.Task, conversation, salt) -> None:
        """Hold ``task`` (the history work after a reply to ``conversation``) until it is done."""
        self._work[task] = (conversation, salt)
        task.add_done_callback(lambda t: self._work.pop(t, None))

    async def wait_for(self, conversation, salt) -> None:
        """Wait until no history work runs for a conversation that ``conversation`` continues."""
        waits = [task for task, (earlier, s) in self._work.items() if s == salt and continues(conversation, earlier)]
        if waits:
            if self._promote is not None:
                for task in waits:
                    self._promote(task)
            await asyncio.wait(waits)


def continues(conversation, earlier) -> bool:
    """``conversation`` appends messages to ``earlier`` (same tools and template variables,
    ``earlier``'s messages first)."""
    n = len(earlier.messages)
    return (conversation.tools == earlier.tools and conversation.template_args == earlier.template_args
            and len(conversation.messages) > n
            and conversation.messages[:n] == earlier.messages)
