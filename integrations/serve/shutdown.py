"""Ctrl-C for a busy server: abort what runs, end every response, flush, exit within a bound.

uvicorn, on SIGINT / SIGTERM, stops accepting connections and then waits for every open response
to end before it runs the app's lifespan shutdown, so a stream generating 2,000 tokens (or a client
waiting for a long non-streamed answer) would keep the server alive until it finished or the client
gave up. ``InterruptibleServer`` (a ``uvicorn.Server``) acts on the first signal at once:

1. ``ServerState.begin_shutdown()`` on the event loop: every running request is aborted in the
   engine, so each stream ends with an error event saying the server is shutting down and how many
   tokens it had generated (``code`` "server_shutting_down"), then ``[DONE]``, and each waiting
   non-streamed request gets that 503; the engine's scheduler thread stops and the shared store is
   flushed (``lm.close``, bounded by its own timeout);
2. uvicorn's own shutdown then finds the responses ended (it gives a client that does not read
   ``GRACE_S`` seconds), runs the lifespan shutdown (which waits for step 1) and returns; the
   command exits with status 0;
3. whatever hangs, the process is gone ``BOUND_S`` seconds after the signal (status 1).

A second signal exits at once (status 128 + the signal), without waiting for anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time

import uvicorn

logger = logging.getLogger("radixcache.serve")

GRACE_S = 10  # open responses get this long to end after the abort (uvicorn's graceful timeout)
BOUND_S = 30.0  # the process is gone this long after the first signal, whatever hangs


class InterruptibleServer(uvicorn.Server):
    """uvicorn's server with the shutdown described in the module docstring; ``state`` is the
    app's ``ServerState``."""

    def __init__(self, config: uvicorn.Config, state, bound_s: float = BOUND_S):
        super().__init__(config)
        self.state = state
        self.bound_s = bound_s
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler uvicorn installs (runs in the main thread, between bytecodes)."""
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals > 1:
            sys.stderr.write(f"radixcache serve: second {name}: exiting now\n")
            sys.stderr.flush()
            os._exit(128 + sig)
        logger.warning("%s: aborting the running requests, then flushing and stopping (again to quit at once)",
                       name)
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.state.begin_shutdown)
        threading.Thread(target=self._exit_after_bound, name="radixcache-shutdown-bound", daemon=True).start()

    def _exit_after_bound(self) -> None:
        time.sleep(self.bound_s)
        sys.stderr.write(f"radixcache serve: not stopped {self.bound_s:.0f} s after the signal: exiting\n")
        sys.stderr.flush()
        os._exit(1)


def run(app, state, options) -> None:
    """Serve ``app`` (for ``state``) on ``options.host:options.port`` until interrupted."""
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            access_log=False, timeout_graceful_shutdown=GRACE_S)
    InterruptibleServer(config, state).run()
