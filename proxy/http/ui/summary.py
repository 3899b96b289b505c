"""The summary view's figures: success rate and mean reward per agent and per task, and the reward over time as a
chart's geometry (points and a running mean in an SVG's coordinates). Plain data for the template, which draws it
server-side: no script, no chart library.

An episode succeeded when it ended (finished or failed) with a return above 0; cancelled and open episodes are
counted apart. The mean reward is over the episodes that have a return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from proxy.core.catalog import Catalog, EpisodeQuery, EpisodeSummary
from proxy.core.values import EpisodeStatus
from proxy.http.ui.display import agent_of, moment
from proxy.http.ui.forms import ListFilters, Refused, list_filters
from proxy.http.ui.pages import Pages
from proxy.http.ui.routes import guard

WIDTH, HEIGHT, MARGIN = 720, 240, 40  # the chart's viewBox and the room left for its axes' labels
SUMMARISED = 10_000  # the newest episodes a summary reads, at most
_READ = 1000  # episodes read a page at a time
_ENDED = {EpisodeStatus.FINISHED, EpisodeStatus.FAILED}


@dataclass(frozen=True, slots=True)
class Tally:
    name: str
    episodes: int
    ended: int  # finished or failed
    succeeded: int
    rewarded: int
    reward_sum: float

    @property
    def success_rate(self) -> float | None:
        return self.succeeded / self.ended if self.ended else None

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None


@dataclass(frozen=True, slots=True)
class Chart:
    """Each rewarded episode as a point (x: when it was created, y: its return) and the running mean as a line, in
    the coordinates of a WIDTH x HEIGHT viewBox; the axes' end labels."""

    points: list[tuple[float, float, str]]  # x, y, the point's title (episode id, return)
    mean_line: str  # an SVG polyline's points
    y_labels: list[tuple[float, str]]  # y, text
    x_labels: list[tuple[float, str, str]]  # x, text, its anchor: the first starts at its point, the last ends there


def task_of(summary: EpisodeSummary) -> str:
    """A task's name as a person knows it: its id or label from the run that made it, else its text's first line."""
    episode = summary.episode
    for key in ("task_id", "label"):
        if isinstance(named := episode.metadata.get(key), str) and named:
            return named
    line = episode.task.strip().split("\n", 1)[0]
    return line if len(line) <= 80 else line[:80] + "…"


def tallies(found: Iterable[EpisodeSummary], key: Callable[[EpisodeSummary], str]) -> list[Tally]:
    """One tally per value of `key`, the most episodes first."""
    groups: dict[str, list[EpisodeSummary]] = {}
    for summary in found:
        groups.setdefault(key(summary) or "(none)", []).append(summary)
    made = [_tally(name, members) for name, members in groups.items()]
    return sorted(made, key=lambda tally: (-tally.episodes, tally.name))


def _tally(name: str, members: list[EpisodeSummary]) -> Tally:
    ended = [s for s in members if s.episode.status in _ENDED]
    rewards = [s.reward for s in members if s.reward is not None]
    return Tally(
        name,
        len(members),
        len(ended),
        sum(1 for s in ended if s.reward is not None and s.reward > 0),
        len(rewards),
        sum(rewards),
    )


def reward_chart(found: Iterable[EpisodeSummary], window: int = 20) -> Chart | None:
    """The returns in order of creation, with their running mean over the last `window`; None with none."""
    rewarded = sorted((s for s in found if s.reward is not None), key=lambda s: s.cursor)
    if not rewarded:
        return None
    times = [s.episode.created_at for s in rewarded]
    values = [float(s.reward) for s in rewarded if s.reward is not None]
    low, high = min(0.0, *values), max(1.0, *values)
    first, last = times[0], times[-1]

    def x(at: float) -> float:
        span = last - first
        return round(MARGIN + (WIDTH - 2 * MARGIN) * ((at - first) / span if span else 0.5), 1)

    def y(value: float) -> float:
        return round(HEIGHT - MARGIN + (2 * MARGIN - HEIGHT) * (value - low) / (high - low), 1)

    means = [sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]
    return Chart(
        points=[(x(t), y(v), f"{s.episode.id}: {v:g}") for t, v, s in zip(times, values, rewarded, strict=True)],
        mean_line=" ".join(f"{x(t)},{y(m)}" for t, m in zip(times, means, strict=True)),
        y_labels=[(y(value), f"{value:g}") for value in sorted({low, high, (low + high) / 2})],
        # a label centred on the first or last point would run past the chart's edge (a time is ~140 px wide)
        x_labels=[(x(first), moment(first), "start"), (x(last), moment(last), "end")]
        if last > first
        else [(x(first), moment(first), "middle")],
    )


def agent_name(summary: EpisodeSummary) -> str:
    return agent_of(summary.episode)


def summary_routes(pages: Pages) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False, dependencies=[Depends(guard(pages))])

    @router.get("/summary")
    async def summary(request: Request) -> Response:
        params = request.query_params
        try:
            filters = list_filters(params, params.getlist("status"), params.getlist("where"))
        except Refused as e:
            return pages.render(request, "summary.html", 400, filters=ListFilters(), refused=str(e), found=0)
        found = await newest(pages.catalog, filters.query(None, _READ), SUMMARISED)
        return pages.render(
            request,
            "summary.html",
            filters=filters,
            found=len(found),
            cut=len(found) >= SUMMARISED,
            agents=tallies(found, agent_name),
            tasks=tallies(found, task_of),
            chart=reward_chart(found),
            size=(WIDTH, HEIGHT, MARGIN),
        )

    return router


async def newest(catalog: Catalog, query: EpisodeQuery, most: int) -> list[EpisodeSummary]:
    """Up to `most` of the episodes the query matches, newest first, read a keyset page at a time."""
    found: list[EpisodeSummary] = []
    while len(found) < most:
        page = await catalog.summaries(replace(query, after=found[-1].cursor if found else None))
        found += page[: most - len(found)]
        if len(page) < query.limit:
            break
    return found
