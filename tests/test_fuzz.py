"""Fuzzing: the trainer API against its own OpenAPI schema (schemathesis), and every agent endpoint against
arbitrary bodies (hypothesis): random JSON, almost valid requests with fields of the wrong type, huge strings,
deep nesting, bytes that are not UTF-8 or not JSON, empty bodies and wrong content types.

Whatever comes in, the answer is a 4xx in the dialect's error shape, or a 2xx for a request that was valid;
never a 5xx, never a hang (every request has a client timeout, every parked turn a trainer answering it); and
afterwards the database is consistent: no turn for a refused request, seqs contiguous, every record readable.

Every run here fuzzes on the same fixed seeds (one per database), so a test fails only for a change in the code,
never for a draw.
`benchmarks/fuzz.py` runs these same tests longer on a seed of its own (TRAJPROXY_FUZZ_SEED, TRAJPROXY_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx
import orjson
import pytest
import schemathesis
import sqlalchemy
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
)

from proxy import schema
from proxy.client import TrainerClient, TrajproxyAPIError
from proxy.http.edge import MAX_JSON_DEPTH
from proxy.storage.engines import engine_url

# Far beyond any honest answer: a request still open then is a hang. (At 30 s, one forward timed out once, and
# answered when tried again, on a machine building the venvs beside three test files at once: a new machine's run.)
REQUEST_TIMEOUT_S = 90.0
LONG_POLL_S = 0.2  # what generated `wait` values are cut down to, so long polls return promptly
INT64_MAX = 2**63 - 1
TURN_STATUSES = {"parked", "leased", "answered", "abandoned", "expired", "failed"}
FUZZ = settings(
    deadline=None,  # no timing assertions: a hang shows up as REQUEST_TIMEOUT_S passing
    database=None,
    derandomize=True,  # the seed comes from each test's code: every run draws the same cases
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
FUZZ_SEED = os.environ.get("TRAJPROXY_FUZZ_SEED")  # set by benchmarks/fuzz.py only
FUZZ_EXAMPLES = os.environ.get("TRAJPROXY_FUZZ_EXAMPLES")
T = TypeVar("T", bound=Callable[..., object])


def fuzzing(max_examples: int, database_url: str) -> Callable[[T], T]:
    """A fuzz test's settings: `max_examples` cases in all, half on each database, each half drawn on a fixed seed
    of its own (the two databases see different cases, and together as many as one run of `max_examples` draws);
    or as many as benchmarks/fuzz.py asks for, on each, on the seed it chose."""

    def apply(test: T) -> T:
        if FUZZ_SEED:
            return seed(int(FUZZ_SEED))(settings(FUZZ, max_examples=int(FUZZ_EXAMPLES or max_examples))(test))
        half = settings(FUZZ, max_examples=max(1, max_examples // 2))(test)
        return seed(1 if database_url.startswith("sqlite") else 2)(half)

    return apply


def as_trainer(server: Any) -> dict[str, str]:
    """The headers a trainer sends: the server's trainer token, if it has one."""
    token = server.settings.trainer_token
    return {"authorization": f"Bearer {token.get_secret_value()}"} if token is not None else {}


# The trainer API against its OpenAPI schema.


@dataclass(frozen=True)
class Records:
    """Real records an operation's generated cases may name, so id-taking routes are exercised beyond 404s."""

    episode: str
    parked: str  # a turn whose agent is still waiting
    answered: str


@dataclass
class Agents:
    """Agents calling from threads of their own, each blocked on its parked turn until it is answered."""

    url: str
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=32))
    calls: list[Future[httpx.Response]] = field(default_factory=list)

    def call(self, key: str, content: str) -> Future[httpx.Response]:
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}
        headers = {"authorization": f"Bearer {key}"}
        self.calls.append(
            self.pool.submit(httpx.post, f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=300)
        )
        return self.calls[-1]


def wait_parked(trainer: TrainerClient, episode_id: str) -> Any:
    """Pull the episode's next call (waiting for its agent to make it), then give the lease back by expiry."""
    [turn] = trainer.next_turns(episode=episode_id, wait_s=10, lease_s=0.05)
    return turn


