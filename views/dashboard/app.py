"""The dashboard's web app (Starlette): pages, the chart library, JSON and a live stream.

    GET /                         the runs (the page asks /api/runs)
    GET /run/{run}                one run: curves, buffer, timeline, events, audit
    GET /api/runs                 the runs, as JSON
    GET /api/runs/{run}/events    the event table, filtered (type, group, step), newest first
    GET /api/runs/{run}/stream    Server-Sent Events: a snapshot, then an update per batch
    GET /run/{run}/trace          the trace of some steps (default: the last 3), drawn by a
                                  small viewer; /api/runs/{run}/trace?steps=A:B is the JSON
    GET /static/..., /vendor/plotly.min.js   the page's code; the chart library comes from
                                  the installed ``plotly`` package (machines are offline)

Read-only: it reads the log (bulk reads for the history, a blocking XREAD for the live
tail: ``EventStore.follow``), never writes, and so works under the reader ACL user. No
page or answer carries the store's address (it may hold a password).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from events.errors import EventStoreError, StoreUnavailableError
from events.schema import EVENT_TYPES
from events.store import EventStore
from views import source
from views.dashboard import history
from views.dashboard.model import RunView

STATIC = Path(__file__).resolve().parent / "static"
#: with nothing new, a comment line this often keeps proxies from closing the stream
KEEPALIVE_S = 15.0


def plotly_js() -> Path:
    """plotly.min.js as the ``plotly`` wheel ships it."""
    import plotly

    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the plotly package")
    return path


def create_app(store: EventStore, default_run: str | None = None) -> Starlette:
    plotly = plotly_js()

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def run_page(request: Request) -> Response:
        return FileResponse(STATIC / "run.html")

    async def vendor(request: Request) -> Response:
        return FileResponse(plotly, media_type="text/javascript")

    async def runs(request: Request) -> Response:
        rows = await asyncio.to_thread(history.run_rows, store)
        return JSONResponse({"runs": rows, "default": default_run,
                             "event_types": sorted(set(EVENT_TYPES) - {"EpisodeTurnsRecorded"})})  # a pause is shown as its parts

    async def events(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if not await asyncio.to_thread(store.run_exists, run_id):
            return JSONResponse({"error": f"no run {run_id!r}"}, status_code=404)
        try:
            query = history.EventQuery.from_params(request.query_params)
        except ValueError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        return JSONResponse(await asyncio.to_thread(history.find_events, store, run_id, query))

    async def trace_page(request: Request) -> Response:
        return FileResponse(STATIC / "trace.html")

    async def trace(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if not await asyncio.to_thread(store.run_exists, run_id):
            return JSONResponse({"error": f"no run {run_id!r}"}, status_code=404)
        try:
            body = await asyncio.to_thread(
                history.trace_json, store, run_id, request.query_params.get("steps", ""))
        except ValueError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        return Response(body, media_type="application/json")

    async def stream(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if not await asyncio.to_thread(store.run_exists, run_id):
            return JSONResponse({"error": f"no run {run_id!r}"}, status_code=404)
        return StreamingResponse(_stream(store, run_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    return Starlette(exception_handlers={EventStoreError: _store_error}, routes=[
        Route("/", index),
        Route("/run/{run_id}", run_page),
        Route("/run/{run_id}/trace", trace_page),
        Route("/api/runs/{run_id}/trace", trace),
        Route("/vendor/plotly.min.js", vendor),
        Route("/api/runs", runs),
        Route("/api/runs/{run_id}/events", events),
        Route("/api/runs/{run_id}/stream", stream),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])


async def _store_error(request: Request, err: Exception) -> Response:
    """A malformed or tampered log, a key changed by hand: the page shows the one line
    (``{"error": ...}``) the commands print, not a bare 500. A store that cannot be
    reached is said without its address (it may hold a password): that goes to stderr."""
    status = 503 if isinstance(err, StoreUnavailableError) else 422
    return JSONResponse({"error": _public(err)}, status_code=status)


def _public(err: BaseException) -> str:
    if isinstance(err, StoreUnavailableError):
        print(f"rl-controller dashboard: {err}", file=sys.stderr)
        return "the store is unavailable (the dashboard's terminal says why)"
    return str(err)


def _sse(message: dict[str, Any]) -> str:
    return f"data: {json.dumps(message, separators=(',', ':'))}\n\n"


async def _stream(store: EventStore, run_id: str) -> AsyncIterator[str]:
    """The run's snapshot, then one update per batch of new events, for as long as the
    page listens (Starlette cancels this when it goes away)."""
    view = RunView(run_id)
    try:
        end = await asyncio.to_thread(_load, store, run_id, view)
    except EventStoreError as err:  # the response has begun: the page shows it as stopped
        yield _sse({"kind": "error", "text": _public(err)})
        return
    yield _sse(view.snapshot())
    queue: asyncio.Queue[tuple[int, Any] | BaseException] = asyncio.Queue()

    async def follow() -> None:
        try:
            async for stored in store.follow(run_id, end):
                queue.put_nowait((stored.position, stored.event))
        except Exception as err:  # noqa: BLE001 -- the page says it; the stream ends
            queue.put_nowait(err)

    task = asyncio.create_task(follow())
    try:
        while True:
            try:
                first = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            batch = [first]
            while not queue.empty():  # whatever arrived meanwhile goes in the same update
                batch.append(queue.get_nowait())
            failed = next((x for x in batch if isinstance(x, BaseException)), None)
            events = [x for x in batch if not isinstance(x, BaseException)]
            if events:
                yield _sse(view.apply(events))  # type: ignore[arg-type]
            if failed is not None:
                yield _sse({"kind": "error", "text": _describe(failed)})
                return
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def _load(store: EventStore, run_id: str, view: RunView) -> int:
    """Fold the history into ``view``; returns the position the live tail follows from."""
    result = source.fold(store, run_id, observers=[view], fork_readers=False)
    # Follow on from where the state stands: ``log_end`` is read after the fold and on a
    # live run may already be past it (following from there would skip events). After a
    # problem the state stops at it; the table and the stream go on from the log's end.
    end = result.state.position if result.problem is None else result.log_end
    view.loaded(result, history.tail_rows(store, run_id, end))
    return end


def _describe(err: BaseException) -> str:
    if isinstance(err, EventStoreError):
        return _public(err)
    return f"the live read stopped: {type(err).__name__}: {err}"
