"""Run a ``Job`` and answer it, for any protocol: the admission slot, the engine, a JSON body or an
SSE stream, and a client that goes away.

``respond(state, job, http_request, body, chunks)`` compiles the job's output constraint (if any;
off the event loop), takes an admission slot (429 when none is left),
starts the ``Generation`` (the engine's refusals are 400 / 503 before any response starts) and then:

- ``job.stream``: a ``StreamingResponse`` of the text ``chunks(generation)`` yields (the protocol's
  SSE events, made from ``generation.deltas()``); a client that disconnects makes Starlette close
  that generator, which aborts the request;
- otherwise it runs the generation to its end (aborting it if the client disconnects meanwhile) and
  answers ``body(generation)`` as JSON.

Either way the generation is closed (its slot given back, the engine request aborted if unfinished).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixcache.integrations.serve.errors import unavailable
from radixcache.integrations.serve.requests.generation import Generation
from radixcache.integrations.serve.requests.job import constrain


async def respond(state, job, http_request: Request, body, chunks):
    """See the module docstring."""
    if state.engine is None:
        raise unavailable("no generation engine is attached to this server")
    job = await constrain(state, job)  # an invalid schema is a 400 before any slot is taken
    slot = state.gate.acquire()
    try:
        generation = Generation(state, job, slot)
        generation.start()
    except BaseException:
        slot.release()
        raise
    if job.stream:
        return StreamingResponse(_closing(generation, chunks(generation)), media_type="text/event-stream")
    return JSONResponse(await _collected(generation, http_request, body))


async def _closing(generation: Generation, chunks):
    try:
        async for text in chunks:
            yield text
    finally:
        await chunks.aclose()
        generation.close()


async def _collected(generation: Generation, http_request: Request, body) -> dict:
    async def watch():
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        generation.close()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        async for _ in generation.deltas():
            pass
    finally:
        watcher.cancel()
        generation.close()
    return body(generation)