@pytest.fixture
def records(server: Any, trainer: TrainerClient) -> Iterator[dict[str, Records]]:
    """For every operation in the schema, an episode of its own with an answered turn and a parked one."""
    labels = [
        f"{method.upper()} {path}"
        for path, methods in httpx.get(f"{server.url}/api/openapi.json").json()["paths"].items()
        for method in methods
    ]
    agents = Agents(server.url)
    made: dict[str, Records] = {}
    try:
        for label in labels:
            episode = trainer.create_episode(task=label, turn_timeout_s=600)
            first = agents.call(episode.key, "first")
            answered = wait_parked(trainer, episode.id)
            trainer.reply(answered.id, "done")
            assert first.result(timeout=REQUEST_TIMEOUT_S).status_code == 200
            agents.call(episode.key, "second")
            parked = wait_parked(trainer, episode.id)
            made[label] = Records(episode.id, parked.id, answered.id)
        yield made
    finally:
        trainer.resume()  # in case a generated case paused the proxy
        for episode_id in {r.episode for r in made.values()}:
            try:
                trainer.finish(episode_id, "cancelled", reason="fuzzing is over")
            except TrajproxyAPIError as e:
                assert e.status == 409, e  # a generated case finished it otherwise
        for answer in agents.calls:  # each got an answer: a reply, an error a case replied with, or 410
            answer.result(timeout=REQUEST_TIMEOUT_S)
        agents.pool.shutdown()


def _real_ids(value: Any, records: Records, turn: str) -> Any:
    """`value` with the ids it names (turn_id, episode_id, episode) replaced by real ones."""
    if isinstance(value, list):
        return [_real_ids(item, records, turn) for item in value]
    if not isinstance(value, dict):
        return value
    replaced = {key: _real_ids(item, records, turn) for key, item in value.items()}
    for key in ("episode_id", "episode"):
        if isinstance(replaced.get(key), str) and replaced[key]:
            replaced[key] = records.episode
    if isinstance(replaced.get("turn_id"), str) and replaced["turn_id"]:
        replaced["turn_id"] = turn
    return replaced


FORWARD = "POST /api/turns/{turn_id}/forward"


@pytest.fixture
def trainer_schema(server: Any, records: dict[str, Records], fake_model: Any) -> Any:
    schema = schemathesis.openapi.from_url(f"{server.url}/api/openapi.json")

    def steer(case: Any, turn: str | None, upstream: bool) -> Any:
        """Point a case at real records, forward to a model that answers: each sometimes, so generated cases
        reach past the first 404. Schemathesis re-checks an edited case against the schema, but a failure's
        report still names every mutation it made, even one an edit here undid."""
        label = case.operation.label
        mine = records[label]
        if turn is not None:
            case.path_parameters = _real_ids(case.path_parameters, mine, turn)
            case.query = _real_ids(case.query, mine, turn)
            case.body = _real_ids(case.body, mine, turn)
        if upstream and label == FORWARD and isinstance(case.body, dict):
            case.body = {**case.body, "model": "openai/fake", "options": fake_model.options()}
        return case

    @schema.hook
    def flatmap_case(context: Any, case: Any) -> Any:
        mine = records[case.operation.label]
        return st.builds(
            steer,
            st.just(case),
            st.sampled_from([None, mine.parked, mine.answered]),
            st.booleans(),
        )

    return schema


def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """not_a_server_error, but for a forwarded turn whose model failed: that 502 is the documented answer."""
    if case.operation.label == "POST /api/turns/{turn_id}/forward" and response.status_code == 502:
        assert response.json()["error"]["type"] == "upstream_error", response.text
        return None
    return not_a_server_error(ctx, response, case)


def cut_long_polls(case: Any) -> None:
    """Long polls (`wait`, 60 s by default for reset and step; a pause's `drain_s`, which waits for the turns in
    flight, here the parked ones this test keeps) cut down to LONG_POLL_S."""
    drain = case.body.get("drain_s") if isinstance(case.body, dict) else None
    if isinstance(drain, int | float) and not isinstance(drain, bool) and drain > LONG_POLL_S:
        case.body = {**case.body, "drain_s": LONG_POLL_S}
    if not any(parameter.name == "wait" for parameter in case.operation.query):
        return
    query = case.query if isinstance(case.query, dict) else {}
    wait = query.get("wait", 60)
    if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > LONG_POLL_S:
        case.query = {**query, "wait": LONG_POLL_S}


CHECKS = [no_server_error, response_schema_conformance, content_type_conformance, negative_data_rejection]


@pytest.mark.timeout(600)
def test_the_trainer_api_answers_every_generated_request_without_a_server_error(
    server: Any, trainer: TrainerClient, trainer_schema: Any, records: dict[str, Records]
) -> None:
    """Every operation in the schema, with data that fits it and data that does not; then the records are whole."""
    failures: dict[str, BaseException] = {}
    operations = [result.ok() for result in trainer_schema.get_all_operations()]
    assert {operation.label for operation in operations} == set(records)
    for operation in operations:
        cases = st.one_of([operation.as_strategy(mode) for mode in GenerationMode])

        @fuzzing(max_examples=40, database_url=server.settings.database_url)
        @given(case=cases)
        def fuzz(case: Any) -> None:
            cut_long_polls(case)
            case.call_and_validate(headers=as_trainer(server), checks=CHECKS, timeout=REQUEST_TIMEOUT_S)

        try:
            fuzz()
        except (Exception, BaseExceptionGroup) as e:  # schemathesis's FailureGroup is a BaseExceptionGroup
            failures[operation.label] = e
    assert not failures, "\n\n".join(f"{label}:\n{error}" for label, error in failures.items())

    trainer.resume()
    check_database(server, trainer)
    for mine in records.values():  # each operation's episode: its two calls, nothing more
        assert [turn.seq for turn in trainer.trajectory(mine.episode).turns] == [0, 1]


