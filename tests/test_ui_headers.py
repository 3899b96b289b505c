"""The page's security headers: no script but its own files (a Content-Security-Policy with no inline script), never
framed by another page (clickjacking the answer form), no type sniffing, no referrer; on every /ui response, pages,
redirects, refusals and static files alike. The trainer API and the agents' routes are left as they were."""

from __future__ import annotations

import re
from typing import Any

import httpx

from proxy.client import TrainerClient

EXPECTED = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def policy(response: httpx.Response) -> dict[str, str]:
    """The Content-Security-Policy's directives, by name."""
    text = response.headers.get("content-security-policy", "")
    return {name: value for name, _, value in (part.strip().partition(" ") for part in text.split(";")) if name}


def test_every_ui_response_carries_the_security_headers(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode(task="look")
    bearer = {"authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        responses = [
            http.get("/ui/login"),
            http.get("/ui/"),  # a redirect to the login form
            http.get("/ui/live"),  # a refusal: 401
            http.get("/ui/static/ui.css"),
            http.get("/ui/", headers=bearer),
            http.get(f"/ui/episodes/{episode.id}", headers=bearer),
            http.get("/ui/episodes/ep_nothing", headers=bearer),
            http.post("/ui/episodes/ep_x/rewards", headers={**bearer, "origin": "http://evil.example"}),
        ]
        for response in responses:
            where = f"{response.request.method} {response.request.url.path} {response.status_code}"
            assert {name: response.headers.get(name) for name in EXPECTED} == EXPECTED, where
            directives = policy(response)
            assert directives.get("frame-ancestors") == "'none'", where
            assert directives.get("script-src") == "'self'", where  # no 'unsafe-inline', no other origin
            assert directives.get("default-src") == "'self'" and directives.get("object-src") == "'none'", where
            assert directives.get("form-action") == "'self'" and directives.get("base-uri") == "'none'", where
        api = http.get("/api/episodes", headers=bearer)
        assert api.status_code == 200 and "content-security-policy" not in api.headers


def test_no_page_holds_an_inline_script_or_handler(server: Any, trainer: TrainerClient) -> None:
    """What the policy would block: a <script> without src, an on…= attribute, a javascript: link, a style= ."""
    episode = trainer.create_episode(task="look")
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}, timeout=10) as http:
        for path in ("/ui/", f"/ui/episodes/{episode.id}", "/ui/queue", "/ui/login", "/ui/summary"):
            text = http.get(path).text
            assert len(re.findall(r"<script\b", text)) == len(re.findall(r"<script\b[^>]*\bsrc=", text)), path
            assert not re.search(r"""\son[a-z]+\s*=|javascript:|\sstyle\s*=""", text, re.I), path


def test_a_form_posted_under_no_referrer_is_told_from_a_cross_site_one(server: Any) -> None:
    """Under `Referrer-Policy: no-referrer` a browser's own form posts `Origin: null`; `Sec-Fetch-Site` tells it
    from a sandboxed frame's or another site's, which browsers mark cross-site."""
    bearer = {"authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=bearer, timeout=10) as page:
        own = {"origin": "null", "sec-fetch-site": "same-origin"}
        assert page.post("/ui/episodes/ep_x/rewards", data={"value": "1"}, headers=own).status_code == 404
        for theirs in ({"origin": "null"}, {"origin": "null", "sec-fetch-site": "cross-site"}):
            refused = page.post("/ui/episodes/ep_x/rewards", data={"value": "1"}, headers=theirs)
            assert refused.status_code == 403 and "another site" in refused.text