def check_database(server: Any, trainer: TrainerClient) -> None:
    """The proxy is healthy; every episode stored is listed; every turn has a known status; each episode's
    trajectory loads and fits the schema, its turns numbered 0, 1, 2... as in the database."""
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok", health
    episodes: list[schema.Episode] = []
    offset: int | None = 0
    while offset is not None:
        page = trainer.episodes(limit=1000, offset=offset)
        episodes += page.episodes
        offset = page.next_offset
    engine = sqlalchemy.create_engine(engine_url(server.settings.database_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(sqlalchemy.text("SELECT episode_id, seq, status FROM turn")).all()
            stored = conn.execute(sqlalchemy.text("SELECT count(*) FROM episode")).scalar_one()
    finally:
        engine.dispose()
    assert stored == len(episodes)
    seqs: dict[str, list[int]] = {}
    for episode_id, seq, status in rows:
        assert status in TURN_STATUSES, (episode_id, seq, status)
        seqs.setdefault(episode_id, []).append(seq)
    for episode in episodes:
        turns = trainer.trajectory(episode.id).turns  # parsed with the schema's own models
        assert [turn.seq for turn in turns] == sorted(seqs.get(episode.id, [])) == list(range(len(turns)))


# The agent endpoints, in every dialect, against arbitrary bodies.

MAX_BODY_BYTES = 1_000_000
TURN_TIMEOUT_S = 30.0  # a call nobody answers is refused (504, which fails the test) well before it could hang
AGENT_SERVER = pytest.mark.settings(max_body_bytes=MAX_BODY_BYTES, turn_timeout_s=TURN_TIMEOUT_S)
TOOL_REPLY = {"content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}


@dataclass(frozen=True)
class Endpoint:
    path: str
    dialect: str  # the turns it records; also its error shape ("anthropic", or OpenAI's for the others)
    parks: bool  # a valid call becomes a turn (count_tokens only counts)
    template: dict[str, Any]  # a valid request that uses most of what the dialect converts

    def __str__(self) -> str:
        return self.path


CHAT = Endpoint(
    "/v1/chat/completions",
    "chat",
    True,
    {
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "list files"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "stream": False,
        "stream_options": {"include_usage": True},
        "n": 1,
        "temperature": 0.5,
    },
)
MESSAGES_TEMPLATE: dict[str, Any] = {
    "model": "claude-x",
    "max_tokens": 50,
    "system": [{"type": "text", "text": "be brief"}],
    "messages": [
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.txt"}]},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
            ],
        },
    ],
    "tools": [{"name": "f", "description": "a tool", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "tool", "name": "f"},
    "stop_sequences": ["END"],
    "stream": False,
}
MESSAGES = Endpoint("/v1/messages", "anthropic", True, MESSAGES_TEMPLATE)
COUNT_TOKENS = Endpoint(
    "/v1/messages/count_tokens",
    "anthropic",
    False,
    {k: v for k, v in MESSAGES_TEMPLATE.items() if k not in ("max_tokens", "stream")},
)
RESPONSES = Endpoint(
    "/v1/responses",
    "responses",
    True,
    {
        "model": "gpt-5",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hmm"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "there is a.txt"}]},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "max_output_tokens": 50,
        "stream": False,
    },
)
ENDPOINTS = [CHAT, MESSAGES, COUNT_TOKENS, RESPONSES]


class Answerer:
    """A trainer on a thread of its own: replies to every turn as soon as it is parked, and notes any failure."""

    def __init__(self, url: str, token: str | None) -> None:
        self._url = url
        self._token = token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.failures: list[str] = []

    def __enter__(self) -> Answerer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S)

    def _run(self) -> None:
        with TrainerClient(self._url, token=self._token) as trainer:
            while not self._stop.is_set():
                try:
                    turns = trainer.next_turns(max=64, wait_s=0.2)
                    if turns:
                        replies = [{"turn_id": t.id, "lease_id": t.lease_id, "message": TOOL_REPLY} for t in turns]
                        results = trainer.reply_many(replies)
                        self.failures += [f"{r.turn_id}: {r.status} {r.error}" for r in results if r.status != 200]
                except (TrajproxyAPIError, httpx.HTTPError) as e:
                    self.failures.append(repr(e))


@dataclass(frozen=True)
class Request:
    """One agent call as sent on the wire."""

    body: bytes
    content_type: str | None = "application/json"
    auth: str = "bearer"  # bearer, x-api-key, or the key in the path (/e/<key>/v1/...)
    chunked: bool = False
    retry: bool = False  # sent as an SDK's retry (x-stainless-retry-count)

    def __repr__(self) -> str:  # what a failure report needs, with huge bodies cut short
        body = self.body if len(self.body) < 2000 else self.body[:1000] + b"..." + self.body[-200:]
        return f"Request({body!r}, {self.content_type!r}, {self.auth}, chunked={self.chunked}, retry={self.retry})"


@dataclass
class AgentFuzz:
    """Sends fuzzed agent calls to a live trajproxy whose turns a background trainer answers, checks every
    answer, and keeps count of what should be recorded."""

    server: Any
    trainer: TrainerClient
    http: httpx.Client
    accepted: dict[str, list[bytes]] = field(default_factory=dict)  # episode id -> bodies that became turns

    def exchange(self, endpoint: Endpoint, requests: list[Request]) -> list[tuple[Request, httpx.Response]]:
        """Send the calls in order, from a fresh episode; check each answer and what the episode recorded.
        Returns each call sent with its answer."""
        episode = self.trainer.create_episode(task="fuzz")
        accepted = self.accepted.setdefault(episode.id, [])
        responses = []
        previous = b"resp_none"
        for request in requests:
            sent = replace(request, body=request.body.replace(PREVIOUS_RESPONSE, previous))
            response = self.send(endpoint, episode.key, sent)
            if response.is_success:
                check_answer(endpoint, response, sent)
                replayed = sent.retry and sent.body in accepted  # an SDK retry gets the recorded answer again
                if endpoint.parks and not replayed:
                    accepted.append(sent.body)
                if response.headers["content-type"].startswith("application/json") and "id" in response.json():
                    previous = response.json()["id"].encode()
            else:
                check_refusal(endpoint, response, sent)
            responses.append((sent, response))
        try:
            check_recorded(endpoint, self.trainer.trajectory(episode.id), accepted)
        except AssertionError as e:
            answers = [(r.status_code, r.text[:200]) for _, r in responses]
            raise AssertionError(f"{e}\nsent {requests}\nanswered {answers}") from None
        return responses

    def send(self, endpoint: Endpoint, key: str, request: Request) -> httpx.Response:
        headers = {"content-type": request.content_type} if request.content_type is not None else {}
        if request.retry:
            headers["x-stainless-retry-count"] = "1"
        path = endpoint.path
        if request.auth == "path":
            path = f"/e/{key}{path}"
        else:
            headers["authorization" if request.auth == "bearer" else "x-api-key"] = (
                f"Bearer {key}" if request.auth == "bearer" else key
            )
        content: Any = request.body
        if request.chunked:
            content = iter([request.body[i : i + 65536] for i in range(0, len(request.body), 65536)] or [b""])
        return self.http.post(self.server.url + path, content=content, headers=headers)

    def check_consistent(self, answerer: Answerer) -> None:
        """After fuzzing: the trainer saw no failure, nothing is left open, and the database holds exactly the
        turns of the calls that were answered, numbered 0, 1, 2... in each episode."""
        assert answerer.failures == []
        health = self.http.get(f"{self.server.url}/health").json()
        assert health["status"] == "ok"
        assert (health["open_turns"], health["ready_turns"]) == (0, 0), health
        engine = sqlalchemy.create_engine(engine_url(self.server.settings.database_url))
        try:
            with engine.connect() as conn:
                rows = conn.execute(sqlalchemy.text("SELECT episode_id, seq, status FROM turn")).all()
        finally:
            engine.dispose()
        recorded: dict[str, list[int]] = {}
        for episode_id, seq, status in rows:
            assert status == "answered", (episode_id, seq, status)
            recorded.setdefault(episode_id, []).append(seq)
        expected = {episode: list(range(len(bodies))) for episode, bodies in self.accepted.items() if bodies}
        assert {episode: sorted(seqs) for episode, seqs in recorded.items()} == expected


def check_answer(endpoint: Endpoint, response: httpx.Response, request: Request) -> None:
    """A 2xx: the answer the dialect promises, streamed or not."""
    assert response.status_code == 200, (request, response.text)
    if response.headers["content-type"].startswith("text/event-stream"):
        assert endpoint.parks
        last = {
            "chat": "data: [DONE]\n\n",
            "anthropic": 'event: message_stop\ndata: {"type":"message_stop"}\n\n',
            "responses": "event: response.completed\n",
        }[endpoint.dialect]
        assert last in response.text, response.text[-500:]
        return
    body = response.json()
    if endpoint is COUNT_TOKENS:
        assert isinstance(body["input_tokens"], int) and body["input_tokens"] >= 0, body
    elif endpoint.dialect == "chat":
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "ok", body
    elif endpoint.dialect == "anthropic":
        assert body["type"] == "message" and body["content"][0] == {"type": "text", "text": "ok"}, body
    else:
        assert body["object"] == "response" and body["status"] == "completed", body


def check_refusal(endpoint: Endpoint, response: httpx.Response, request: object = None) -> None:
    """A refusal: a 4xx with a real message, in the dialect's own error shape."""
    assert 400 <= response.status_code < 500, (request, response.status_code, response.text[:2000])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    if endpoint.dialect == "anthropic":
        assert set(body) == {"type", "error"} and body["type"] == "error", body
    else:
        assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["type"], str) and error["type"], body
    assert isinstance(error["message"], str) and len(error["message"]) > 10, body


def check_recorded(endpoint: Endpoint, trajectory: schema.Trajectory, accepted: list[bytes]) -> None:
    """The episode recorded one answered turn per accepted call, in order, each with the body as sent."""
    turns = trajectory.turns
    assert [turn.seq for turn in turns] == list(range(len(accepted)))
    for turn, body in zip(turns, accepted, strict=True):
        assert (turn.dialect, turn.status) == (endpoint.dialect, "answered"), turn
        if endpoint.dialect == "chat":  # the request as the proxy parsed it (orjson reads huge integers as floats)
            assert turn.request == orjson.loads(body)
        else:  # the body verbatim
            assert turn.wire == json.loads(body)
        messages = turn.request["messages"]
        assert messages and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages), turn


@pytest.fixture
def agent_fuzz(server: Any, trainer: TrainerClient) -> Iterator[tuple[AgentFuzz, Answerer]]:
    token = server.settings.trainer_token
    answerer = Answerer(server.url, token.get_secret_value() if token is not None else None)
    with answerer, httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        yield AgentFuzz(server, trainer, http), answerer


# Strategies.

SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=16,
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        "",
        None,
    ]
)


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def paths_in(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every node in a JSON value, the root first."""
    found = [at]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths_in(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths_in(item, (*at, index))
    return found


DELETE = object()
PREVIOUS_RESPONSE = b"resp_previous"  # replaced, as sent, by the id of the call's last answer


def put(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """A copy of `value` with the node at `path` replaced by `new` (or removed, for DELETE)."""
    if not path:
        return new
    copied = copy.copy(value)
    head, rest = path[0], path[1:]
    if rest:
        copied[head] = put(value[head], rest, new)
    elif new is DELETE:
        del copied[head]
    else:
        copied[head] = new
    return copied


@st.composite
def requests_for(draw: st.DrawFn, bodies: st.SearchStrategy[bytes]) -> list[Request]:
    """One to three calls, each with its body, content type, way of sending the key and framing."""
    return draw(
        st.lists(
            st.builds(
                Request,
                bodies,
                st.one_of(st.just("application/json"), CONTENT_TYPES),
                st.sampled_from(["bearer", "x-api-key", "path"]),
                st.booleans(),
                st.booleans(),
            ),
            min_size=1,
            max_size=3,
        )
    )


@st.composite
def template_with(draw: st.DrawFn, endpoint: Endpoint, values: st.SearchStrategy[Any]) -> Any:
    """The endpoint's valid request, streamed or not, with a node (not the root) replaced by a drawn value."""
    body = dict(endpoint.template)
    if endpoint.parks:
        body["stream"] = draw(st.booleans())
    where = draw(st.sampled_from([*paths_in(body)[1:], ("surprise",)]))
    return put(body, where, draw(values))


@st.composite
def almost_valid(draw: st.DrawFn, endpoint: Endpoint) -> bytes:
    """The endpoint's valid request with one to three nodes given a value of another type, or removed."""
    body = dict(endpoint.template)
    if endpoint.parks:
        body["stream"] = draw(st.booleans())
    if endpoint is RESPONSES and draw(st.booleans()):
        body["previous_response_id"] = PREVIOUS_RESPONSE.decode()
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths_in(body)[1:]))
        new = draw(st.one_of(st.just(DELETE), SCALARS, st.just([]), st.just({}), JSON_VALUES))
        if new is DELETE and isinstance(where[-1], int):
            new = None  # removing an array item shifts the rest; give it a wrong value instead
        body = put(body, where, new)
    return encode(body)


def nesting_of(body: bytes) -> int:
    """How deeply the JSON text nests arrays and objects (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte == ord('"'):
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


PLACEHOLDER = "\x00placeholder"


def with_raw(endpoint: Endpoint, draw: st.DrawFn, raw: bytes) -> bytes:
    """The endpoint's valid request with a node replaced by `raw` JSON text (which json.dumps could not write)."""
    body = encode(draw(template_with(endpoint, st.just(PLACEHOLDER))))
    return body.replace(encode(PLACEHOLDER), raw)


@st.composite
def huge(draw: st.DrawFn, endpoint: Endpoint) -> bytes:
    """A valid request with a string of up to 1.2 MB somewhere in it (the limit here is 1 MB)."""
    size = draw(st.sampled_from([MAX_BODY_BYTES - 2000, MAX_BODY_BYTES + 1]) | st.integers(10_000, 1_200_000))
    unit = draw(st.sampled_from(["x", "ab ", "é", "\U0001f600", "\n", "<|endoftext|>"]))
    return encode(draw(template_with(endpoint, st.just(unit * (size // len(unit))))))


@st.composite
def deep(draw: st.DrawFn, endpoint: Endpoint) -> bytes:
    """A valid request with arrays or objects nested up to 1,100 levels somewhere in it (orjson reads 1,024)."""
    depth = draw(st.integers(1, 1100))
    opening, closing = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    return with_raw(endpoint, draw, opening * depth + b"1" + closing * depth)


INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xa0\xa1", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"]


@st.composite
def not_json(draw: st.DrawFn, endpoint: Endpoint) -> bytes:
    """Bytes that are not a JSON object: invalid UTF-8, lone surrogates, NaN, cut short, empty, or noise."""
    valid = encode(endpoint.template)
    kind = draw(st.sampled_from(["invalid utf-8", "surrogate", "not a number", "cut short", "empty", "noise"]))
    if kind == "invalid utf-8":
        at = draw(st.integers(0, len(valid)))
        return valid[:at] + draw(st.sampled_from(INVALID_UTF8)) + valid[at:]
    if kind == "surrogate":
        lone = draw(st.sampled_from([b'"\\ud800"', b'"x\\udfff"', b'"\\ud83d\\ud83d"', b'"\\udc00\\ud800"']))
        return with_raw(endpoint, draw, lone)
    if kind == "not a number":
        return with_raw(endpoint, draw, draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e400"])))
    if kind == "cut short":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if kind == "empty":
        return b""
    return draw(st.binary(max_size=64))


def fields_of(endpoint: Endpoint) -> st.SearchStrategy[str]:
    return st.sampled_from(sorted(endpoint.template)) | st.text(max_size=10)


# Tests.


@AGENT_SERVER
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=str)
def test_any_json_value_gets_an_answer_or_a_4xx_in_the_dialects_shape(
    agent_fuzz: tuple[AgentFuzz, Answerer], endpoint: Endpoint
) -> None:
    fuzz, answerer = agent_fuzz
    objects = st.dictionaries(fields_of(endpoint), JSON_VALUES, max_size=6)

    @fuzzing(max_examples=25, database_url=fuzz.server.settings.database_url)
    @given(requests_for(st.one_of(JSON_VALUES, objects).map(encode)))
    def run(requests: list[Request]) -> None:
        fuzz.exchange(endpoint, requests)

    run()
    fuzz.check_consistent(answerer)


@AGENT_SERVER
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=str)
def test_almost_valid_requests_with_wrong_types_get_an_answer_or_a_4xx(
    agent_fuzz: tuple[AgentFuzz, Answerer], endpoint: Endpoint
) -> None:
    fuzz, answerer = agent_fuzz

    @fuzzing(max_examples=100, database_url=fuzz.server.settings.database_url)
    @given(requests_for(almost_valid(endpoint)))
    def run(requests: list[Request]) -> None:
        fuzz.exchange(endpoint, requests)

    run()
    fuzz.check_consistent(answerer)


@AGENT_SERVER
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=str)
def test_huge_strings_are_answered_below_the_body_limit_and_413_above(
    agent_fuzz: tuple[AgentFuzz, Answerer], endpoint: Endpoint
) -> None:
    fuzz, answerer = agent_fuzz

    @fuzzing(max_examples=12, database_url=fuzz.server.settings.database_url)
    @given(requests_for(huge(endpoint)))
    def run(requests: list[Request]) -> None:
        for request, response in fuzz.exchange(endpoint, requests):
            too_big = len(request.body) > MAX_BODY_BYTES
            assert (response.status_code == 413) == too_big, (len(request.body), response.status_code)

    run()
    fuzz.check_consistent(answerer)


@AGENT_SERVER
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=str)
def test_deep_nesting_gets_an_answer_or_a_400(agent_fuzz: tuple[AgentFuzz, Answerer], endpoint: Endpoint) -> None:
    fuzz, answerer = agent_fuzz

    @fuzzing(max_examples=30, database_url=fuzz.server.settings.database_url)
    @given(requests_for(deep(endpoint)))
    def run(requests: list[Request]) -> None:
        for request, response in fuzz.exchange(endpoint, requests):
            if nesting_of(request.body) > MAX_JSON_DEPTH:
                assert response.status_code == 400, (nesting_of(request.body), response.text[:300])

    run()
    fuzz.check_consistent(answerer)


@AGENT_SERVER
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=str)
def test_bytes_that_are_not_a_json_object_are_400(agent_fuzz: tuple[AgentFuzz, Answerer], endpoint: Endpoint) -> None:
    fuzz, answerer = agent_fuzz

    @fuzzing(max_examples=30, database_url=fuzz.server.settings.database_url)
    @given(requests_for(not_json(endpoint)))
    def run(requests: list[Request]) -> None:
        for _, response in fuzz.exchange(endpoint, requests):
            assert response.status_code == 400, response.text[:300]
            assert response.json()["error"]["type"] == "invalid_request_error"

    run()
    fuzz.check_consistent(answerer)


@AGENT_SERVER
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=str)
def test_the_templates_fuzzing_starts_from_are_answered(
    agent_fuzz: tuple[AgentFuzz, Answerer], endpoint: Endpoint
) -> None:
    """The fuzzers bend valid requests: these are valid, streamed or not, however the key and body are sent."""
    fuzz, answerer = agent_fuzz
    requests = [
        Request(encode({**endpoint.template, "stream": stream}), auth=auth, chunked=chunked)
        for stream in ([False, True] if endpoint.parks else [False])
        for auth, chunked in [("bearer", False), ("x-api-key", True), ("path", False)]
    ]
    for _, response in fuzz.exchange(endpoint, requests):
        assert response.status_code == 200
    fuzz.check_consistent(answerer)


# What fuzzing found, kept as plain cases: each was a 500 (or, on Postgres, a 503), or a turn holding no
# conversation at all, and is now a 400 in the dialect's shape that records nothing.

FOUND_IN_AGENT_CALLS = [
    (MESSAGES, {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": 5}]}]}, "content"),
    (COUNT_TOKENS, {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": 5}]}]}, "content"),
    (MESSAGES, {"messages": [{"role": "assistant", "content": [{"type": "text", "text": None}]}]}, "text"),
    (MESSAGES, {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": [1]}]}]}, "id"),
    (MESSAGES, {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": {}}]}]}, "id"),
    (RESPONSES, {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "output"),
    (RESPONSES, {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": 5}]}]}, "text"),
    (RESPONSES, {"input": [{"type": "function_call", "call_id": [], "name": "f"}]}, "call_id"),
    (CHAT, {"messages": [{"role": "tool", "tool_call_id": [1], "content": "x"}]}, "tool_call_id"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"id": {}}]}]}, "id"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": 5}]}, "tool_calls"),
    (CHAT, {"model": "gpt\x00", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    (MESSAGES, {"model": "claude\x00", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    (RESPONSES, {"input": []}, "input"),
    (MESSAGES, {"messages": [{"role": "user", "content": []}]}, "empty"),
]


@AGENT_SERVER
@pytest.mark.parametrize(("endpoint", "body", "hint"), FOUND_IN_AGENT_CALLS, ids=lambda v: str(v)[:40])
def test_agent_calls_fuzzing_found_are_400_and_record_nothing(
    agent_fuzz: tuple[AgentFuzz, Answerer], endpoint: Endpoint, body: dict[str, Any], hint: str
) -> None:
    fuzz, answerer = agent_fuzz
    [(_, response)] = fuzz.exchange(endpoint, [Request(encode(body))])
    assert response.status_code == 400, response.text
    assert hint in response.json()["error"]["message"], response.text
    fuzz.check_consistent(answerer)


FOUND_IN_TRAINER_CALLS = [
    ("/api/episodes", {"task": "\ud800"}, "task"),  # lone surrogates: Python's JSON parser lets them through
    ("/api/episodes", {"task": "fix\x00"}, "task"),  # Postgres text cannot hold U+0000
    ("/api/episodes", {"metadata": {"n": 2**64}}, "metadata"),  # beyond what orjson writes
    # Postgres cannot read a JSON value holding U+0000, and the database reads metadata (filters, the forks' index)
    ("/api/episodes", {"metadata": {"log": [{"k\x00": 1}]}}, "metadata"),
    ("/api/episodes", {"max_turns": 2**40}, "max_turns"),  # beyond Postgres INTEGER
    ("/api/episodes", {"policy": "model:gpt\x00"}, "policy"),
    ("/api/episodes/{episode}/finish", {"reason": "\udfff"}, "reason"),
    ("/api/episodes/{episode}/rewards", {"value": 1, "info": {"log": "\ud800"}}, "info"),
    ("/api/episodes/{episode}/rewards", {"value": 1, "name": "pass\x00"}, "name"),
    (
        "/api/turns/{turn}/reply",
        {"message": {"tool_calls": [{"function": {"name": "f", "arguments": {"n": 2**64}}}]}},
        "arguments",
    ),
    ("/api/turns/{turn}/reply", {"message": {"content": "ok", "reasoning_content": "\ud800"}}, "message"),
    ("/api/turns/{turn}/reply", {"message": {"content": "ok"}, "prompt_token_ids": [2**64]}, "prompt_token_ids"),
    (
        "/api/turns/{turn}/reply",
        {"message": {"content": "ok"}, "usage": {"prompt_tokens": 2**40, "completion_tokens": 1}},
        "usage",
    ),
    ("/api/turns/{turn}/reply", {"message": {"content": "ok"}, "policy_version": "v\x00"}, "policy_version"),
    ("/api/turns/replies", {"replies": [{"turn_id": "{turn}\x00", "message": {"content": "ok"}}]}, "turn_id"),
    ("/api/pause", {"retry_after_s": True}, "retry_after_s"),  # the schema says a number
]


@pytest.mark.parametrize(("path", "body", "hint"), FOUND_IN_TRAINER_CALLS, ids=lambda v: str(v)[:40])
def test_trainer_calls_fuzzing_found_are_422_and_change_nothing(
    server: Any, trainer: TrainerClient, path: str, body: dict[str, Any], hint: str
) -> None:
    """Each was a 500, a 503 (on Postgres, or on both), or a 200 for what the schema refuses."""
    agents = Agents(server.url)
    episode = trainer.create_episode()
    answer = agents.call(episode.key, "hello")
    [turn] = trainer.next_turns(episode=episode.id, wait_s=10, lease_s=600)  # leased throughout: nothing moves
    before = trainer.trajectory(episode.id).model_dump()
    raw = json.dumps(body).replace("{turn}", turn.id).encode()  # json.dumps writes lone surrogates as escapes
    response = httpx.post(
        server.url + path.format(episode=episode.id, turn=turn.id),
        content=raw,
        headers={"content-type": "application/json", **as_trainer(server)},
    )
    assert response.status_code == 422, response.text
    assert hint in response.json()["error"]["message"], response.text
    assert trainer.trajectory(episode.id).model_dump() == before
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]
    assert trainer.resume().released == 0  # nothing was paused
    trainer.reply(turn.id, "still answerable")
    assert answer.result(timeout=REQUEST_TIMEOUT_S).json()["choices"][0]["message"]["content"] == "still answerable"
    agents.pool.shutdown()


@pytest.mark.parametrize(
    "endpoint",
    [
        CHAT,
        RESPONSES,
        MESSAGES,
        COUNT_TOKENS,
    ],
    ids=str,
)
def test_other_methods_are_405_in_the_dialects_shape(server: Any, trainer: TrainerClient, endpoint: Endpoint) -> None:
    episode = trainer.create_episode()
    for method in ("GET", "PUT", "PATCH", "DELETE"):
        response = httpx.request(method, server.url + endpoint.path, headers={"x-api-key": episode.key})
        assert response.status_code == 405
        check_refusal(endpoint, response, method)
    assert trainer.trajectory(episode.id).turns == []


# Bugs fuzzing found outside the dialects and the wire models, each pinned by the case that found it.


def test_an_offset_too_large_for_the_database_is_a_422(server: Any) -> None:
    response = httpx.get(f"{server.url}/api/episodes", params={"offset": INT64_MAX + 1}, headers=as_trainer(server))
    assert response.status_code == 422, response.text


def test_an_id_holding_nul_is_unknown_on_every_route(server: Any, trainer: TrainerClient) -> None:
    routes = [
        ("GET", "/api/episodes/a%00b", None),
        ("GET", "/api/episodes/a%00b/trajectory", None),
        ("POST", "/api/episodes/a%00b/finish", {}),
        ("POST", "/api/episodes/a%00b/rewards", {"value": 1}),
        ("POST", "/api/episodes/a%00b/reset?wait=0", None),
        ("GET", "/api/turns/a%00b", None),
        ("POST", "/api/turns/a%00b/reply", {"message": {"content": "ok"}}),
        ("POST", "/api/turns/a%00b/forward", {"model": "m"}),
    ]
    for method, path, body in routes:
        response = httpx.request(method, server.url + path, json=body, headers=as_trainer(server))
        assert response.status_code == 404, (method, path, response.text)


@AGENT_SERVER
def test_a_role_holding_a_special_token_is_counted_as_text(agent_fuzz: tuple[AgentFuzz, Answerer]) -> None:
    fuzz, answerer = agent_fuzz
    episode = fuzz.trainer.create_episode()
    request = Request(encode({"messages": [{"role": "user<|endoftext|>", "content": "hi"}]}))
    counted = fuzz.send(COUNT_TOKENS, episode.key, request)
    assert counted.status_code == 200, counted.text
    answered = fuzz.send(CHAT, episode.key, request)  # no role the API has: refused, nothing recorded
    assert answered.status_code == 400 and "role must be one of" in answered.text, answered.text
    fuzz.check_consistent(answerer)
